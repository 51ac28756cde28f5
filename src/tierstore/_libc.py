"""The C library, loaded once, for the few calls the ``os`` module lacks."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from typing import Any

__all__ = ["libc_function"]


def _load() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


_LIBC = _load()


def libc_function(name: str, argtypes: list[Any], restype: Any) -> Any | None:
    """The C library's ``name`` with its prototype set, or ``None`` off Linux or where the
    library lacks it (musl has no ``malloc_trim``). Errors are read with ``ctypes.get_errno``."""
    if _LIBC is None or not sys.platform.startswith("linux"):
        return None
    fn = getattr(_LIBC, name, None)
    if fn is None:
        return None
    fn.argtypes = argtypes
    fn.restype = restype
    return fn
