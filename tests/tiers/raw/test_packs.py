"""Small blobs in the raw engine: packs, grouped reads, batch calls (Note: [Small blobs travel
in packs])."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import mmap
import os
import threading
from typing import TYPE_CHECKING, Any

import pytest
import torch

from tierstore.config import StoreConfig
from tierstore.errors import CorruptTensorError
from tierstore.testing import KiB, MiB, make_dirs, random_bytes, short_io
from tierstore.tiers import WriteRequest, _checksum, _memcopy
from tierstore.tiers.raw import RawEngine, _chunk_io
from tierstore.tiers.raw._layout import PackedBlob
from tierstore.tiers.raw._syscalls import PAGE, pad

from .backdoor import stored_bytes

if TYPE_CHECKING:
    from collections.abc import AsyncIterator
    from pathlib import Path


@pytest.fixture
def config() -> StoreConfig:
    # Chunks of 1 MiB: packs hold up to 1 MiB, and blobs up to 1 MiB are packed.
    return StoreConfig.from_env({}, io_chunk_bytes=MiB, io_threads=4)


@pytest.fixture
async def engine(tmp_path: Path, config: StoreConfig) -> AsyncIterator[RawEngine]:
    e = RawEngine(make_dirs(tmp_path, 1), config)
    yield e
    await e.close()


def _packed(engine: RawEngine, key: int) -> PackedBlob:
    blob = engine.layout(key)
    assert isinstance(blob, PackedBlob)
    return blob


async def _read_back(engine: RawEngine, srcs: dict[int, torch.Tensor]) -> None:
    for k, t in srcs.items():
        out = torch.empty_like(t)
        await engine.read(k, out)
        assert torch.equal(out, t), k


async def test_writes_arriving_together_go_out_as_one_pack(engine: RawEngine) -> None:
    srcs = {k: random_bytes(5 * KiB + k, seed=k) for k in range(64)}  # 64 x 8 KiB padded
    await asyncio.gather(*(engine.write(k, t) for k, t in srcs.items()))
    assert engine.packs_written == 1
    extents = sorted(_packed(engine, k).offset for k in srcs)
    # Each blob owns its own page-aligned piece, one after another.
    assert extents == [extents[0] + i * 2 * PAGE for i in range(64)]
    for k, t in srcs.items():
        assert stored_bytes(engine, k) == t.numpy().tobytes()


async def test_a_full_pack_goes_out_and_the_next_one_opens(engine: RawEngine) -> None:
    srcs = {k: random_bytes(256 * KiB, seed=k) for k in range(10)}  # 4 fit in 1 MiB
    await asyncio.gather(*(engine.write(k, t) for k, t in srcs.items()))
    assert engine.packs_written == 3
    await _read_back(engine, srcs)


async def test_blobs_bigger_than_a_pack_are_not_packed(engine: RawEngine) -> None:
    await engine.write(1, random_bytes(MiB + 1))
    assert engine.packs_written == 0
    assert len(engine.layout(1).pieces()) == 2


async def test_a_packed_blob_is_freed_on_its_own(engine: RawEngine) -> None:
    srcs = {k: random_bytes(16 * KiB, seed=k) for k in range(8)}
    await asyncio.gather(*(engine.write(k, t) for k, t in srcs.items()))
    free = engine.reusable_bytes()
    await engine.delete(3)
    assert engine.reusable_bytes() == free + 16 * KiB
    # The hole is reused by the next blob that fits, and the neighbours are untouched.
    hole = _packed(engine, 4).offset - 16 * KiB
    await engine.write(99, random_bytes(16 * KiB, seed=99))
    assert _packed(engine, 99).offset == hole
    del srcs[3]
    await _read_back(engine, srcs)


async def test_neighbours_are_read_with_one_request(
    engine: RawEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    srcs = {k: random_bytes(20 * KiB + k, seed=k) for k in range(16)}
    await asyncio.gather(*(engine.write(k, t) for k, t in srcs.items()))
    reads: list[int] = []
    real = os.preadv

    def counting(fd: int, bufs: list[memoryview], offset: int) -> int:
        reads.append(len(bufs[0]))
        return real(fd, bufs, offset)

    monkeypatch.setattr(os, "preadv", counting)
    outs = {k: torch.empty_like(t) for k, t in srcs.items()}
    await asyncio.gather(*(engine.read(k, outs[k]) for k in reversed(srcs)))
    assert len(reads) == 1 and engine.grouped_reads == 1
    for k, t in srcs.items():
        assert torch.equal(outs[k], t)


@pytest.mark.parametrize("in_place", [False, True], ids=["bounced", "in-place"])
async def test_a_damaged_blob_fails_alone_in_its_group(engine: RawEngine, in_place: bool) -> None:
    """Through the bounce buffer, or read in place (Note: [Packed reads land in place]), where
    the checksum is taken on the destination."""
    srcs = {k: random_bytes(12 * KiB + 7, seed=k) for k in range(6)}
    await asyncio.gather(*(engine.write(k, t) for k, t in srcs.items()))
    b = _packed(engine, 2)
    with open(b.file.path, "r+b") as f:
        f.seek(b.offset + 5000)
        byte = f.read(1)
        f.seek(b.offset + 5000)
        f.write(bytes([byte[0] ^ 0x10]))
    outs = {k: _on_a_page(t.numel()) if in_place else torch.empty_like(t) for k, t in srcs.items()}
    results = await asyncio.gather(*(engine.read(k, outs[k]) for k in srcs), return_exceptions=True)
    assert isinstance(results[2], CorruptTensorError)
    assert "CRC32C" in str(results[2])
    for k, t in srcs.items():
        if k != 2:
            assert results[k] is None
            assert torch.equal(outs[k], t)


async def test_a_spill_file_cut_inside_a_group_fails_only_the_blobs_past_the_cut(
    engine: RawEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A group of neighbours is read with one request; a file cut short inside the span
    failed every blob of the group, those wholly before the cut too."""
    srcs = {k: random_bytes(12 * KiB + 7, seed=k) for k in range(3)}
    await asyncio.gather(*(engine.write(k, t) for k, t in srcs.items()))
    assert len({_packed(engine, k).file for k in srcs}) == 1
    cut = _packed(engine, 2)
    os.truncate(cut.file.path, cut.offset + 100)
    spans: list[int] = []
    real = engine._io.read_span

    def recording(blobs: Any, outs: Any) -> Any:
        spans.append(len(blobs))
        return real(blobs, outs)

    monkeypatch.setattr(engine._io, "read_span", recording)
    outs = {k: torch.empty_like(t) for k, t in srcs.items()}
    results = await asyncio.gather(*(engine.read(k, outs[k]) for k in srcs), return_exceptions=True)
    assert spans[0] == 3  # one group: the cut is inside its span
    assert isinstance(results[2], CorruptTensorError), results[2]
    for k in (0, 1):
        assert results[k] is None, results[k]
        assert torch.equal(outs[k], srcs[k])


async def test_a_group_cancelled_while_it_reads_blob_by_blob_still_answers_its_readers(
    engine: RawEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A group whose span failed reads its blobs one by one; cancelled then (a loop torn
    down), its readers were never answered and waited for ever."""
    srcs = {k: random_bytes(12 * KiB + 7, seed=k) for k in range(3)}
    await asyncio.gather(*(engine.write(k, t) for k, t in srcs.items()))
    cut = _packed(engine, 2)
    os.truncate(cut.file.path, cut.offset + 100)
    gate, alone = threading.Event(), threading.Event()
    real = engine._io.read_span

    def held_when_alone(blobs: Any, outs: Any) -> Any:
        if len(blobs) == 1:
            alone.set()
            gate.wait(10)
        return real(blobs, outs)

    monkeypatch.setattr(engine._io, "read_span", held_when_alone)
    outs = {k: torch.empty_like(t) for k, t in srcs.items()}
    readers = [asyncio.ensure_future(engine.read(k, outs[k])) for k in srcs]
    while not alone.is_set():
        await asyncio.sleep(0.001)
    for task in list(engine._packs._tasks):
        task.cancel()
    gate.set()
    results = await asyncio.wait_for(asyncio.gather(*readers, return_exceptions=True), timeout=10)
    assert all(isinstance(r, asyncio.CancelledError) for r in results), results


async def test_a_failed_pack_fails_every_blob_in_it_and_frees_its_space(
    engine: RawEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    await engine.write(0, random_bytes(10))
    free = engine.reusable_bytes()

    def failing(fd: int, data: memoryview, offset: int) -> int:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "pwrite", failing)
    results = await asyncio.gather(
        *(engine.write(k, random_bytes(8 * KiB, seed=k)) for k in range(1, 9)),
        return_exceptions=True,
    )
    assert all(isinstance(r, OSError) and r.errno == errno.EIO for r in results)
    assert engine.holds(0) and not any(engine.holds(k) for k in range(1, 9))
    assert engine.reusable_bytes() == free


async def test_a_cancelled_packed_write_leaves_no_space_taken(engine: RawEngine) -> None:
    await engine.write(0, random_bytes(10))
    free = engine.reusable_bytes()
    task = asyncio.create_task(engine.write(1, random_bytes(8 * KiB)))
    await asyncio.sleep(0)  # the blob has joined the open pack
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await engine.drain()  # the pack is written all the same...
    assert not engine.holds(1)
    assert engine.reusable_bytes() == free  # ...and its piece given back


async def test_write_many_cancelled_twice_still_waits_and_raises_cancelled(
    engine: RawEngine,
) -> None:
    """Cancelled again while it waited for the cancelled writes to end, ``write_many`` read
    the outcome of a write still running and raised InvalidStateError instead."""
    big = random_bytes(40 * engine.config.io_chunk_bytes, seed=3)
    for delay in (0.0, 0.001, 0.002):
        task = asyncio.ensure_future(
            engine.write_many([WriteRequest(200, random_bytes(100)), WriteRequest(201, big)])
        )
        await asyncio.sleep(delay)
        task.cancel()
        await asyncio.sleep(0)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):  # or it ended before the cancel
            await task
        await engine.drain()
        for key in (200, 201):  # what was written is stored whole, or not at all
            if engine.holds(key):
                await engine.delete(key)


async def test_a_cancelled_pack_task_frees_its_space_only_when_its_thread_is_done(
    engine: RawEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pack's task cancelled while its thread wrote (a loop torn down without a drain)
    freed the pack's extent at once, for another blob to take while the old bytes were
    still going to that place. Now the task waits for its thread whatever the cancels."""
    await engine.write(0, random_bytes(64 * KiB))
    await engine.delete(0)
    free = engine.reusable_bytes()
    gate, entered = threading.Event(), threading.Event()
    real = engine._io.write_pack

    def gated(*args: Any) -> Any:
        entered.set()
        gate.wait(10)
        return real(*args)

    monkeypatch.setattr(engine._io, "write_pack", gated)
    writer = asyncio.ensure_future(engine.write(1, random_bytes(8 * KiB)))
    while not entered.is_set():
        await asyncio.sleep(0.001)
    tasks = list(engine._packs._tasks)
    assert tasks
    for _ in range(2):
        for task in tasks:
            task.cancel()
        for _ in range(5):
            await asyncio.sleep(0)
    assert engine.reusable_bytes() < free  # the thread still writes there: not free
    gate.set()
    with contextlib.suppress(asyncio.CancelledError, OSError):
        await writer
    await asyncio.gather(*tasks, return_exceptions=True)
    assert not engine.holds(1) or engine.reusable_bytes() < free


async def test_write_many_and_read_many_report_each_outcome(engine: RawEngine) -> None:
    await engine.write(5, random_bytes(100))
    srcs = [random_bytes(n, seed=n) for n in (1, PAGE, 3 * MiB + 7, 70 * KiB)]
    requests = [WriteRequest(k, t) for k, t in enumerate(srcs)]
    requests.append(WriteRequest(5, random_bytes(10)))  # already stored
    outcomes = await engine.write_many(requests)
    assert outcomes[:4] == [None] * 4
    assert isinstance(outcomes[4], KeyError)
    outs = [torch.empty_like(t) for t in srcs]
    read_outcomes = await engine.read_many(
        [
            *((k, o) for k, o in enumerate(outs)),
            (77, torch.empty(3, dtype=torch.uint8)),
            (5, torch.empty(99, dtype=torch.uint8)),
        ]
    )
    assert read_outcomes[:4] == [None] * 4
    assert isinstance(read_outcomes[4], KeyError)
    assert isinstance(read_outcomes[5], CorruptTensorError)  # wrong size
    for t, o in zip(srcs, outs, strict=True):
        assert torch.equal(o, t)


async def test_buffered_packs_round_trip(tmp_path: Path, config: StoreConfig) -> None:
    engine = RawEngine(make_dirs(tmp_path, 2), config.replace(direct_io="off"))
    try:
        srcs = {k: random_bytes(3 * KiB + k, seed=k) for k in range(40)}
        await asyncio.gather(*(engine.write(k, t) for k, t in srcs.items()))
        outs = {k: torch.empty_like(t) for k, t in srcs.items()}
        await asyncio.gather(*(engine.read(k, outs[k]) for k in srcs))
        for k, t in srcs.items():
            assert torch.equal(outs[k], t)
            assert stored_bytes(engine, k) == t.numpy().tobytes()
    finally:
        await engine.close()


@pytest.mark.parametrize("n", [1, 4095, _checksum.SHORT_CALL_BYTES, _checksum.SHORT_CALL_BYTES + 1])
def test_short_and_long_foreign_calls_agree(n: int) -> None:
    # Note: [Short foreign calls keep the GIL]: both kinds of call give the same bytes.
    import google_crc32c

    src = random_bytes(n, seed=n)
    dst = torch.zeros(n + 8, dtype=torch.uint8)
    _memcopy.memmove(dst.data_ptr(), src.data_ptr(), n)
    _memcopy.memset(dst.data_ptr() + n, 0xAB, 8)
    assert torch.equal(dst[:n], src)
    assert bytes(dst[n:].numpy()) == b"\xab" * 8
    data = bytes(src.numpy())
    assert _checksum.crc32c(src.data_ptr(), n) == google_crc32c.value(data)


def _count_preadv(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Make every ``os.preadv`` record how many buffers it was given."""
    calls: list[int] = []
    real = os.preadv

    def counting(fd: int, bufs: list[memoryview], offset: int) -> int:
        calls.append(len(bufs))
        return real(fd, bufs, offset)

    monkeypatch.setattr(os, "preadv", counting)
    return calls


def _on_a_page(nbytes: int, lead: int = 0) -> torch.Tensor:
    """``nbytes`` of fresh memory starting ``lead`` bytes past a page boundary."""
    m = mmap.mmap(-1, pad(lead + nbytes) or PAGE)
    return torch.frombuffer(m, dtype=torch.uint8, count=nbytes, offset=lead)


async def test_page_aligned_outs_are_read_in_place(
    engine: RawEngine, monkeypatch: pytest.MonkeyPatch, copies: list[int]
) -> None:
    """Note: [Packed reads land in place]: one preadv for the group; only the gaps, partial
    last pages and outs that do not start on a page pass through the bounce buffer."""
    sizes = [64 * KiB, 48 * KiB + 12, 100, 8 * KiB, 20 * KiB + 5, 4 * KiB, 36 * KiB]
    srcs = {k: random_bytes(n, seed=k) for k, n in enumerate(sizes)}
    await asyncio.gather(*(engine.write(k, t) for k, t in srcs.items()))
    await engine.delete(3)  # a gap inside the group
    del srcs[3]
    outs = {k: _on_a_page(t.numel(), lead=0 if k % 4 else 64) for k, t in srcs.items()}
    copies.clear()  # the writes' copies into their pack
    calls = _count_preadv(monkeypatch)
    await asyncio.gather(*(engine.read(k, outs[k]) for k in reversed(srcs)))
    assert engine.grouped_reads == 1 and len(calls) == 1 and calls[0] > 1
    for k, t in srcs.items():
        assert torch.equal(outs[k], t), k
    # Copied: the whole of the two outs 64 bytes past a page, the tails of the others.
    in_place = [k for k in srcs if k % 4]
    tails = sum(srcs[k].numel() % PAGE for k in in_place)
    assert sum(copies) == srcs[0].numel() + srcs[4].numel() + tails


async def test_a_short_scatter_read_is_read_again_through_the_bounce_buffer(
    engine: RawEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    srcs = {k: random_bytes(16 * KiB, seed=k) for k in range(6)}
    await asyncio.gather(*(engine.write(k, t) for k, t in srcs.items()))
    real_preadv = os.preadv
    shortened: list[int] = []

    def short_once(fd: int, bufs: list[memoryview], offset: int) -> int:
        n = real_preadv(fd, bufs, offset)
        if len(bufs) > 1 and not shortened:
            shortened.append(n)
            return n - PAGE  # as if the kernel had stopped a page early
        return n

    monkeypatch.setattr(os, "preadv", short_once)
    outs = {k: _on_a_page(t.numel()) for k, t in srcs.items()}
    for o in outs.values():
        o.fill_(0xEE)  # the scatter read already wrote most of them; all must be right
    await asyncio.gather(*(engine.read(k, outs[k]) for k in reversed(srcs)))
    assert shortened
    for k, t in srcs.items():
        assert torch.equal(outs[k], t), k


@pytest.mark.parametrize("nbytes", [PAGE + 1, 3 * PAGE + 5])
async def test_scatter_reads_cut_by_short_io_are_read_again(engine: RawEngine, nbytes: int) -> None:
    # short_io limits a call's total, not its first piece: a scatter read of page-aligned
    # destinations (one page in place, the tail bounced) is cut too, and redone plainly.
    srcs = {k: random_bytes(nbytes, seed=k) for k in range(3)}
    await asyncio.gather(*(engine.write(k, t) for k, t in srcs.items()))
    outs = {k: _on_a_page(t.numel()) for k, t in srcs.items()}
    with short_io(PAGE) as counts:
        await asyncio.gather(*(engine.read(k, outs[k]) for k in reversed(srcs)))
    assert counts["short_reads"] > 0, counts
    for k, t in srcs.items():
        assert torch.equal(outs[k], t), k


async def test_a_group_of_more_pieces_than_one_call_takes_is_read_plainly(
    engine: RawEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    srcs = {k: random_bytes(8 * KiB + 1, seed=k) for k in range(6)}  # two pieces each
    await asyncio.gather(*(engine.write(k, t) for k, t in srcs.items()))
    monkeypatch.setattr(_chunk_io, "_IOV_MAX", 4)
    calls = _count_preadv(monkeypatch)
    outs = {k: _on_a_page(t.numel()) for k, t in srcs.items()}
    await asyncio.gather(*(engine.read(k, outs[k]) for k in reversed(srcs)))
    assert calls == [1]  # one plain read of the span, no scatter
    for k, t in srcs.items():
        assert torch.equal(outs[k], t), k
