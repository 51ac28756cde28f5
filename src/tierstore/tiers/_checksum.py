"""CRC32C over raw memory, hardware-accelerated, computed without holding the GIL.

google_crc32c's functions accept only immutable ``bytes``: they refuse memoryviews of our mmap
buffers and of tensors, and copying a chunk into ``bytes`` would cost more than the checksum.
So we call the ``libcrc32c`` that the google-crc32c wheel bundles through ``ctypes``, which
releases the GIL around foreign calls; the I/O threads then checksum in parallel (about
26 GB/s per thread on the development machine). Where that library cannot be found we fall
back to google_crc32c on a copy, which is correct but slower, and :data:`IMPLEMENTATION` says so.
"""

from __future__ import annotations

import ctypes
import glob
import os
from typing import TYPE_CHECKING

import google_crc32c

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["IMPLEMENTATION", "crc32c"]


def _load_libcrc32c() -> Callable[[int, int, int], int] | None:
    package_dir = os.path.dirname(os.path.abspath(google_crc32c.__file__))
    candidates = sorted(glob.glob(os.path.join(package_dir + ".libs", "libcrc32c*.so*")))
    candidates += ["libcrc32c.so.1", "libcrc32c.so"]
    for name in candidates:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        extend = lib.crc32c_extend
        extend.restype = ctypes.c_uint32
        extend.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
        return extend
    return None


_EXTEND = _load_libcrc32c()

IMPLEMENTATION: str = (
    "libcrc32c via ctypes (no GIL)"
    if _EXTEND is not None
    else f"google_crc32c ({google_crc32c.implementation}) on a copy"
)
"""Which code computes checksums, for ``python -m tierstore info``."""


def crc32c(address: int, nbytes: int, crc: int = 0) -> int:
    """CRC32C of ``nbytes`` bytes of memory at ``address``, continuing from ``crc``.

    The caller keeps the memory alive for the duration of the call.
    """
    if _EXTEND is not None:
        return _EXTEND(crc, address, nbytes)
    return int(google_crc32c.extend(crc, ctypes.string_at(address, nbytes)))
