"""The store's side of its handles: a weak reference each, whose death queues a release.

Note: [Release from a finalizer]
    Handles are released when they are garbage-collected, which can happen in any thread,
    even one that holds the store's lock at that moment, and in the middle of any C code that
    frees them (autograd freeing its graph). The weak reference's callback is therefore the
    queue's own ``append``, a C function: it runs no Python, so it takes no lock, waits for
    nothing, and cannot be where a signal lands. (A Python callback was: a Ctrl-C arriving
    while C code freed a handle raised KeyboardInterrupt at the callback's first line, where
    Python prints "Exception ignored" and drops it; the training loop ran on, and the entry,
    never queued, stayed until close.) The store drains the queue first in every call, so a
    caller never sees a released entry counted, and its loop polls it while entries exist, for
    handles dropped with no call after: every ``DROPPED_POLL_SECONDS`` after a put or a
    release, backing off to once a second while nothing is dropped.
"""

from __future__ import annotations

import collections
import contextlib
import weakref
from typing import TYPE_CHECKING

from tierstore._handle import TensorHandle
from tierstore.core._checks import check_handle
from tierstore.errors import TensorReleasedError

if TYPE_CHECKING:
    import asyncio
    from collections.abc import Callable

    from tierstore.core._entries import Entry

__all__ = [
    "DRAIN_DELAY_SECONDS",
    "DROPPED_POLL_MAX_SECONDS",
    "DROPPED_POLL_SECONDS",
    "HandleRef",
    "Handles",
]

DRAIN_DELAY_SECONDS = 0.005
"""Releases queued from inside the store are applied in batches: waking the loop thread for
each one costs a GIL hand-off. Every store call drains the batch first anyway."""
DROPPED_POLL_SECONDS = 0.02
"""How often the loop releases the entries of dropped handles while the store holds any, for
handles dropped with no store call after them (Note: [Release from a finalizer]), after a put
or a release; an idle store waits twice as long each time, up to
``DROPPED_POLL_MAX_SECONDS``."""
DROPPED_POLL_MAX_SECONDS = 1.0


class HandleRef(weakref.ref[TensorHandle]):
    """The store's weak reference to a handle; its callback queues the entry's release."""

    __slots__ = ("key",)
    key: int


class Handles:
    """The handles of one store: made at put, looked up at every call, released when dropped.

    Args:
        loop: the store's event loop, which drains dropped handles soon.
        token: the store's number; a handle of another store (or of the parent before a
            fork) carries another.
        drain_soon: takes the store's lock and releases the dropped handles' entries.
    """

    def __init__(
        self, loop: asyncio.AbstractEventLoop, token: int, drain_soon: Callable[[], None]
    ) -> None:
        self._loop = loop
        self.token = token
        self._drain_soon = drain_soon
        self.dropped: collections.deque[HandleRef | int] = collections.deque()
        """The weak references of handles that died, and the keys of entries released from
        inside the store, whose entries are not released yet."""
        self._scheduled = False
        # One bound method for every handle's weakref, rather than a new one kept per handle;
        # a C function (Note: [Release from a finalizer]).
        self._dead = self.dropped.append

    def new(self, e: Entry) -> TensorHandle:
        """The handle of ``e``, newly put; ``e`` keeps only a weak reference to it."""
        handle = TensorHandle(e.key, e.shape, e.dtype, e.device, e.nbytes, self.token)
        ref = HandleRef(handle, self._dead)
        ref.key = e.key
        e.handle_ref = ref
        return handle

    def lookup(self, entries: dict[int, Entry], handle: TensorHandle) -> Entry:
        """The live entry of ``handle``.

        Raises:
            TypeError: ``handle`` is not a :class:`~tierstore.TensorHandle`.
            TensorReleasedError: released, or another store's handle.
        """
        check_handle(handle)
        if not self.is_live(entries, handle):
            if handle._owner != self.token:
                why = "is not in this store (another store's handle, or one made before a fork)"
            else:
                why = "was released"
            raise TensorReleasedError(f"{handle!r} {why}")
        return entries[handle.key]

    def is_live(self, entries: dict[int, Entry], handle: TensorHandle) -> bool:
        """Whether ``handle`` still names a live entry (:meth:`lookup` would return it)."""
        e = entries.get(handle.key)
        return e is not None and e.handle_ref is not None and e.handle_ref() is handle

    def drop(self, key: int) -> None:
        """Release ``key``'s entry soon, on the store's loop; takes no lock (a release
        asked for from inside the store)."""
        self.dropped.append(key)
        self._schedule_drain()

    def _schedule_drain(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            with contextlib.suppress(RuntimeError):  # the loop is closed: close() drained
                self._loop.call_soon_threadsafe(
                    self._loop.call_later, DRAIN_DELAY_SECONDS, self._drain_scheduled
                )

    def _drain_scheduled(self) -> None:
        # Clear the flag before draining, so a handle dropped meanwhile schedules another.
        self._scheduled = False
        self._drain_soon()
