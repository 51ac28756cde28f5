"""Copies and fills over raw addresses; short ones keep the GIL.

See Note: [Short foreign calls keep the GIL].

Note: [Prefaulting a read's destination]
    A small tensor read back from disk is copied out of a bounce buffer into memory the kernel
    often does not back yet: a read-pool buffer mapped in this sweep, or below 32 KiB a fresh
    ``torch.empty``, whose pages the store's ``malloc_trim`` (Note: [Returning host memory])
    and glibc's own heap trimming hand back. The copy would take one page fault per 4 KiB.
    Asking for the pages first with one ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14+), which
    releases the GIL, and then copying into present pages is faster, per copy and per small
    tensor read back (docs/disk-engine.md, "Small blobs"). Populating never changes the
    contents of memory, so the range may include the neighbours that share its first and last
    page.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
from typing import TYPE_CHECKING

from tierstore._libc import libc_function
from tierstore.tiers._checksum import SHORT_CALL_BYTES

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["memmove", "memset", "prefault"]

log = logging.getLogger("tierstore")


# ctypes.memmove/memset themselves release the GIL; these prototypes call the same C functions
# without releasing it.
_held = ctypes.PYFUNCTYPE
_memmove_held = _held(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)(
    ctypes._memmove_addr  # type: ignore[attr-defined]
)
_memset_held = _held(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t)(
    ctypes._memset_addr  # type: ignore[attr-defined]
)


def memmove(dst: int, src: int, nbytes: int) -> None:
    """Copy ``nbytes`` from address ``src`` to ``dst``; short copies keep the GIL.

    See Note: [Short foreign calls keep the GIL].
    """
    if nbytes <= SHORT_CALL_BYTES:
        _memmove_held(dst, src, nbytes)
    else:
        ctypes.memmove(dst, src, nbytes)


def memset(dst: int, value: int, nbytes: int) -> None:
    """Fill ``nbytes`` at address ``dst`` with ``value``; short fills keep the GIL."""
    if nbytes <= SHORT_CALL_BYTES:
        _memset_held(dst, value, nbytes)
    else:
        ctypes.memset(dst, value, nbytes)


_PAGE = mmap.PAGESIZE
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
PREFAULT_MIN_BYTES = 16 << 10
"""Below four pages, a system call costs more than the faults it saves."""


_madvise: Callable[[int, int, int], int] | None = libc_function(
    "madvise", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
)
_kernel_knows: bool | None = None
"""Whether this kernel knows ``MADV_POPULATE_WRITE``: probed once, on memory of our own."""


def _probe(fn: Callable[[int, int, int], int]) -> bool:
    # EINVAL means either "unknown advice" (a kernel before 5.14) or "this mapping refuses"
    # (read-only, VM_IO or VM_PFNMAP mappings, such as a driver's pinned host memory). Only a
    # probe on a plain writable page of our own tells the two apart.
    buf = ctypes.create_string_buffer(2 * _PAGE)
    page = -(-ctypes.addressof(buf) // _PAGE) * _PAGE
    if fn(page, _PAGE, _MADV_POPULATE_WRITE) == 0:
        return True
    err = ctypes.get_errno()
    log.debug(
        "tierstore: madvise(MADV_POPULATE_WRITE) unsupported (%s); not prefaulting",
        errno.errorcode.get(err, err),
    )
    return False


def prefault(dst: int, nbytes: int) -> bool:
    """Make the pages under ``nbytes`` at ``dst`` present and writable, without writing them.

    See Note: [Prefaulting a read's destination]. Unlike a short copy, the call releases the
    GIL: it is the part that faults, and keeping the GIL through it was no faster.
    Returns whether the kernel populated the range; ``False`` for ranges under
    :data:`PREFAULT_MIN_BYTES`, off Linux, for a mapping that refuses (read-only, or a
    driver's pinned memory, which is resident anyway), and for good when the kernel does not
    know ``MADV_POPULATE_WRITE`` (before 5.14). Whenever it returns ``False`` the copy simply
    faults as it would have.
    """
    global _kernel_knows
    fn = _madvise
    if fn is None or nbytes < PREFAULT_MIN_BYTES:
        return False
    if _kernel_knows is None:
        _kernel_knows = _probe(fn)
    if not _kernel_knows:
        return False
    lo = dst - dst % _PAGE
    hi = -(-(dst + nbytes) // _PAGE) * _PAGE
    return fn(lo, hi - lo, _MADV_POPULATE_WRITE) == 0
