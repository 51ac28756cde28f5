"""Make glibc give freed tensor memory back to the OS, so spilling really lowers RSS.

Note: [Returning host memory]
    glibc raises its mmap threshold each time a large block is freed (up to 32 MiB), after
    which 16 MiB activations come from fragmented heaps that are never trimmed: on the
    development machine, pushing 1 GiB through a 64 MiB host tier grew RSS by 527 MiB instead
    of the ~130 MiB the store held. A fixed 1 MiB threshold keeps every large tensor in its
    own mapping, returned to the OS on free (peak growth 131 MiB in the same run). The store
    sets it once per process, unless the user chose their own with MALLOC_MMAP_THRESHOLD_.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

__all__ = ["return_freed_memory_to_os"]

log = logging.getLogger("tierstore")

_M_MMAP_THRESHOLD = -3
_THRESHOLD = 1 << 20
_done = False


def return_freed_memory_to_os() -> bool:
    """Fix glibc's mmap threshold at 1 MiB once per process; return whether it is set."""
    global _done
    if _done:
        return True
    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    _done = bool(mallopt(_M_MMAP_THRESHOLD, _THRESHOLD))
    if _done:
        log.debug("tierstore: glibc mmap threshold fixed at 1 MiB so freed tensors leave RSS")
    return _done
