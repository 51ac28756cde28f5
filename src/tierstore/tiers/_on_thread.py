"""Blocking calls on an engine's threads that hold nothing of their arguments once done."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from collections.abc import Callable
    from concurrent.futures import Executor

__all__ = ["on_thread", "on_threads", "outlive_cancel"]


T = TypeVar("T")


def on_thread(pool: Executor, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
    """Run ``fn(*args)`` on one of ``pool``'s threads; nothing of ``args`` is held once the
    returned future is done.

    Note: [A finished transfer holds no memory]
        An executor's work item keeps its function's arguments until its thread deletes it,
        after the future is done: the loop could answer a get and end the backward sweep while
        an I/O thread still held the tensor it had read into, so its read-pool buffer looked
        busy when the sweep's end asked the pool to hand free buffers back, and stayed mapped
        until the next sweep (3 in 100 repetitions of a test of exactly that). Here the
        arguments are dropped when ``fn`` returns, before the future is done (an exception
        ``fn`` raises still holds them through its traceback while it lives).
    """
    return asyncio.get_running_loop().run_in_executor(pool, _Call(fn, args))


def on_threads(
    pool: Executor, fn: Callable[..., object], calls: list[tuple[Any, ...]]
) -> asyncio.Future[list[BaseException | None]]:
    """Run ``fn(*args)`` for each ``args`` of ``calls`` on ``pool``'s threads; one future,
    done once every call has ended, with each call's exception (None: it returned). Nothing of
    the arguments is held once the future is done (Note: [A finished transfer holds no
    memory]).

    Note: [One wake-up a blob]
        A blob's chunks ran as one executor future each, gathered: every chunk that ended
        woke the event loop, which took the GIL from the I/O threads to chain the futures'
        states and count the gather down. The loop spent 0.04 CPU-s/GB on steady writes of
        16 MiB tensors (two chunks each) and 0.02 on 256 MiB ones (32), a third of a write's
        CPU at 16 MiB. Here the threads count down under a lock, and only the last wakes the
        loop.
    """
    loop = asyncio.get_running_loop()
    done: asyncio.Future[list[BaseException | None]] = loop.create_future()
    errors: list[BaseException | None] = [None] * len(calls)
    if not calls:
        done.set_result(errors)
        return done
    lock = threading.Lock()
    left = [len(calls)]

    def finish() -> None:
        if not done.cancelled():
            done.set_result(errors)

    def ended(i: int, exc: BaseException | None) -> None:
        errors[i] = exc
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                loop.call_soon_threadsafe(finish)

    def run(i: int, call: _Call) -> None:
        try:
            call()
        except BaseException as exc:
            ended(i, exc)
        else:
            ended(i, None)

    for i, args in enumerate(calls):
        try:
            pool.submit(run, i, _Call(fn, args))
        except BaseException as exc:  # the pool is shut down: this call never runs
            ended(i, exc)
    return done


class _Call:
    """``fn(*args)`` once, holding neither after it returns."""

    __slots__ = ("args", "fn")

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.fn: Callable[..., Any] | None = fn
        self.args: tuple[Any, ...] = args

    def __call__(self) -> Any:
        fn, args = self.fn, self.args
        self.fn, self.args = None, ()
        assert fn is not None, "called twice"
        return fn(*args)


async def outlive_cancel(
    fut: asyncio.Future[T], on_cancel: Callable[[], object] | None = None
) -> T:
    """Wait for ``fut``, a transfer on an I/O thread, even when the waiting task is cancelled
    (once or many times); then raise ``CancelledError`` if it was. ``on_cancel`` runs at the
    first cancel (to cancel what ``fut`` waits for, where that can be stopped).

    The thread cannot be stopped: a task that gave up on it at once would free the extent the
    thread still writes, or hand back the memory it still reads into, for others to reuse
    while the bytes move.
    """
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(fut)
            break
        except asyncio.CancelledError:
            if fut.cancelled():  # the future itself, not only its waiter
                raise
            if not cancelled and on_cancel is not None:
                on_cancel()
            cancelled = True
        except BaseException:
            if cancelled:  # the cancel wins over what the thread raised
                raise asyncio.CancelledError from None
            raise
    if cancelled:
        raise asyncio.CancelledError
    return result
