"""CRC32C over raw memory, hardware-accelerated, computed without holding the GIL.

google_crc32c's functions accept only immutable ``bytes``: they refuse memoryviews of our mmap
buffers and of tensors, and copying a chunk into ``bytes`` would cost more than the checksum.
So we call the ``libcrc32c`` that the google-crc32c wheel bundles through ``ctypes``, which
releases the GIL around foreign calls; the I/O threads then checksum in parallel, each far
faster than a disk (docs/disk-engine.md, "Checksums"). Where that library cannot be found we
fall back to google_crc32c on a copy, which is correct but slower, and :data:`IMPLEMENTATION`
says so.
"""

from __future__ import annotations

import ctypes
import glob
import os
from typing import TYPE_CHECKING

import google_crc32c

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["IMPLEMENTATION", "SHORT_CALL_BYTES", "crc32c"]


def _load_libcrc32c(
    loader: type[ctypes.CDLL] = ctypes.CDLL,
) -> Callable[[int, int, int], int] | None:
    package_dir = os.path.dirname(os.path.abspath(google_crc32c.__file__))
    candidates = sorted(glob.glob(os.path.join(package_dir + ".libs", "libcrc32c*.so*")))
    candidates += ["libcrc32c.so.1", "libcrc32c.so"]
    for name in candidates:
        try:
            lib = loader(name)
        except OSError:
            continue
        extend = lib.crc32c_extend
        extend.restype = ctypes.c_uint32
        extend.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
        return extend
    return None


_EXTEND = _load_libcrc32c()
# The same function called without releasing the GIL (ctypes.PyDLL), for small blocks: see
# Note: [Short foreign calls keep the GIL].
_EXTEND_HELD = _load_libcrc32c(ctypes.PyDLL)

SHORT_CALL_BYTES = 256 << 10
"""Blocks up to this size are checksummed and copied without releasing the GIL."""

IMPLEMENTATION: str = (
    "libcrc32c via ctypes (no GIL)"
    if _EXTEND is not None
    else f"google_crc32c ({google_crc32c.implementation}) on a copy"
)
"""Which code computes checksums, for ``python -m tierstore info``."""


def crc32c(address: int, nbytes: int, crc: int = 0) -> int:
    """CRC32C of ``nbytes`` bytes of memory at ``address``, continuing from ``crc``.

    The caller keeps the memory alive for the duration of the call.

    Note: [Short foreign calls keep the GIL]
        A ctypes call normally releases the GIL and takes it back when it returns. When other
        threads run Python meanwhile, taking it back can wait up to the interpreter's switch
        interval, so a pack of many small blobs, three calls each, spent longer waiting for
        the GIL than copying (docs/disk-engine.md, "Small blobs"). Blocks of at most
        :data:`SHORT_CALL_BYTES` (a few microseconds of work) are therefore checksummed and
        copied while holding the GIL; bigger ones release it.
    """
    if nbytes <= SHORT_CALL_BYTES and _EXTEND_HELD is not None:
        return _EXTEND_HELD(crc, address, nbytes)
    if _EXTEND is not None:
        return _EXTEND(crc, address, nbytes)
    return int(google_crc32c.extend(crc, ctypes.string_at(address, nbytes)))
