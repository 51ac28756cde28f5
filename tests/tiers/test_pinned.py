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


def test_the_region_grows_as_needed_in_exact_power_of_two_pieces(pinning: FakePinning) -> None:
    """Note: [Pinned as needed, in power-of-two pieces]: 24 pages grow as 16 + 8, not rounded."""
    pool = PinnedPool(24 * PAGE)
    assert pinning.requests == []  # nothing before the first take
    bufs = [pool.take(PAGE) for _ in range(16)]
    assert pinning.requests == [16 * PAGE]  # the largest power of two the capacity allows
    bufs.append(pool.take(PAGE))
    assert pinning.requests == [16 * PAGE, 8 * PAGE]
    assert pool.pinned is True and all(b is not None for b in bufs)
    rest = [pool.take(PAGE) for _ in range(7)]  # held, so that none goes back
    assert None not in rest and pool.take(PAGE) is None  # 24 pages taken: the pool is full
    assert pinning.requests == [16 * PAGE, 8 * PAGE]


def test_an_unlimited_pool_pins_what_is_used_not_the_machine(pinning: FakePinning) -> None:
    """host_bytes="unlimited" once tried to pin all of RAM at the first copy, and on a GPU
    machine PyTorch kept the pieces that did pin cached, out of the OS's reach: OOM-killed."""
    pool = PinnedPool(1 << 62)  # capped at the machine's memory
    assert pool.capacity > 64 * MiB
    small = pool.take(MiB)
    assert pinning.requests == [64 * MiB]  # the first piece
    big = pool.take(100 * MiB)
    assert pinning.requests == [64 * MiB, 128 * MiB]  # doubles, and holds the request
    more = [
        pool.take(20 * MiB) for _ in range(4)
    ]  # three fit in the first piece, one in the second
    assert pinning.requests == [64 * MiB, 128 * MiB]
    more.append(pool.take(20 * MiB))  # 8 MiB left in each: a third piece, 256 MiB
    assert pinning.requests == [64 * MiB, 128 * MiB, 256 * MiB]
    assert small is not None and big is not None and None not in more


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
    assert pinning.requests == [2 * PAGE, PAGE]
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


def test_once_a_piece_fails_to_pin_the_pool_grows_pageable(
    pinning: FakePinning, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = PinnedPool(256 * MiB)
    first = pool.take(64 * MiB)
    assert pool.pinned is True and pinning.requests == [64 * MiB]

    def refuse(nbytes: int) -> torch.Tensor:
        pinning.requests.append(nbytes)
        raise RuntimeError("cudaErrorMemoryAllocation")

    monkeypatch.setattr(_accelerator, "pinned_empty", refuse)
    monkeypatch.setattr(_pinned, "_warned_pageable", True)
    second = pool.take(64 * MiB)
    third = pool.take(100 * MiB)
    assert first is not None and second is not None and third is not None
    assert pool.pinned is False
    assert pinning.requests == [64 * MiB, 64 * MiB]  # no second try after a failure
    second[1].fill_(7)
    assert int(second[1].sum()) == 7 * 64 * MiB


def test_an_empty_pool_takes_nothing(pinning: FakePinning) -> None:
    assert PinnedPool(0).take(1) is None
    assert pinning.requests == []
    with pytest.raises(ValueError, match="do not fit"):
        PinnedPool(PAGE).take(PAGE, lead=1, span=PAGE)


def test_threads_taking_while_the_pool_grows_never_share_a_byte(pinning: FakePinning) -> None:
    """Four threads take and drop buffers of 1 B to 9 MiB while the region grows piece by
    piece: no two live buffers overlap, every piece is a power of two pages within the
    capacity, and everything comes back."""
    import random
    import threading

    pool = PinnedPool(96 * MiB)
    live: dict[int, tuple[int, int]] = {}  # id(buffer) -> (start, end)
    lock = threading.Lock()
    errors: list[str] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        held: list[torch.Tensor] = []
        for _ in range(400):
            if held and rng.random() < 0.4:
                buf = held.pop(rng.randrange(len(held)))
                with lock:
                    del live[id(buf)]
                del buf
                continue
            n = rng.choice([1, PAGE, 5 * PAGE + 3, 200 * 1024, 3 * MiB, 9 * MiB])
            got = pool.take(n)
            if got is None:
                continue  # full for the moment: the caller uses ordinary memory
            window = got[0]
            start = window.data_ptr()
            end = start + window.numel()
            pieces = pool.pieces()
            with lock:
                if not any(a <= start and end <= a + size for a, size in pieces):
                    errors.append(f"{(start, end)} is not inside one piece of {pieces}")
                for other, (s, e) in live.items():
                    if start < e and s < end:
                        errors.append(f"{(start, end)} overlaps {(s, e)} of {other}")
                live[id(window)] = (start, end)
            window[0] = seed  # touch it
            held.append(window)
        with lock:
            for buf in held:
                del live[id(buf)]
        held.clear()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    gc.collect()
    assert not errors, errors[:3]
    assert all(r % PAGE == 0 and (r // PAGE) & (r // PAGE - 1) == 0 for r in pinning.requests)
    assert sum(pinning.requests) <= 96 * MiB and len(pinning.requests) >= 2
    assert pool.free_bytes() == pool.capacity
    # Every piece merged back whole: each can be taken in one buffer again.
    whole = [pool.take(size) for _, size in sorted(pool.pieces(), key=lambda p: -p[1])]
    assert None not in whole


def test_a_pieces_last_page_freed_after_the_next_pieces_first_does_not_merge_with_it(
    pinning: FakePinning,
) -> None:
    """The first page of the second piece is freed before the last page of the first: the
    two touch in the pool's page numbering but not in memory. Merged, a two-page buffer was
    handed out that ran off the end of the first piece."""
    pool = PinnedPool(3 * PAGE)  # pieces of 2 pages and 1 page
    first, second, third = (pool.take(PAGE) for _ in range(3))
    assert pinning.requests == [2 * PAGE, PAGE] and first is not None
    del third
    gc.collect()
    assert pool.free_bytes() == PAGE  # the second piece's page is back in the free list
    del second
    gc.collect()
    assert pool.take(2 * PAGE) is None


def test_pinned_memory_off_a_page_boundary_is_used_from_its_first_whole_page(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An allocator may hand out pinned memory that starts past a page boundary. Buffers must
    still be page-aligned (O_DIRECT reads and writes need it), so the piece is used from its
    first whole page; used from where it started, every buffer was off by as much."""
    maps: list[mmap.mmap] = []

    def off_a_page(nbytes: int) -> torch.Tensor:
        m = mmap.mmap(-1, nbytes + PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        maps.append(m)
        return torch.frombuffer(m, dtype=torch.uint8, count=nbytes, offset=64)

    monkeypatch.setattr(_accelerator, "pinned_empty", off_a_page)
    pool = PinnedPool(4 * PAGE)
    got = pool.take(PAGE)
    assert got is not None and got[0].data_ptr() % PAGE == 0
    assert pool.pieces()[0][1] == 3 * PAGE  # the whole pages in it
