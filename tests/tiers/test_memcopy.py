"""prefault() in tiers/_memcopy.py (Note: [Prefaulting a read's destination])."""

from __future__ import annotations

import ctypes
import errno
import mmap
import sys

import numpy as np
import pytest
import torch

from tierstore.tiers import _memcopy
from tierstore.tiers._memcopy import PREFAULT_MIN_BYTES, prefault

PAGE = mmap.PAGESIZE

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux's")


def _fresh_pages(npages: int) -> tuple[mmap.mmap, torch.Tensor]:
    m = mmap.mmap(-1, npages * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return m, torch.frombuffer(m, dtype=torch.uint8)


def _resident(address: int, npages: int) -> list[bool]:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    vec = (ctypes.c_ubyte * npages)()
    assert libc.mincore(address, npages * PAGE, vec) == 0, ctypes.get_errno()
    return [bool(v & 1) for v in vec]


def _populate_supported() -> bool:
    m, t = _fresh_pages(8)
    try:
        return prefault(t.data_ptr(), 8 * PAGE)
    finally:
        del t
        m.close()


@linux_only
def test_prefault_makes_exactly_the_covering_pages_resident() -> None:
    if not _populate_supported():
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
    m, t = _fresh_pages(32)
    try:
        base = t.data_ptr()
        assert _resident(base, 32) == [False] * 32
        # 64 KiB starting 100 bytes into page 3 covers pages 3..19 (17 pages).
        assert prefault(base + 3 * PAGE + 100, 64 << 10)
        assert _resident(base, 32) == [False] * 3 + [True] * 17 + [False] * 12
    finally:
        del t
        m.close()


@linux_only
def test_prefault_never_changes_memory_including_the_neighbours_on_shared_pages() -> None:
    m, t = _fresh_pages(32)
    try:
        t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8))
        before = t.clone()
        prefault(t.data_ptr() + 1000, 20 * PAGE + 7)
        assert torch.equal(t, before)
    finally:
        del t
        m.close()


def test_prefault_leaves_short_ranges_to_the_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, int, int]] = []

    def spy(addr: int, length: int, advice: int) -> int:
        calls.append((addr, length, advice))
        return 0

    monkeypatch.setattr(_memcopy, "_madvise", spy)
    monkeypatch.setattr(_memcopy, "_kernel_knows", True)
    assert not prefault(PAGE, PREFAULT_MIN_BYTES - 1)
    assert calls == []
    assert prefault(PAGE + 1, PREFAULT_MIN_BYTES)
    assert calls == [(PAGE, PREFAULT_MIN_BYTES + PAGE, _memcopy._MADV_POPULATE_WRITE)]


def test_a_kernel_without_populate_write_turns_prefaulting_off_for_good(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = 0

    def old_kernel(addr: int, length: int, advice: int) -> int:
        nonlocal calls
        calls += 1
        ctypes.set_errno(errno.EINVAL)
        return -1

    monkeypatch.setattr(_memcopy, "_madvise", old_kernel)
    monkeypatch.setattr(_memcopy, "_kernel_knows", None)
    assert not prefault(PAGE, 64 << 10)
    assert not prefault(PAGE, 64 << 10)
    assert calls == 1  # the probe; nothing after it
    assert _memcopy._kernel_knows is False


@linux_only
def test_a_mapping_that_refuses_leaves_prefaulting_on_for_the_others(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A read-only mapping answers MADV_POPULATE_WRITE with EINVAL, as a kernel without the
    # flag does; so may a driver's pinned host memory (VM_IO | VM_PFNMAP). Neither may switch
    # prefaulting off for the plain memory of every later read.
    if not _populate_supported():
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
    monkeypatch.setattr(_memcopy, "_kernel_knows", None)
    ro = mmap.mmap(-1, 16 * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, prot=mmap.PROT_READ)
    view = np.frombuffer(ro, dtype=np.uint8)
    try:
        assert not prefault(view.ctypes.data, 16 * PAGE)
        assert ctypes.get_errno() == errno.EINVAL
    finally:
        del view
        ro.close()
    m, t = _fresh_pages(16)
    try:
        assert prefault(t.data_ptr(), 16 * PAGE)
        assert _resident(t.data_ptr(), 16) == [True] * 16
    finally:
        del t
        m.close()


def test_a_passing_failure_keeps_prefaulting_on(monkeypatch: pytest.MonkeyPatch) -> None:
    # ENOMEM (say, a range that is not all mapped) says nothing about the kernel's support.
    def enomem(addr: int, length: int, advice: int) -> int:
        ctypes.set_errno(errno.ENOMEM)
        return -1

    monkeypatch.setattr(_memcopy, "_madvise", enomem)
    monkeypatch.setattr(_memcopy, "_kernel_knows", True)
    assert not prefault(PAGE, 64 << 10)
    assert _memcopy._kernel_knows is True
