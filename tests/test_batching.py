"""The store hands disk work to its engine in batches (Note: [Batched hand-offs] in _core.py)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import torch

from reliability.faults import FaultyEngine
from tierstore import AsyncTieredStore, TensorHandle, Tier
from tierstore.tiers._raw import RawEngine

if TYPE_CHECKING:
    from collections.abc import Sequence
    from pathlib import Path

    from tierstore.tiers import DiskEngine, WriteRequest

KiB = 1 << 10
MiB = 1 << 20


class RecordingEngine(FaultyEngine):
    """A pass-through wrapper (no faults injected) that records the size of every batch call."""

    name = "recording"

    def __init__(self, inner: DiskEngine) -> None:
        super().__init__(inner)
        self.write_batches: list[int] = []
        self.read_batches: list[int] = []

    async def write_many(self, requests: Sequence[WriteRequest]) -> list[BaseException | None]:
        self.write_batches.append(len(requests))
        return await self.inner.write_many(requests)

    async def read_many(
        self, requests: Sequence[tuple[int, torch.Tensor]]
    ) -> list[BaseException | None]:
        self.read_batches.append(len(requests))
        return await self.inner.read_many(requests)


async def _until_on_disk(store: AsyncTieredStore, handles: list[TensorHandle]) -> None:
    for h in handles:
        while await store.tier_of(h) is not Tier.DISK:
            await asyncio.sleep(0.001)


async def test_small_spills_and_fetches_are_handed_over_in_batches(tmp_path: Path) -> None:
    async with AsyncTieredStore(
        host_bytes=0, min_bytes=0, disk_dir=str(tmp_path), prefetch_bytes=64 * MiB
    ) as store:
        recorder: list[RecordingEngine] = []
        store._core.wrap_engine(lambda e: recorder.append(RecordingEngine(e)) or recorder[0])
        tensors = [torch.randn(4 * KiB) for _ in range(300)]  # 16 KiB each
        handles = [await store.put(t) for t in tensors]  # all in one turn of the loop
        await _until_on_disk(store, handles)
        engine = recorder[0]
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
        recorder: list[RecordingEngine] = []
        store._core.wrap_engine(lambda e: recorder.append(RecordingEngine(e)) or recorder[0])
        tensors = [torch.randn(MiB // 2) for _ in range(3)]  # 2 MiB each
        handles = [await store.put(t) for t in tensors]
        await _until_on_disk(store, handles)
        back = [await store.get(h) for h in reversed(handles)]
        assert recorder[0].write_batches == [1, 1, 1]
        assert recorder[0].read_batches == [1, 1, 1]
        for t, b in zip(tensors, reversed(back), strict=True):
            assert torch.equal(t, b)
