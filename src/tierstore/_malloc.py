"""Give memory freed by spilling back to the OS, so offloading really lowers RSS.

Note: [Returning host memory]
    A tensor the store wrote to disk is freed into glibc's heap, which keeps it: pushing a
    gigabyte of tensors through a small host tier grew peak RSS by several times what the store
    ever held. ``malloc_trim(0)`` returns free heap pages to the OS; run at most every
    ``_INTERVAL_SECONDS`` after spills, it keeps the growth to a fraction of that. Fixing
    glibc's mmap threshold instead does as well on RSS, but makes every large allocation of
    the whole process page-fault afresh, which is slow, so the store does not touch malloc's
    policy. A trim costs well under a millisecond, so it runs inline. docs/architecture.md
    ("Lifetime and cleanup") has the figures.

    Releases do not trim. What a release frees on the CPU is the caller's tensor (or the
    store's compact copy of it), which training without a store frees too and whose memory
    the next step allocates again; handing it back made that step fault it in afresh. With
    the host tier, which holds CPU tensors as they are, a training step took a fifth more
    page faults than without offloading (docs/performance.md, "The training step").
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable

from tierstore._libc import libc_function

__all__ = ["trim_now", "trim_soon"]

_INTERVAL_SECONDS = 0.02


_trim: Callable[[int], int] | None = libc_function("malloc_trim", [ctypes.c_size_t], ctypes.c_int)
_last = 0.0


def trim_soon() -> None:
    """Return free heap memory to the OS, at most every ``_INTERVAL_SECONDS`` (any thread)."""
    if time.monotonic() - _last >= _INTERVAL_SECONDS:
        trim_now()


def trim_now() -> bool:
    """Return free heap memory to the OS now; ``False`` where there is no ``malloc_trim``."""
    global _last
    if _trim is None:
        return False
    _last = time.monotonic()
    _trim(0)
    return True
