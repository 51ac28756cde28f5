"""The store's side of its handles: a weak reference each, whose death queues a release.

Note: [Release from a finalizer]
    Handles are released by their weak reference's callback when they are garbage-collected,
    which can happen in any thread, even one that holds the store's lock at that moment. The
    callback therefore only appends the key to a deque (atomic) and asks the loop to drain it
    soon; every public operation drains it first too, so a caller never sees a released entry
    counted.

Note: [Ctrl-C in a finalizer]
    A handle dies wherever its last reference goes, often on the main thread, between a
    training loop's statements. A SIGINT that arrives while its callback runs raises
    KeyboardInterrupt inside the callback, where Python prints "Exception ignored" and drops
    it: the user's Ctrl-C did nothing. Most of the callback's time is the write that wakes the
    loop, a system call that the signal interrupts. So the callback hands the interrupt back
    to the main thread and leaves the drain scheduled or not, never half-way. It installs a
    one-shot SIGINT handler that puts the previous one back and raises KeyboardInterrupt, and
    a timer thread sends the main thread a real SIGINT a millisecond later, once the callback
    has returned: a real signal breaks a sleep or a lock wait at once (flagging one with
    ``_thread.interrupt_main()`` waits for the call to return), and the one-shot handler
    keeps the application's own from running twice for one Ctrl-C (it ran already, and
    raised the interrupt the callback caught).
"""

from __future__ import annotations

import collections
import contextlib
import signal
import threading
import weakref
from typing import TYPE_CHECKING

from tierstore._handle import TensorHandle
from tierstore.core._checks import check_handle
from tierstore.errors import TensorReleasedError

if TYPE_CHECKING:
    import asyncio
    from collections.abc import Callable
    from types import FrameType

    from tierstore.core._entries import Entry

__all__ = ["DRAIN_DELAY_SECONDS", "HandleRef", "Handles"]

DRAIN_DELAY_SECONDS = 0.005
"""Dropped handles are released in batches: waking the loop thread for each one costs a GIL
hand-off. Every store call drains the batch first anyway."""


def _interrupt_again() -> None:
    """Raise KeyboardInterrupt in the main thread again, soon, without calling the
    application's SIGINT handler (Note: [Ctrl-C in a finalizer]). On the main thread."""
    previous = signal.getsignal(signal.SIGINT)
    if previous is None:  # installed outside Python: the closest is the default
        previous = signal.SIG_DFL

    def once(signum: int, frame: FrameType | None) -> None:
        signal.signal(signal.SIGINT, previous)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, once)
    main = threading.main_thread().ident
    assert main is not None
    threading.Timer(0.001, signal.pthread_kill, (main, signal.SIGINT)).start()


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
        self.dropped: collections.deque[int] = collections.deque()
        """Keys of handles that died and whose entries are not released yet."""
        self._scheduled = False
        # One bound method for every handle's weakref, rather than a new one kept per handle.
        self._dead = self._on_dead

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

    def _on_dead(self, ref: HandleRef) -> None:
        """Weakref callback of a handle (Note: [Release from a finalizer])."""
        try:
            # The key first, by a call into C: a signal is raised only after a call returns,
            # so from here on the release is queued whatever the signal does.
            self.dropped.append(ref.key)
            self._schedule_drain()
        except KeyboardInterrupt:  # Note: [Ctrl-C in a finalizer]
            if threading.current_thread() is not threading.main_thread():
                raise  # not a signal's: only the main thread gets those
            _interrupt_again()

    def drop(self, key: int) -> None:
        """Release ``key``'s entry soon, on the store's loop; takes no lock."""
        self.dropped.append(key)
        self._schedule_drain()

    def _schedule_drain(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            try:
                with contextlib.suppress(RuntimeError):  # the loop is closed: close() drained
                    self._loop.call_soon_threadsafe(
                        self._loop.call_later, DRAIN_DELAY_SECONDS, self._drain_scheduled
                    )
            except BaseException:
                self._scheduled = False  # the next drop schedules it; every call drains
                raise

    def _drain_scheduled(self) -> None:
        # Clear the flag before draining, so a handle dropped meanwhile schedules another.
        self._scheduled = False
        self._drain_soon()
