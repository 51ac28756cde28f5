"""What the I/O threads hold once a transfer is done (Note: [A finished transfer holds no
memory])."""

from __future__ import annotations

import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import thread as cf_thread

import pytest
import torch

from tierstore.tiers._on_thread import on_thread


@pytest.fixture
def slow_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each worker dwells after completing a future, before it drops its work item: what a
    thread descheduled at that moment does."""
    run = cf_thread._WorkItem.run

    def run_then_dwell(self: cf_thread._WorkItem) -> None:  # type: ignore[type-arg]
        run(self)
        time.sleep(0.2)

    monkeypatch.setattr(cf_thread._WorkItem, "run", run_then_dwell)


@pytest.mark.usefixtures("slow_workers")
async def test_a_done_transfer_holds_nothing_of_its_arguments() -> None:
    """The executor's work item kept the tensor a read filled until its thread deleted it,
    after the future was done; the loop, resumed by then, saw the tensor's buffer busy."""

    def fill(x: torch.Tensor) -> None:
        x.fill_(1.0)

    with ThreadPoolExecutor(1) as pool:
        t = torch.zeros(1024)
        seen = weakref.ref(t)
        fut = on_thread(pool, fill, t)
        del t
        await fut
        assert seen() is None


@pytest.mark.usefixtures("slow_workers")
async def test_a_function_called_once_raises_as_itself() -> None:
    def fails(x: object) -> None:
        raise ValueError(f"bad {x}")

    with ThreadPoolExecutor(1) as pool, pytest.raises(ValueError, match="bad 3"):
        await on_thread(pool, fails, 3)
