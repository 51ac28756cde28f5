"""Every open store, so that all of them close at interpreter exit and reset after fork."""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401  (its exit hook must be registered before ours)
import contextlib
import os
import threading
import weakref
from typing import Protocol

__all__ = ["register"]


class _Closable(Protocol):
    def _close_at_exit(self) -> None: ...
    def _reset_after_fork(self) -> None: ...


_open: weakref.WeakSet[_Closable] = weakref.WeakSet()


def register(store: _Closable) -> None:
    """Close ``store`` at exit and reset it in a forked child."""
    _open.add(store)


def _close_all() -> None:
    for store in list(_open):
        with contextlib.suppress(Exception):
            store._close_at_exit()
    _open.clear()


def _after_fork_in_child() -> None:
    for store in list(_open):
        store._reset_after_fork()


# Note: [Closing at exit]
#     ThreadPoolExecutor refuses new work once the interpreter starts shutting down, which
#     happens before plain atexit callbacks run. threading's own exit hooks run earlier and in
#     reverse order of registration; registering after concurrent.futures.thread lets every
#     store finish its transfers and delete its files while the I/O threads still work.
#     The plain atexit hook is the backstop (close is idempotent).
_register_threading_atexit = getattr(threading, "_register_atexit", None)
if _register_threading_atexit is not None:
    _register_threading_atexit(_close_all)
atexit.register(_close_all)
os.register_at_fork(after_in_child=_after_fork_in_child)
