"""trim_now() hands free heap memory back to the OS (Note: [Returning host memory])."""

from __future__ import annotations

import ctypes
import mmap

import pytest

from tierstore import _malloc

glibc_only = pytest.mark.skipif(_malloc._trim is None, reason="needs glibc's malloc_trim")


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * mmap.PAGESIZE


@glibc_only
def test_trim_now_hands_free_heap_memory_back_to_the_os() -> None:
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    # 64 KiB blocks stay below glibc's mmap threshold, so they come from the heap; the last
    # one stays allocated and keeps free() from trimming the heap's top on its own.
    blocks = [libc.malloc(64 << 10) for _ in range(641)]
    guard = blocks.pop()
    try:
        for b in blocks:
            ctypes.memset(b, 1, 64 << 10)
        before = _resident_bytes()
        for b in blocks:
            libc.free(b)
        held = _resident_bytes()
        assert before - held < 10 << 20  # free() kept the memory in the heap
        assert _malloc.trim_now()
        assert held - _resident_bytes() >= 30 << 20  # of the 40 MiB freed
    finally:
        libc.free(guard)


def test_trim_now_says_when_there_is_nothing_to_call(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_malloc, "_trim", None)
    assert not _malloc.trim_now()
