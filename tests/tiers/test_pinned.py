"""PinnedPool (Note: [The pinned pool]): one region, page-aligned buffers, reuse when free."""

from __future__ import annotations

import gc
import logging
import mmap

import pytest
import torch

from tierstore.tiers import _accelerator, _pinned
from tierstore.tiers._pinned import PinnedPool

PAGE = mmap.PAGESIZE
MiB = 1 << 20


class FakePinning:
    """Stands in for the accelerator's pinned allocator: page-aligned host memory, recorded."""

    def __init__(self) -> None:
        self.requests: list[int] = []
        self.maps: list[mmap.mmap] = []

    def __call__(self, nbytes: int) -> torch.Tensor:
        self.requests.append(nbytes)
        m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.maps.append(m)
        return torch.frombuffer(m, dtype=torch.uint8)


class Event:
    """An event that completes when told to."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


@pytest.fixture
def pinning(monkeypatch: pytest.MonkeyPatch) -> FakePinning:
    fake = FakePinning()
    monkeypatch.setattr(_accelerator, "pinned_empty", fake)
    return fake


def test_the_region_is_pinned_once_in_exact_power_of_two_pieces(pinning: FakePinning) -> None:
    """Note: [Pinned in power-of-two pieces]: 24 pages are pinned as 16 + 8, not rounded."""
    pool = PinnedPool(24 * PAGE)
    assert pinning.requests == []  # nothing before the first take
    for _ in range(3):
        assert pool.take(PAGE) is not None
    assert pinning.requests == [16 * PAGE, 8 * PAGE]
    assert pool.pinned is True


def test_buffers_are_page_aligned_and_own_exactly_their_bytes(pinning: FakePinning) -> None:
    pool = PinnedPool(8 * MiB)
    for n in (1, 4095, 4096, 4097, 3 * MiB + 5):
        got = pool.take(n)
        assert got is not None
        window, data = got
        assert window is data and data.numel() == n and data.data_ptr() % PAGE == 0
    window, data = pool.take(100, lead=64, span=4096 + 8)  # type: ignore[misc]
    assert window.data_ptr() % PAGE == 0 and window.numel() == 4096 + 8
    assert data.data_ptr() == window.data_ptr() + 64
    assert data.storage_offset() == 0 and data.untyped_storage().nbytes() == 100


def test_a_buffer_comes_back_when_its_last_tensor_dies(pinning: FakePinning) -> None:
    pool = PinnedPool(4 * PAGE)
    a = pool.take(4 * PAGE)[1]  # type: ignore[index]
    view = a[10:20]
    del a
    gc.collect()
    assert pool.take(PAGE) is None, "a buffer still used by a view was handed out"
    del view
    assert pool.free_bytes() == 4 * PAGE
    assert pool.take(4 * PAGE) is not None


def test_freed_neighbours_merge_within_a_piece(pinning: FakePinning) -> None:
    pool = PinnedPool(3 * PAGE)  # pieces of 2 pages and 1 page
    bufs = [pool.take(PAGE) for _ in range(3)]
    assert all(b is not None for b in bufs) and pool.take(1) is None
    del bufs
    two = pool.take(2 * PAGE)
    assert two is not None  # the 2-page piece merged again
    assert pool.take(2 * PAGE) is None  # never across two pieces
    assert pool.take(PAGE) is not None


def test_a_held_buffer_waits_for_its_copy(pinning: FakePinning) -> None:
    pool = PinnedPool(PAGE)
    data = pool.take(PAGE)[1]  # type: ignore[index]
    copy = Event()
    pool.hold(data, copy)
    del data
    assert pool.take(PAGE) is None, "a buffer a copy still reads was handed out"
    copy.done = True
    assert pool.take(PAGE) is not None


def test_pinning_failure_falls_back_to_pageable_memory_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def refuse(nbytes: int) -> torch.Tensor:
        raise RuntimeError("cudaErrorMemoryAllocation")

    monkeypatch.setattr(_accelerator, "pinned_empty", refuse)
    monkeypatch.setattr(_pinned, "_warned_pageable", False)
    with caplog.at_level(logging.WARNING, logger="tierstore"):
        pools = [PinnedPool(2 * MiB) for _ in range(2)]
        bufs = [p.take(MiB) for p in pools]
    assert all(b is not None and b[1].data_ptr() % PAGE == 0 for b in bufs)
    assert [p.pinned for p in pools] == [False, False]
    warnings = [r for r in caplog.records if "pinning" in r.getMessage()]
    assert len(warnings) == 1 and "pageable" in warnings[0].getMessage()


def test_an_empty_pool_takes_nothing(pinning: FakePinning) -> None:
    assert PinnedPool(0).take(1) is None
    assert pinning.requests == []
    with pytest.raises(ValueError, match="do not fit"):
        PinnedPool(PAGE).take(PAGE, lead=1, span=PAGE)
