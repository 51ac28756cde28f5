"""trim_now() hands free heap memory back to the OS (Note: [Returning host memory])."""

from __future__ import annotations

import ctypes
import mmap
from typing import Any

import pytest
import torch

from tierstore import _malloc
from tierstore.testing import settled, wait_for

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


def _count_trims(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    monkeypatch.setattr(_malloc, "_trim", lambda pad: calls.append(pad) or 1)
    monkeypatch.setattr(_malloc, "_INTERVAL_SECONDS", 0.0)  # every trim_soon() trims
    return calls


def test_spilling_trims_the_heap(monkeypatch: pytest.MonkeyPatch, make_store: Any) -> None:
    calls = _count_trims(monkeypatch)
    store = make_store(host_bytes=0, device_bytes=0)
    handles = [store.put(torch.full((1 << 18,), float(i))) for i in range(4)]  # 1 MiB each
    wait_for(lambda: store.stats().disk.entries == 4 and settled(store), what="four spills")
    assert calls, "the spilled tensors' memory stayed in glibc's heap"
    for i, h in enumerate(handles):
        assert torch.equal(store.get(h), torch.full((1 << 18,), float(i)))


def test_releasing_what_was_never_spilled_leaves_the_heap_alone(
    monkeypatch: pytest.MonkeyPatch, make_store: Any
) -> None:
    # Training without a store frees these tensors too, and its next step allocates them
    # again: handing their memory back would only make that step fault it in afresh.
    calls = _count_trims(monkeypatch)
    store = make_store(host_bytes=64 << 20, device_bytes=0)
    tensors = [torch.full((1 << 18,), float(i)) for i in range(4)]
    handles = [store.put(t) for t in tensors]
    view = store.put(torch.arange(1 << 19, dtype=torch.float32)[1:])  # compacted: a copy
    assert store.stats().host.entries == 5
    for t, h in zip(tensors, handles, strict=True):
        assert torch.equal(store.get(h), t)
        store.release(h)
    store.release(view)
    del tensors
    wait_for(lambda: store.stats().host.entries == 0 and settled(store), what="releases")
    assert calls == []
