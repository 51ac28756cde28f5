"""What the I/O threads hold once a transfer is done (Note: [A finished transfer holds no
memory]), and a transfer's waiter cancelled while its thread runs."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import thread as cf_thread

import pytest
import torch

from tierstore.tiers._on_thread import on_thread, on_threads, outlive_cancel


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


@pytest.mark.parametrize("outcome", ["returns", "raises"])
async def test_outlive_cancel_waits_for_the_thread_then_raises_cancelled(outcome: str) -> None:
    """Cancelled twice while the thread runs, the waiter returns only once the thread is
    done, and with CancelledError whatever the call did: a call that failed after the cancel
    used to hand its error back instead, and the cancelled task went on."""
    gate, done = threading.Event(), threading.Event()

    def work() -> int:
        gate.wait(10)
        done.set()
        if outcome == "raises":
            raise OSError(5, "the read failed")
        return 1

    with ThreadPoolExecutor(1) as pool:
        task = asyncio.ensure_future(outlive_cancel(on_thread(pool, work)))
        await asyncio.sleep(0.01)
        for _ in range(2):
            task.cancel()
            await asyncio.sleep(0.01)
        assert not task.done()  # the thread still runs
        gate.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert done.is_set()


@pytest.mark.usefixtures("slow_workers")
async def test_many_calls_end_in_one_future_that_holds_nothing_of_their_arguments() -> None:
    """Note: [One wake-up a blob]: a blob's chunks end in one future, each call's exception
    in its place, none of the tensors held once it is done."""

    def fill(x: torch.Tensor, value: float) -> None:
        if value == 2.0:
            raise OSError(5, "chunk 2 failed")
        x.fill_(value)

    with ThreadPoolExecutor(4) as pool:
        ts = [torch.zeros(1024) for _ in range(4)]
        seen = [weakref.ref(t) for t in ts]
        fut = on_threads(pool, fill, [(t, float(i)) for i, t in enumerate(ts)])
        del ts
        errors = await fut
        assert [type(e) for e in errors] == [type(None), type(None), OSError, type(None)]
        # The failed call's tensor lives on in its traceback.
        assert [s() is None for s in seen] == [True, True, False, True]


async def test_calls_on_a_pool_shut_down_end_with_its_error_and_none_hangs() -> None:
    pool = ThreadPoolExecutor(1)
    pool.shutdown()
    errors = await asyncio.wait_for(on_threads(pool, print, [(1,), (2,)]), 5)
    assert all(isinstance(e, RuntimeError) for e in errors)
    assert await on_threads(pool, print, []) == []


async def test_one_future_waits_for_every_call_when_cancelled() -> None:
    gate = threading.Event()
    ended: list[int] = []

    def work(i: int) -> None:
        gate.wait(10)
        ended.append(i)

    with ThreadPoolExecutor(2) as pool:
        task = asyncio.ensure_future(outlive_cancel(on_threads(pool, work, [(0,), (1,), (2,)])))
        await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.sleep(0.01)
        assert not task.done()  # the threads still run
        gate.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert sorted(ended) == [0, 1, 2]


async def test_a_call_whose_submit_failed_after_queuing_it_never_runs() -> None:
    """``ThreadPoolExecutor.submit`` queues the call, then starts a thread, which can fail
    ("can't start new thread"): counted as failed at once, the call must not run later, when
    the space of its blob may belong to another. Both the failure and a late run counted it,
    so the future was done while calls still ran."""
    running, ran_after = [0], []
    gate = threading.Event()

    def work(i: int) -> None:
        running[0] += 1
        gate.wait(5)
        time.sleep(0.1)
        if fut.done():
            ran_after.append(i)
        running[0] -= 1

    with ThreadPoolExecutor(4) as pool:
        pool.submit(lambda: None).result()  # one thread up, idle
        real = pool._adjust_thread_count  # type: ignore[attr-defined]

        def cannot_start_a_thread() -> None:
            raise RuntimeError("can't start new thread")

        pool._adjust_thread_count = cannot_start_a_thread  # type: ignore[attr-defined]
        fut = on_threads(pool, work, [(0,), (1,), (2,)])
        pool._adjust_thread_count = real  # type: ignore[attr-defined]
        gate.set()
        errors = await asyncio.wait_for(fut, 5)
        assert running[0] == 0, "done while calls still ran"
        time.sleep(0.2)  # a late run would show now
        assert ran_after == []
        assert all(e is None or isinstance(e, RuntimeError) for e in errors)


@pytest.mark.parametrize("failure", ["call raises", "pool shut down"])
async def test_a_failed_calls_arguments_are_not_kept_in_a_cycle(failure: str) -> None:
    """The error's traceback holds the frame that caught it (the countdown's, or the one that
    submitted): had that frame, or the countdown, kept the list of errors or the calls, the
    tensors would live on in a cycle until the collector ran."""

    def fails(x: torch.Tensor) -> None:
        raise OSError(5, "the write failed")

    gc.disable()
    try:
        with ThreadPoolExecutor(1) as pool:
            if failure == "pool shut down":
                pool.shutdown()
            t = torch.zeros(1024)
            seen = weakref.ref(t)
            errors = await on_threads(pool, fails, [(t,)])
            assert isinstance(errors[0], OSError if failure == "call raises" else RuntimeError)
            del t, errors
            await asyncio.sleep(0.05)
            assert seen() is None
    finally:
        gc.enable()
