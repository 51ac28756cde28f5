"""Work for the store's event loop, queued by any thread and started with one wake-up.

Note: [Batched hand-offs]
    Each hop to the loop thread, each task and each engine call costs tens of microseconds of
    Python on a small machine, as much as writing a 64 KiB tensor. So work for the loop is
    queued and handed over with one wake-up however many puts and gets queued it, and the
    loop turns the disk writes and reads of small entries queued meanwhile into one task and
    one ``write_many``/``read_many`` call per batch, which the raw engine packs into few large
    requests (Note: [Small blobs travel in packs]). Releases queued meanwhile free their spill
    space in one ``delete_many``, started before the spills so these can reuse it. Spills,
    fetches and deletes wait in queues of their own, so queuing one makes no object; fewer
    tasks also mean fewer objects for the garbage collector, whose full collections walk every
    object torch and the store keep alive.

    The queues are deques, whose ``append`` and ``popleft`` are atomic, so any thread may
    queue while the loop drains; a drain takes only what was there when it started.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine, Iterable

    from tierstore.core._entries import Entry

    Work = Callable[..., Coroutine[Any, Any, None]]

__all__ = ["BATCH_BYTES", "BATCH_MAX_BYTES", "HandOff", "batches", "drain"]

log = logging.getLogger("tierstore")

_T = TypeVar("_T")

BATCH_BYTES = 1 << 20
"""Disk I/O of entries up to this size goes to the engine in batches."""
BATCH_MAX_BYTES = 8 << 20
"""A batch holds at most this many bytes (one entry at least)."""


class HandOff:
    """The queues of work for the loop, the tasks it became, and the wake-up that starts it.

    Args:
        loop: the store's event loop.
        loop_thread: the ident of the thread running it.
        spill_many: writes a batch of entries to disk.
        fetch_many: brings a batch of entries back.
        delete_many: frees the spill space of ``(key, footprint)`` pairs.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        loop_thread: int,
        spill_many: Callable[[list[Entry]], Coroutine[Any, Any, None]],
        fetch_many: Callable[[list[Entry]], Coroutine[Any, Any, None]],
        delete_many: Callable[[list[tuple[int, int]]], Coroutine[Any, Any, None]],
    ) -> None:
        self._loop = loop
        self._loop_thread = loop_thread
        self._spill_many = spill_many
        self._fetch_many = fetch_many
        self._delete_many = delete_many
        self.spills: collections.deque[Entry] = collections.deque()
        self.fetches: collections.deque[Entry] = collections.deque()
        self.deletes: collections.deque[tuple[int, int]] = collections.deque()
        self._others: collections.deque[tuple[Work, tuple[Any, ...]]] = collections.deque()
        self._soon = False
        self.tasks: set[asyncio.Task[None]] = set()
        """Tasks started and not yet done."""

    def spawn(self, fn: Work, *args: Any) -> None:
        """Run ``fn(*args)`` as a task on the loop soon."""
        self._others.append((fn, args))
        self.wake()

    def spill(self, e: Entry) -> None:
        self.spills.append(e)
        self.wake()

    def fetch(self, e: Entry) -> None:
        self.fetches.append(e)
        self.wake()

    def delete(self, key: int, footprint: int) -> None:
        self.deletes.append((key, footprint))
        self.wake()

    def wake(self) -> None:
        """Have the loop start the queued work soon.

        One wake-up starts everything queued meanwhile. The flag is tested after the work was
        queued and cleared before the queues are read, so whichever side runs second sees the
        other's work.
        """
        if self._soon:
            return
        self._soon = True
        if threading.get_ident() == self._loop_thread:
            self._loop.call_soon(self.run)
        else:
            self._loop.call_soon_threadsafe(self.run)

    def run(self) -> None:
        """Start the queued work (on the loop): small disk writes and reads go in batches."""
        self._soon = False
        for fn, args in drain(self._others):
            self._start(fn, args)
        deletes = drain(self.deletes)
        if deletes:
            # First: space freed now is space the spills below can reuse.
            self._start(self._delete_many, (deletes,))
        for batch in batches(drain(self.spills)):
            self._start(self._spill_many, (batch,))
        batched = []
        for e in drain(self.fetches):
            # Alone: a host copy going back to its GPU (no disk read to share), and a fetch a
            # get already waits on, which a batch would make wait for all its reads.
            if e.disk and e.fetch_future is None:
                batched.append(e)
            else:
                self._start(self._fetch_many, ([e],))
        for batch in batches(batched):
            self._start(self._fetch_many, (batch,))

    async def finish(self, timeout: float) -> None:
        """Wait until no task is left; cancel what outlives ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        # Finishing tasks may start others (a fetch completing a prefetch walk); wait until no
        # task is left, then cancel whatever outlived the timeout.
        while True:
            self.run()  # queued work becomes tasks this loop can wait for
            pending = {t for t in self.tasks if t is not asyncio.current_task()}
            if not pending:
                return
            left = deadline - time.monotonic()
            if left <= 0:
                for t in pending:
                    t.cancel()
                log.warning(
                    "tierstore: cancelled %d transfers still running at close", len(pending)
                )
                await asyncio.wait(pending, timeout=5)
                return
            await asyncio.wait(pending, timeout=left)

    def _start(self, fn: Work, args: tuple[Any, ...]) -> None:
        task = self._loop.create_task(fn(*args))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)


def drain(queue: collections.deque[_T]) -> list[_T]:
    """Everything in ``queue``, emptied with atomic pops (another thread may append)."""
    items: list[_T] = []
    while queue:
        items.append(queue.popleft())
    return items


def batches(entries: Iterable[Entry]) -> Iterable[list[Entry]]:
    """Runs of ``entries`` for one task each: big entries alone, small ones together.

    Small entries (at most ``BATCH_BYTES``) go in consecutive runs of at most
    ``BATCH_MAX_BYTES`` (one at least); a bigger entry is a batch of its own, which keeps its
    chunks alone in the engine call (Note: [Batched hand-offs]).
    """
    batch: list[Entry] = []
    size = 0
    for e in entries:
        if e.nbytes > BATCH_BYTES:
            yield [e]
            continue
        if batch and size + e.nbytes > BATCH_MAX_BYTES:
            yield batch
            batch, size = [], 0
        batch.append(e)
        size += e.nbytes
    if batch:
        yield batch
