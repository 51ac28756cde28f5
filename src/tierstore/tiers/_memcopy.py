"""Copies and fills over raw addresses; short ones keep the GIL.

See Note: [Short foreign calls keep the GIL] in ``_checksum.py``.
"""

from __future__ import annotations

import ctypes

from tierstore.tiers._checksum import SHORT_CALL_BYTES

__all__ = ["memmove", "memset"]


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
