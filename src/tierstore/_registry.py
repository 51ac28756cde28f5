"""Every open store and spill directory: closed or removed at exit and SIGTERM, reset after fork.

An ``AsyncTieredStore`` is held until it closes, so one dropped without ``close()`` (its
loop ended) is still closed properly at exit: its transfers end before the interpreter tears
down. Until then it keeps its I/O threads (8 by default), its lock file and its spill file at
the size it grew to. A ``TieredStore`` is held weakly: one dropped without ``close()`` (a
notebook cell that makes a new store each run) closes on its own loop thread as soon as it
is collected, and the exit hook waits for such closes still under way, since a loop thread
still running torch code at teardown can abort the process. Spill directories are also
tracked on their own until removed, as a backstop for exit and for the SIGTERM handler.
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401  (its exit hook must be registered before ours)
import contextlib
import logging
import os
import signal
import threading
import time
import weakref
from typing import TYPE_CHECKING, Protocol

from tierstore._inherited import close_inside

if TYPE_CHECKING:
    from pathlib import Path
    from types import FrameType

__all__ = ["register"]


class _Closable(Protocol):
    def _close_at_exit(self) -> None: ...
    def _reset_after_fork(self) -> None: ...


class _Forgettable(Protocol):
    def forget_after_fork(self) -> None: ...


class _Removable(Protocol):
    real_path: Path

    def remove(self) -> None: ...
    def forget(self) -> None: ...


log = logging.getLogger("tierstore")

_open: set[_Closable] = set()
_open_weakly: weakref.WeakSet[_Closable] = weakref.WeakSet()
# Dropped stores closing on their own: each loop thread, with the store's core (which a
# forked child must forget), weakly: the close holds it while it runs, and a finished one
# must not keep the core's memory, pinned pages included; and the moment its close is given
# up on at exit.
_closing: dict[threading.Thread, tuple[weakref.ref[_Forgettable], float]] = {}
_dirs: set[_Removable] = set()
# Reentrant: the SIGTERM handler runs on the main thread, possibly between the acquire and the
# release of a track() it interrupted.
_dirs_lock = threading.RLock()
_sigterm_checked = False


def register(store: _Closable, *, weakly: bool = False) -> None:
    """Close ``store`` at exit and reset it in a forked child, until :func:`unregister`.

    ``weakly``: without keeping it alive; a store registered so closes itself when dropped,
    and announces its loop thread with :func:`closing`.
    """
    (_open_weakly if weakly else _open).add(store)
    _install_sigterm_cleanup()


def unregister(store: _Closable) -> None:
    """``store`` closed: nothing left to do for it at exit."""
    _open.discard(store)
    _open_weakly.discard(store)


def closing(thread: threading.Thread, core: _Forgettable, wait: float) -> None:
    """A dropped store's loop ``thread`` closes ``core``: a forked child forgets the core
    (its spill files' descriptors), and exit waits for the thread up to ``wait`` seconds from
    now, as ``close()`` would have."""
    # First, for a fork from another thread: the store is already out of the open ones.
    _closing[thread] = (weakref.ref(core), time.monotonic() + wait)
    # copy(): a C-level copy, which no finalizer can interrupt to change the dict.
    for done in _closing.copy():
        if not done.is_alive():
            _closing.pop(done, None)


def track(directory: _Removable) -> None:
    """Remove ``directory`` at exit or SIGTERM unless it is removed or forgotten first."""
    with _dirs_lock:
        _dirs.add(directory)


def untrack(directory: _Removable) -> None:
    with _dirs_lock:
        _dirs.discard(directory)


def _tracked() -> list[_Removable]:
    with _dirs_lock:
        return list(_dirs)


def _close_all() -> None:
    for store in [*_open.copy(), *_open_weakly]:
        with contextlib.suppress(Exception):
            store._close_at_exit()
    _open.clear()
    for thread, (_core_ref, deadline) in _closing.copy().items():
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    _closing.clear()
    # Directories of stores that were dropped without close().
    for d in _tracked():
        with contextlib.suppress(Exception):
            d.remove()


def _after_fork_in_child() -> None:
    global _dirs_lock
    # Another thread of the parent may have held the lock at the fork; that thread is gone.
    _dirs_lock = threading.RLock()
    # The parent's directories stay the parent's: the child forgets them, and each store
    # starts anew at its first call. One that fails to reset must not leave the rest as they
    # were, holding the parent's dead loop.
    dirs = list(_dirs)
    # Every descriptor of a file in them, in one pass (Note: [Descriptors across fork]).
    try:
        close_inside([d.real_path for d in dirs])
    except Exception:
        log.exception("tierstore: after fork, could not close the parent's spill files")
    for d in dirs:
        try:
            d.forget()
        except Exception:
            log.exception("tierstore: after fork, could not forget the parent's %r", d)
    # Those threads were the parent's; their cores still hold the parent's spill files open.
    for thread, (core_ref, _deadline) in _closing.copy().items():
        core = core_ref()
        try:
            if core is not None:
                core.forget_after_fork()
        except Exception:
            log.exception("tierstore: after fork, could not forget a closing store's files")
        _closing.pop(thread, None)
    for store in [*_open.copy(), *_open_weakly]:
        try:
            store._reset_after_fork()
        except Exception:
            log.exception("tierstore: after fork, could not reset %r", store)


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


# Note: [SIGTERM]
#     Python's default SIGTERM action kills the process without running exit hooks, so a
#     plain ``kill`` (what schedulers, torchrun and docker send first) would leave every
#     spill directory behind until the next start sweeps it. When the first store opens, on
#     the main thread, and only if SIGTERM still has the default action, we install a handler
#     that deletes the spill directories and then re-raises SIGTERM with the default action.
#     The process still dies of SIGTERM (same exit status, no application code runs, no
#     exception is injected into the main thread) and leaves no files, with one difference: a
#     Python handler runs only when the main thread is back in the interpreter, so a process
#     blocked in a call that does not return (a stuck NCCL collective) dies when it returns,
#     or of the SIGKILL a launcher sends after its timeout, instead of at once. Running the
#     cleanup off the main thread would need the signal's wakeup descriptor, which asyncio
#     and applications own, and which a forked child would share with its parent.
#     The handler takes no store lock and waits for nothing, so it cannot deadlock with a
#     store call it interrupted; it removes every tracked directory, stores dropped without
#     close() included. An application that installs its own SIGTERM handler, before or after,
#     keeps full control (raising SystemExit from it closes every store through the exit
#     hooks). ``docs/reliability.md`` lists this behaviour.
def _install_sigterm_cleanup() -> None:
    global _sigterm_checked
    if _sigterm_checked or threading.current_thread() is not threading.main_thread():
        return
    _sigterm_checked = True
    try:
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _on_sigterm)
    except (ValueError, OSError):  # not the main interpreter, or signals unavailable
        pass


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    # No store lock, nothing waited for; _dirs_lock is reentrant and held only around set
    # operations, so this cannot deadlock with whatever the main thread was doing.
    for d in _tracked():
        with contextlib.suppress(Exception):
            d.remove()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)
