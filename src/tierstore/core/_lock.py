"""The store's lock, which knows which thread holds it."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from types import TracebackType

__all__ = ["StoreLock"]


class StoreLock:
    """A ``threading.Lock`` that records its holder.

    Note: [A call from inside the store]
        The garbage collector runs ``__del__`` methods and weakref callbacks on whatever thread
        allocates when a collection is due, and that can be a thread inside the store, holding
        this lock (``put`` allocates under it). A finalizer that calls the store then waited
        on its own thread for ever, and every other thread behind it: the whole process hung,
        with no timeout. The store's entry points ask :meth:`held_here` first: ``release``
        queues its handle as a dropped handle is queued, and the other calls raise
        ``WrongThreadError`` instead of waiting. A signal handler interrupting the store is
        the same case.
    """

    __slots__ = ("_holder", "_lock")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holder = 0

    def held_here(self) -> bool:
        """Whether the calling thread holds the lock (only that thread can have set it)."""
        return self._holder == threading.get_ident()

    def __enter__(self) -> StoreLock:
        self._lock.acquire()
        self._holder = threading.get_ident()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._holder = 0
        self._lock.release()
