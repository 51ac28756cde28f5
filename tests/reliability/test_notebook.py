"""Notebooks: the stores inside an already-running event loop (Jupyter, or any coroutine).

``TieredStore`` owns its loop on its own thread and never calls ``run_until_complete`` on
the caller's loop, so it needs no nest-asyncio: a cell (a coroutine or a callback running on
the kernel's loop) may call it directly. Each test runs under a ``faulthandler`` deadline so a
deadlock fails with every thread's stack instead of hanging.
"""

from __future__ import annotations

import asyncio
import faulthandler
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import tierstore
from tierstore import AsyncTieredStore, Tier, TieredStore, WrongThreadError
from tierstore.testing import audit, internals

MiB = 1 << 20


@pytest.fixture(autouse=True)
def deadlock_is_a_failure() -> Iterator[None]:
    faulthandler.dump_traceback_later(60, exit=True, file=sys.stderr)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


async def _until(cond: object, timeout: float = 15.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():  # type: ignore[operator]
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


async def test_sync_store_created_and_used_inside_a_coroutine(disk_dir: Path) -> None:
    # A notebook cell under IPython's autoawait is exactly this: a coroutine on a running loop.
    store = TieredStore(disk_dir=disk_dir, device_bytes=0, host_bytes=MiB, min_bytes=0)
    try:
        ts = [torch.randn(MiB // 4) for _ in range(6)]
        hs = [store.put(t) for t in ts]  # spills on the store's own loop thread meanwhile
        await _until(lambda: store.stats().inflight_bytes == 0)
        assert store.tier_of(hs[0]) is Tier.DISK
        for h, t in zip(reversed(hs), reversed(ts), strict=True):
            assert torch.equal(store.get(h), t)  # a blocking get from inside the loop
        audit(store)
    finally:
        store.close()
    assert list(disk_dir.iterdir()) == []


def test_jupyter_style_cells_on_a_loop_that_runs_forever(disk_dir: Path) -> None:
    """Cells scheduled as callbacks on a loop that runs forever, like ipykernel's."""
    loop = asyncio.new_event_loop()
    results: dict[str, object] = {}
    state: dict[str, object] = {}

    def cell1() -> None:
        store = TieredStore(disk_dir=disk_dir, device_bytes=0, host_bytes=0, min_bytes=0)
        state["store"] = store
        state["t"] = torch.arange(100_000.0)
        state["h"] = store.put(state["t"])  # type: ignore[arg-type]
        loop.call_soon(cell2)

    def cell2() -> None:
        store: TieredStore = state["store"]  # type: ignore[assignment]
        state["task"] = loop.create_task(cell3(store))

    async def cell3(store: TieredStore) -> None:
        await _until(lambda: store.tier_of(state["h"]) is Tier.DISK)  # type: ignore[arg-type]
        results["equal"] = torch.equal(store.get(state["h"]), state["t"])  # type: ignore[arg-type]
        default = tierstore.default_store()
        results["default"] = default is tierstore.default_store()
        default.close()
        store.close()
        loop.stop()

    loop.call_soon(cell1)
    try:
        loop.run_forever()
    finally:
        loop.close()
    assert results == {"equal": True, "default": True}
    assert list(disk_dir.iterdir()) == []


async def test_async_store_in_the_running_loop_spills_and_reads_back(disk_dir: Path) -> None:
    async with AsyncTieredStore(
        disk_dir=disk_dir, device_bytes=0, host_bytes=MiB, min_bytes=0
    ) as store:
        ts = [torch.randn(MiB // 4) for _ in range(6)]
        hs = [await store.put(t) for t in ts]
        await _until(lambda: internals(store).stats().inflight_bytes == 0)
        assert await store.tier_of(hs[0]) is Tier.DISK
        await store.prefetch(hs)
        outs = await asyncio.gather(*(store.get(h) for h in hs))
        assert all(torch.equal(o, t) for o, t in zip(outs, ts, strict=True))
    assert list(disk_dir.iterdir()) == []


async def test_sync_store_inside_its_own_loop_thread_refuses_instead_of_deadlocking(
    disk_dir: Path,
) -> None:
    store = TieredStore(disk_dir=disk_dir, min_bytes=0)
    try:
        h = store.put(torch.ones(10))
        fut = asyncio.run_coroutine_threadsafe(
            _get_from_store_loop(store, h), internals(store).loop
        )
        with pytest.raises(WrongThreadError, match="own event-loop thread"):
            await asyncio.wrap_future(fut)
    finally:
        store.close()


async def _get_from_store_loop(store: TieredStore, h: object) -> object:
    return store.get(h)  # type: ignore[arg-type]
