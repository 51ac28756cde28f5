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
        states and count the gather down. Here the threads count down under a lock, and only
        the last wakes the loop: on steady writes of 256 MiB tensors (32 chunks each) the
        loop's CPU fell from 0.020-0.023 to 0.004 CPU-s/GB (docs/performance.md, "CPU per
        byte"). A call whose submit fails is counted as failed then, and never runs: a
        submit can fail after queuing it (a thread that cannot start), and a call run after
        the future was done would write into space freed for another blob.
    """
    loop = asyncio.get_running_loop()
    done: asyncio.Future[list[BaseException | None]] = loop.create_future()
    countdown = _Countdown(loop, done, len(calls))
    for i, args in enumerate(calls):
        call = _Call(fn, args)
        try:
            pool.submit(countdown.run, i, call)
        except BaseException as exc:
            # Not queued (the pool is shut down), or queued and then failed (a thread that
            # could not start): it must not run later, once the blob's space may be reused.
            if countdown.claim(i):
                call.fn, call.args = None, ()
                countdown.ended(i, exc)
    try:
        return done
    finally:
        # An error caught above holds this frame in its traceback, and the future its
        # result: the frame must not keep the calls' arguments in that cycle.
        del done, calls, countdown


class _Countdown:
    """The calls of one :func:`on_threads` still running, and their outcomes so far."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        done: asyncio.Future[list[BaseException | None]],
        n: int,
    ) -> None:
        self._loop = loop
        self._done: asyncio.Future[list[BaseException | None]] | None = done
        self._errors: list[BaseException | None] | None = [None] * n
        self._claimed = [False] * n
        self._left = n
        self._lock = threading.Lock()
        if not n:
            self._finish()

    def claim(self, i: int) -> bool:
        """Whether call ``i`` is this caller's to run or to count (only the first asks)."""
        with self._lock:
            first = not self._claimed[i]
            self._claimed[i] = True
        return first

    def run(self, i: int, call: _Call) -> None:
        if not self.claim(i):
            return  # its submit failed and counted it
        try:
            call()
        except BaseException as exc:
            self.ended(i, exc)
        else:
            self.ended(i, None)

    def ended(self, i: int, exc: BaseException | None) -> None:
        with self._lock:
            assert self._errors is not None
            self._errors[i] = exc
            self._left -= 1
            last = self._left == 0
        if last:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                self._loop.call_soon_threadsafe(self._finish)

    def _finish(self) -> None:
        # Handed over, not kept: an error's traceback holds a frame of ``run``, and with it
        # this object, which would otherwise hold the error (and its call's arguments), in
        # the list or in the future's result, in a cycle until the collector ran.
        (done, self._done), (errors, self._errors) = (self._done, None), (self._errors, None)
        assert done is not None and errors is not None
        if not done.cancelled():
            done.set_result(errors)


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
