"""A lock a forked child gets anew."""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from types import TracebackType

__all__ = ["ForkSafeLock"]


class ForkSafeLock:
    """A ``threading.Lock`` made anew in a forked child.

    A fork copies a lock as it is: held by another thread of the parent at that moment, it
    stays held in the child, which has no such thread to release it, and the child's first
    use waits for ever. For module-level locks taken briefly (once-per-store warnings,
    the default store's start); each registers an at-fork hook for the life of the process.
    """

    __slots__ = ("__weakref__", "_lock")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        os.register_at_fork(after_in_child=self._renew)

    def _renew(self) -> None:
        self._lock = threading.Lock()

    def locked(self) -> bool:
        return self._lock.locked()

    def __enter__(self) -> ForkSafeLock:
        self._lock.acquire()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._lock.release()
