"""The store hands disk work to its engine in batches (Note: [Batched hand-offs])."""

from __future__ import annotations

import asyncio
import gc
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import torch

from tierstore import AsyncTieredStore, TensorHandle, Tier
from tierstore.core._handoff import BATCH_BYTES, BATCH_MAX_BYTES, batches
from tierstore.testing import FaultyEngine, install_faults, internals
from tierstore.tiers import DiskEngine
from tierstore.tiers.raw import RawEngine

if TYPE_CHECKING:
    from collections.abc import Sequence
    from pathlib import Path

    import pytest

    from tierstore.tiers import WriteRequest

KiB = 1 << 10
MiB = 1 << 20


class RecordingEngine(FaultyEngine):
    """A pass-through wrapper (no faults injected) that records the size of every batch call."""

    name = "recording"

    def __init__(self, inner: DiskEngine) -> None:
        super().__init__(inner)
        self.write_batches: list[int] = []
        self.read_batches: list[int] = []
        self.delete_batches: list[int] = []

    async def write_many(self, requests: Sequence[WriteRequest]) -> list[BaseException | None]:
        self.write_batches.append(len(requests))
        return await self.inner.write_many(requests)

    async def read_many(
        self, requests: Sequence[tuple[int, torch.Tensor]]
    ) -> list[BaseException | None]:
        self.read_batches.append(len(requests))
        return await self.inner.read_many(requests)

    async def delete_many(self, keys: Sequence[int]) -> list[BaseException | None]:
        self.delete_batches.append(len(keys))
        return await self.inner.delete_many(keys)


_Recording = TypeVar("_Recording", bound=RecordingEngine)


async def _until_on_disk(store: AsyncTieredStore, handles: list[TensorHandle]) -> None:
    for h in handles:
        while await store.tier_of(h) is not Tier.DISK:
            await asyncio.sleep(0.001)


async def _spill_on_raw(
    store: AsyncTieredStore, kind: type[_Recording], n: int
) -> tuple[_Recording, list[TensorHandle]]:
    """Wrap the raw engine in ``kind``, then spill ``n`` 16 KiB tensors and wait for the disk."""
    engine = install_faults(store, kind)
    handles = [await store.put(torch.randn(4 * KiB)) for _ in range(n)]
    await _until_on_disk(store, handles)
    return engine, handles


async def _release_all(store: AsyncTieredStore, handles: list[TensorHandle]) -> None:
    """Release every handle in one turn, then wait until their spill space is freed."""
    for h in handles:
        await store.release(h)
    while internals(store).deleting_bytes:
        await asyncio.sleep(0.001)


async def test_small_spills_and_fetches_are_handed_over_in_batches(tmp_path: Path) -> None:
    async with AsyncTieredStore(
        host_bytes=0, min_bytes=0, disk_dir=str(tmp_path), prefetch_bytes=64 * MiB
    ) as store:
        engine = install_faults(store, RecordingEngine)
        tensors = [torch.randn(4 * KiB) for _ in range(300)]  # 16 KiB each
        handles = [await store.put(t) for t in tensors]  # all in one turn of the loop
        await _until_on_disk(store, handles)
        # 300 puts in one turn: one batch (4.7 MiB, under the 8 MiB cap), not 300 hand-offs.
        assert engine.write_batches == [300]
        inner = engine.inner
        assert isinstance(inner, RawEngine)
        assert inner.packs_written <= 5  # 4.7 MiB of blobs in packs of up to a chunk (8 MiB)
        back = [await store.get(h) for h in reversed(handles)]
        assert max(engine.read_batches) > 100  # the prefetch walk reads neighbours together
        assert sum(engine.read_batches) == 300
        for t, b in zip(tensors, reversed(back), strict=True):
            assert torch.equal(t, b)


async def test_big_entries_are_not_batched(tmp_path: Path) -> None:
    async with AsyncTieredStore(host_bytes=0, min_bytes=0, disk_dir=str(tmp_path)) as store:
        engine = install_faults(store, RecordingEngine)
        tensors = [torch.randn(MiB // 2) for _ in range(3)]  # 2 MiB each
        handles = [await store.put(t) for t in tensors]
        await _until_on_disk(store, handles)
        back = [await store.get(h) for h in reversed(handles)]
        assert engine.write_batches == [1, 1, 1]
        assert engine.read_batches == [1, 1, 1]
        for t, b in zip(tensors, reversed(back), strict=True):
            assert torch.equal(t, b)


class HeldBatchReads(RecordingEngine):
    """Reads of more than one blob at once wait for ``gate``; single reads go through."""

    def __init__(self, inner: DiskEngine) -> None:
        super().__init__(inner)
        self.gate = asyncio.Event()

    async def read_many(
        self, requests: Sequence[tuple[int, torch.Tensor]]
    ) -> list[BaseException | None]:
        self.read_batches.append(len(requests))
        if len(requests) > 1:
            await self.gate.wait()
        return await self.inner.read_many(requests)


async def test_a_get_that_waits_reads_alone_not_behind_a_batch_of_prefetches(
    tmp_path: Path,
) -> None:
    # The first get of backward used to share a batch with the prefetches it started, and
    # waited until all of them were read (docs/architecture.md, "LIFO prefetch").
    async with AsyncTieredStore(
        host_bytes=0, min_bytes=0, disk_dir=str(tmp_path), prefetch_bytes=64 * MiB
    ) as store:
        engine = install_faults(store, HeldBatchReads)
        tensors = [torch.full((4 * KiB,), float(i)) for i in range(300)]
        handles = [await store.put(t) for t in tensors]
        await _until_on_disk(store, handles)
        newest = await asyncio.wait_for(store.get(handles[-1]), timeout=10)
        assert torch.equal(newest, tensors[-1])
        assert engine.read_batches[0] == 1  # its own read, alone
        assert max(engine.read_batches) > 100  # the prefetches went in a batch, still held
        engine.gate.set()
        for t, h in zip(reversed(tensors[:-1]), reversed(handles[:-1]), strict=True):
            assert torch.equal(await store.get(h), t)


async def test_releases_free_spill_space_in_one_batch(tmp_path: Path) -> None:
    async with AsyncTieredStore(host_bytes=0, min_bytes=0, disk_dir=str(tmp_path)) as store:
        engine, handles = await _spill_on_raw(store, RecordingEngine, 200)
        inner = engine.inner
        assert isinstance(inner, RawEngine)
        free_before = inner.reusable_bytes()
        await _release_all(store, handles)
        # 200 releases in one turn: one hand-off, not a task each; every extent is free again.
        assert engine.delete_batches == [200]
        assert inner.reusable_bytes() == free_before + 200 * 16 * KiB


async def test_a_spilled_small_tensor_keeps_four_objects_for_the_garbage_collector(
    tmp_path: Path,
) -> None:
    # A full collection walks every tracked object alive, so each one a spilled tensor keeps
    # costs every collection of the run (Note: [Small blobs travel in packs]).
    async with AsyncTieredStore(host_bytes=0, min_bytes=0, disk_dir=str(tmp_path)) as store:
        gc.collect()
        before = len(gc.get_objects())
        # As in training, the caller keeps no reference: the store holds the only one.
        handles = [await store.put(torch.full((4 * KiB,), float(i))) for i in range(1000)]
        await _until_on_disk(store, handles)
        gc.collect()
        per_tensor = (len(gc.get_objects()) - before) / len(handles)
        # The entry, its handle, the store's weak reference to the handle, and the record of
        # where the bytes lie on disk. The shape is a plain tuple of ints, which the collector
        # stops tracking (a torch.Size it would track for good).
        assert per_tensor < 4.5, per_tensor
        for i, h in reversed(list(enumerate(handles))):
            assert torch.equal(await store.get(h), torch.full((4 * KiB,), float(i)))


class FailingDeletes(RecordingEngine):
    async def delete(self, key: int) -> None:
        if key % 2:
            raise OSError(5, f"cannot free #{key}")
        await self.inner.delete(key)

    async def delete_many(self, keys: Sequence[int]) -> list[BaseException | None]:
        self.delete_batches.append(len(keys))
        return await DiskEngine.delete_many(self, keys)  # the default: one delete() each


async def test_a_failed_delete_is_logged_and_the_others_still_free_their_space(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with AsyncTieredStore(host_bytes=0, min_bytes=0, disk_dir=str(tmp_path)) as store:
        engine, handles = await _spill_on_raw(store, FailingDeletes, 10)
        inner = engine.inner
        assert isinstance(inner, RawEngine)
        free_before = inner.reusable_bytes()
        keys = [h.key for h in handles]
        with caplog.at_level(logging.WARNING, logger="tierstore"):
            await _release_all(store, handles)
        assert engine.delete_batches == [10]
        odd = [k for k in keys if k % 2]
        assert len(odd) == 5
        for k in odd:
            assert f"tensor #{k} failed: [Errno 5] cannot free #{k}" in caplog.text
        assert inner.reusable_bytes() == free_before + 5 * 16 * KiB  # the even keys' extents


@dataclass(frozen=True)
class Queued:
    key: int
    nbytes: int


def test_small_entries_share_batches_and_big_ones_go_alone() -> None:
    small = BATCH_BYTES  # eight fill a batch
    assert 8 * small == BATCH_MAX_BYTES
    entries = [Queued(k, small) for k in (1, 2, 3)] + [Queued(4, small + 1)]
    entries += [Queued(k, small) for k in range(5, 13)]
    runs = [[e.key for e in b] for b in batches(entries)]  # type: ignore[arg-type]
    assert runs == [[4], [1, 2, 3, 5, 6, 7, 8, 9], [10, 11, 12]]
    assert list(batches([])) == []
