"""CRC32C over raw memory, hardware-accelerated, computed without holding the GIL.

Note: [Where the CRC32C comes from]
    Every spilled byte is checksummed once written and once read, so the checksum is a large
    part of the store's CPU per byte. Two libraries compute CRC32C in hardware; we call both
    through ``ctypes`` on raw addresses, which releases the GIL around the call, so the I/O
    threads checksum in parallel:

    * ISA-L's ``crc32_iscsi`` (CRC32C is the iSCSI CRC), from the library the ``isal`` wheel
      links into its ``isal_zlib`` module. It folds 8 or 16 blocks at once with PCLMUL or
      AVX-512 and runs at 32-48 GB/s on the development machine, against 15 GB/s for
      google-crc32c's SSE4.2 kernel: it more than halves the checksum's share of a spill
      (docs/performance.md, "CPU per byte"). ISA-L picks its kernel for the CPU at the
      first call.
    * ``libcrc32c``, bundled by the google-crc32c wheel, where ISA-L cannot be loaded.

    google_crc32c's Python functions accept only immutable ``bytes``: they refuse memoryviews
    of our mmap buffers and of tensors, and copying a chunk into ``bytes`` would cost more
    than the checksum. So where neither library loads, we fall back to them on a copy, which
    is correct but slower. :data:`IMPLEMENTATION` says which is in use.
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

_ALL_ONES = 0xFFFFFFFF
_ISAL_MAX_CALL = 1 << 30
"""``crc32_iscsi`` takes an ``int`` length: longer blocks go in pieces of this size."""


def _load_isal(loader: type[ctypes.CDLL] = ctypes.CDLL) -> Callable[[int, int, int], int] | None:
    """ISA-L's CRC32C as ``extend(crc, address, nbytes)``, or None where it cannot be loaded."""
    try:
        from isal import isal_zlib
    except ImportError:
        return None
    try:
        lib = loader(isal_zlib.__file__)
        iscsi = lib.crc32_iscsi
    except (OSError, AttributeError):
        return None
    iscsi.restype = ctypes.c_uint32
    iscsi.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32]

    def extend(crc: int, address: int, nbytes: int) -> int:
        # ISA-L keeps the CRC register un-inverted between calls; the standard value is its
        # complement before and after.
        state = crc ^ _ALL_ONES
        while nbytes > _ISAL_MAX_CALL:
            state = iscsi(address, _ISAL_MAX_CALL, state)
            address += _ISAL_MAX_CALL
            nbytes -= _ISAL_MAX_CALL
        return int(iscsi(address, nbytes, state)) ^ _ALL_ONES

    return extend


def _load_libcrc32c(
    loader: type[ctypes.CDLL] = ctypes.CDLL,
) -> Callable[[int, int, int], int] | None:
    """google-crc32c's ``crc32c_extend(crc, address, nbytes)``, or None."""
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


def _load(
    loader: type[ctypes.CDLL],
) -> tuple[Callable[[int, int, int], int] | None, str]:
    isal = _load_isal(loader)
    if isal is not None:
        return isal, "ISA-L crc32_iscsi via ctypes (no GIL)"
    libcrc32c = _load_libcrc32c(loader)
    if libcrc32c is not None:
        return libcrc32c, "libcrc32c via ctypes (no GIL)"
    return None, f"google_crc32c ({google_crc32c.implementation}) on a copy"


_EXTEND, IMPLEMENTATION = _load(ctypes.CDLL)
"""``IMPLEMENTATION``: which code computes checksums, for ``python -m tierstore info``."""
# The same function called without releasing the GIL (ctypes.PyDLL), for small blocks: see
# Note: [Short foreign calls keep the GIL].
_EXTEND_HELD, _ = _load(ctypes.PyDLL)

SHORT_CALL_BYTES = 256 << 10
"""Blocks up to this size are checksummed and copied without releasing the GIL."""


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
