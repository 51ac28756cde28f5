"""TieredStore: the synchronous facade, callable from any thread.

It owns one event loop on a background thread, which runs every transfer. Operations that can
finish at once (a put with room, a get of a tensor that is back) run in the caller's thread
(Note: [Threading model]); the rest wait on the loop's results.

Note: [A failed wait keeps no handle]
    A get that waits does so on a future, and a future that failed holds its error. Raising
    the error stores the traceback of the raise in it, whose frames hold the future (as a local
    of the waiting frames) and the caller's handle: a reference cycle. The handle would then
    outlive the caller's last reference to it until the garbage collector happened to run,
    and its entry with it. So a wait that raises first drops its frames' reference to the
    future; both facades do.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import logging
import threading
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, TypeVar

import torch

from tierstore import _registry
from tierstore._fork_safe_lock import ForkSafeLock
from tierstore._process_bound import ProcessBound
from tierstore._store import resolve_config
from tierstore.config import check_timeout
from tierstore.core import StoreCore
from tierstore.core._lock import held_here, refuse_inside
from tierstore.core._steps import check_step_number, finish_step
from tierstore.errors import (
    StoreClosedError,
    StoreTimeoutError,
    TierFullError,
    WrongThreadError,
)

if TYPE_CHECKING:
    from pathlib import Path
    from types import TracebackType

    from tierstore._handle import TensorHandle
    from tierstore._state import TensorState, Tier
    from tierstore._stats import StepStats, StoreStats
    from tierstore.config import StoreConfig

__all__ = ["TieredStore", "default_store"]

T = TypeVar("T")


class TieredStore(ProcessBound):  # Note: [A copy of a store is the store]
    """A tiered tensor store: device, host memory, then disk.

    Example:
        >>> with TieredStore(host_bytes="64MiB") as store:
        ...     h = store.put(torch.ones(1 << 20))
        ...     store.get(h).sum().item()
        1048576.0

    Args:
        config: a :class:`~tierstore.StoreConfig`; by default read from ``TIERSTORE_*``.
        timeout: seconds a blocking call waits before raising ``StoreTimeoutError``, and
            :meth:`close` lets transfers finish before cancelling them (default 300; ``None``
            waits forever, and close then waits 60 s). A positive number up to 1e9.
        **overrides: fields of :class:`~tierstore.StoreConfig`; they win over the environment.

    Raises:
        ConfigError: a bad configuration value, named with its variable, or a ``timeout`` that
            is not a positive, finite number of seconds or ``None``.

    Attributes:
        config: the resolved :class:`~tierstore.StoreConfig` (read-only; adapters read
            ``min_bytes`` and ``prefetch_bytes`` from it).

    Every method may be called from any thread except the store's own loop thread (that would
    deadlock and raises ``WrongThreadError``). The store closes at interpreter exit, and after
    ``os.fork`` the child gets a fresh, empty store under the same object, started by its
    first call there.
    """

    def __init__(
        self,
        config: StoreConfig | None = None,
        *,
        timeout: float | None = 300.0,
        **overrides: object,
    ) -> None:
        self._timeout = check_timeout(timeout, name="timeout")
        self.config = resolve_config(config, overrides, ("config", "timeout"))
        self._close_timeout = 60.0 if self._timeout is None else self._timeout
        self._closed = False
        self._start_lock = threading.Lock()
        self._close_done = threading.Event()
        self._core: StoreCore | None = None
        self._thread: threading.Thread | None = None
        self._when_dropped: (
            weakref.finalize[[StoreCore, threading.Thread, float], TieredStore] | None
        ) = None
        self._start()
        _registry.register(self, weakly=True)

    # ------------------------------------------------------------------ loop thread

    def _start(self) -> None:
        loop = asyncio.new_event_loop()
        started = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(loop)
            loop.call_soon(started.set)
            try:
                loop.run_forever()
            finally:
                loop.close()

        thread = threading.Thread(target=run, name="tierstore-loop", daemon=True)
        thread.start()
        started.wait()
        assert thread.ident is not None
        try:
            self._core = StoreCore(self.config, loop, thread.ident)
        except BaseException:
            loop.call_soon_threadsafe(loop.stop)
            thread.join()
            raise
        self._thread = thread
        self._when_dropped = weakref.finalize(
            self, _close_dropped, self._core, thread, self._close_timeout
        )
        self._when_dropped.atexit = False  # the registry's exit hook closes it

    def _live(self) -> StoreCore:
        core = self._core
        if core is None and not self._closed:
            core = self._start_in_child()
        if core is None or self._closed:
            raise StoreClosedError("this TieredStore is closed; create a new one")
        if threading.get_ident() == core.loop_thread:
            raise WrongThreadError(
                "TieredStore was called from its own event-loop thread, which would deadlock; "
                "call it from another thread, or use AsyncTieredStore inside coroutines"
            )
        refuse_inside(core.lock, "TieredStore")
        return core

    def _wait(self, fut: cf.Future[T], what: str) -> T:
        try:
            return fut.result(timeout=self._timeout)
        except cf.TimeoutError:
            raise StoreTimeoutError(
                f"{what} waited more than {self._timeout}s; the disk may be stuck. Pass "
                "TieredStore(timeout=...) to wait longer"
            ) from None
        except BaseException:
            del fut  # Note: [A failed wait keeps no handle]
            raise

    # ------------------------------------------------------------------ operations

    def put(self, t: torch.Tensor, *, min_bytes: int | None = None) -> TensorHandle:
        """Store ``t`` and return a handle at once; wait only when the save semaphore is full.

        The store keeps ``t`` (or a copy) until the handle is released; do not modify ``t`` in
        place afterwards. Tensors smaller than ``min_bytes`` stay where they are: the
        store's ``min_bytes`` (``TIERSTORE_MIN_BYTES``, 1 MiB by default) unless this put
        passes its own (the adapters pass theirs).

        Raises:
            UnsupportedTensorError: not a plain strided CPU or CUDA tensor.
            TierFullError: no tier has room; nothing was stored.
            StoreClosedError: the store is closed.
            StoreTimeoutError: the save semaphore stayed full longer than ``timeout`` (the
                tensor is stored; its handle is lost with the exception, which releases it).
            ValueError: ``min_bytes`` is not a non-negative integer or None.
        """
        core = self._live()
        try:
            handle, waiter = core.put_now(t, min_bytes)
        except TierFullError:
            del t  # Note: [A failed host copy keeps nothing]
            raise
        if waiter is not None:
            with core.waiting("put"):
                self._wait(waiter, "put")
        return handle

    def get(self, handle: TensorHandle) -> torch.Tensor:
        """The tensor back on its own device, bit-exact; repeatable until release.

        The result is a contiguous tensor with the dtype and shape that were put, whose
        storage holds exactly its bytes: ``storage_offset() == 0`` and
        ``untyped_storage().nbytes()`` is its own size, so nothing of another tensor can be
        reached through it (Note: [What get returns]). A tensor read back from
        disk sits in a reused read buffer whose storage cannot grow, as with
        ``torch.frombuffer``: ``clone()`` it before using it as a resizable ``out=``.

        Treat the result as read-only: on the CPU it may be the very tensor the store holds.
        A get during a spill is answered from the source, which stays valid until the write
        ends; it never waits for the disk.

        Raises:
            TensorReleasedError: the handle was released or is another store's.
            TensorModifiedError: the tensor (or one sharing its storage: its base, a view,
                this result) was written in place or its storage resized after put, so the
                store cannot vouch for what was put.
            SpillIOError: reading it back failed (the entry stays on disk; retry may work).
            CorruptTensorError: its spilled bytes failed their checksum.
            StoreTimeoutError: waited longer than ``timeout``.
        """
        core = self._live()
        ready = core.get_now(handle)
        if isinstance(ready, torch.Tensor):
            return ready
        try:
            with core.waiting("get"):
                t = self._wait(ready, f"get of {handle!r}")
        except BaseException:
            del ready  # Note: [A failed wait keeps no handle]
            raise
        core.consumed(handle, t)
        return t

    def prefetch(self, handles: Iterable[TensorHandle]) -> None:
        """Start bringing these tensors back toward their device, newest first.

        Raises:
            TypeError: one of ``handles`` is not a :class:`~tierstore.TensorHandle`.
            TensorReleasedError: one was released, or is another store's; nothing is
                started then.
            StoreClosedError: the store is closed.
        """
        self._live().prefetch_now(handles)

    def hold_back(self, handles: Iterable[TensorHandle]) -> None:
        """Do not bring these tensors back ahead of a get: the caller has them at hand (a
        checkpoint input still alive at backward). A copy already brought back for them is
        dropped; a later :meth:`get` still returns them (read on demand), and a :meth:`get`
        or :meth:`prefetch` of one undoes this.

        Raises:
            TypeError: one of ``handles`` is not a :class:`~tierstore.TensorHandle`.
            TensorReleasedError: one was released, or is another store's; nothing is held
                back then.
            StoreClosedError: the store is closed.
        """
        self._live().hold_back_now(handles)

    def release(self, handle: TensorHandle) -> None:
        """Free the entry now (also happens when the last reference to the handle goes);
        after :meth:`close`, which released everything, it does nothing. From a finalizer
        the collector runs inside the store or on its loop thread, it is queued and done
        soon (Note: [A call from inside the store]).

        Raises:
            TypeError: ``handle`` is not a :class:`~tierstore.TensorHandle`.
            TensorReleasedError: another store's handle.
        """
        if self._closed:
            return
        core = self._core
        if core is not None and (
            # Note: [A call from inside the store]; a finalizer the collector runs on the
            # loop thread is the same case, and a release needs no answer from the loop.
            held_here(core.lock) or threading.get_ident() == core.loop_thread
        ):
            core.release_later(handle)
            return
        try:
            live = self._live()
        except StoreClosedError:
            return  # another thread closed the store since the test above: all is released
        live.release(handle)

    def tier_of(self, handle: TensorHandle) -> Tier:
        """``Tier.DEVICE``, ``Tier.HOST`` or ``Tier.DISK``: where the bytes are now.

        Raises:
            TypeError: ``handle`` is not a :class:`~tierstore.TensorHandle`.
            TensorReleasedError: released, or another store's handle.
            CorruptTensorError, TensorModifiedError: the entry failed (its bytes were
                damaged on disk, or the tensor was written after ``put``); the error its
                ``get`` raises.
        """
        return self._live().tier_of(handle)

    def state_of(self, handle: TensorHandle) -> TensorState:
        """The entry's :class:`~tierstore.TensorState` (``RELEASED`` once released).

        Raises:
            TypeError: ``handle`` is not a :class:`~tierstore.TensorHandle`.
            TensorReleasedError: another store's handle.
        """
        return self._live().state_of(handle)

    def stats(self) -> StoreStats:
        """A frozen snapshot: bytes and counts per tier, bytes moved, time spent, waits.

        After :meth:`close`, the snapshot taken as it closed (``with TieredStore() as s:``
        ... then ``print(s.stats())``).

        Raises:
            StoreClosedError: closed before it ever opened, while its close still runs, or
                after a close that raised ``StoreTimeoutError`` (no snapshot was taken).
        """
        final = self._core.final_stats if self._closed and self._core is not None else None
        return final if final is not None else self._live().stats()

    def step_stats(self, step: int | None = None) -> StepStats:
        """The current training step so far: what the store did since the last
        :meth:`end_step` (or since it opened) and the peaks since then; starts nothing.

        Args:
            step: the number to give it (default: one more than the last step's).

        Raises:
            ValueError: ``step`` is not a non-negative integer or None.
        """
        return self._live().step_stats(check_step_number(step), end=False)

    def end_step(self, step: int | None = None) -> StepStats:
        """End a training step: its :class:`~tierstore.StepStats`, then the next step counts
        from here (its peaks start at what the tiers hold now).

        Call it once per optimizer step; ``print(store.end_step())`` prints one line, e.g.
        ``tierstore: step 12 offloaded 3.1 GiB (host 2.0, disk 1.1), peak off-device 2.9
        GiB, backward waited 0.04 s, skipped 12 MiB (parameters 10, small 2.0)``. A step that
        stored nothing warns once per store (``RuntimeWarning``), saying what was left in
        place and why.

        Args:
            step: the step's number, such as the trainer's global step (default: one more
                than the last).

        Raises:
            ValueError: ``step`` is not a non-negative integer or None.
        """
        return finish_step(self, self._live(), step, self.config.min_bytes)

    def note_skipped(self, reason: str, nbytes: int) -> None:
        """Count a tensor an adapter chose not to store (shows in ``stats().skipped``)."""
        self._live().note_skipped(reason, nbytes)

    @property
    def spill_dirs(self) -> tuple[Path, ...]:
        """This store's private spill directories (empty when the disk tier is off)."""
        core = self._core
        return tuple(core.spill_dirs) if core is not None else ()  # type: ignore[arg-type]

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called."""
        return self._closed

    # ------------------------------------------------------------------ lifetime

    def close(self) -> None:
        """Let transfers finish, delete every spill file and the directory; idempotent. A
        close while another thread's runs waits for that one to end.

        Raises:
            WrongThreadError: called from the store's own loop thread, or from a finalizer or
                signal handler that interrupted this thread inside the store (the store stays
                open).
            StoreTimeoutError: the transfers neither ended nor were cancelled within twice
                the store's timeout (60 s without one) and 5 s; the directory is removed at
                exit.
        """
        wait = _close_wait(self._close_timeout)
        with self._start_lock:
            core, thread = self._core, self._thread
            if core is not None and threading.get_ident() == core.loop_thread:
                # Before the store is marked closed: marked and left running, no later close
                # (nor the exit hook's) would have stopped its loop.
                raise WrongThreadError("TieredStore.close() called from its own loop thread")
            if core is not None:
                refuse_inside(core.lock, "TieredStore.close()")
            closing = self._closed
            self._closed = True
        if closing:
            # "close() returned" means the files are gone: wait for the close under way.
            self._close_done.wait(timeout=wait + 10)
            return
        if self._when_dropped is not None:
            self._when_dropped.detach()
        if core is None or thread is None:
            self._close_done.set()
            return
        try:
            if core.begin_close():
                done = asyncio.run_coroutine_threadsafe(
                    core.finish_close(self._close_timeout), core.loop
                )
                try:
                    done.result(timeout=wait)
                except cf.TimeoutError:
                    raise StoreTimeoutError(
                        f"close() waited {wait:g}s for the store's transfers to end or cancel; "
                        "a thread may be stuck in a disk call. The spill directories are "
                        "removed when the process exits"
                    ) from None
        finally:
            core.loop.call_soon_threadsafe(core.loop.stop)
            thread.join(timeout=5)
            _registry.unregister(self)
            self._close_done.set()

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _close_at_exit(self) -> None:
        self.close()

    def _reset_after_fork(self) -> None:
        # Note: [A fresh store after fork]
        #     The loop thread did not survive the fork. The parent's entries and spill files
        #     stay the parent's: the child forgets them and starts empty, with its own
        #     directory, at its first call (_start_in_child), not here in the at-fork hook:
        #     other libraries reset their own state in at-fork hooks too, in an order we do
        #     not control, and zarr's, which restarts its event loop, may not have run yet
        #     (a store on the zarr engine started here hung the child).
        core, self._core, self._thread = self._core, None, None
        if self._when_dropped is not None:
            self._when_dropped.detach()  # the parent's loop, which the child does not have
        self._start_lock = threading.Lock()
        self._close_done = threading.Event()
        if self._closed:
            # A close under way in the parent has no thread here to end it.
            self._close_done.set()
        if core is not None:
            core.forget_after_fork()

    def _start_in_child(self) -> StoreCore | None:
        # See Note: [A fresh store after fork]. None: closed meanwhile.
        with self._start_lock:
            if self._core is None and not self._closed:
                self._start()
            return self._core

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"TieredStore({state}, dirs={[str(p) for p in self.spill_dirs]})"


def _close_wait(timeout: float) -> float:
    """How long a close waits for transfers to end or be cancelled: twice the store's
    timeout (finish, then cancel) and 5 s."""
    return 2 * timeout + 5


def _close_dropped(core: StoreCore, thread: threading.Thread, timeout: float) -> None:
    """Close the store of ``core``, dropped without ``close()``, on its own loop thread.

    Note: [A dropped store closes]
        A ``TieredStore`` that goes out of scope unclosed (a notebook cell run again) would
        otherwise keep its loop thread, its I/O threads and its spill file until exit. The
        collector runs this finalizer wherever it frees the store: on any thread, maybe on
        the store's own loop or inside its lock. So it waits for nothing and touches no
        state: it only asks the loop to close the store as a callback of its own, and to stop
        once that ends. Handles do not keep their store alive: the close releases the entries
        of any still held, which then read as released. The registry keeps the closing core
        until its thread ends: the exit hook waits for it as long as ``close()`` would have
        (a loop thread cut off at teardown can abort the process), and a forked child forgets
        its spill files, as it does an open store's.
    """
    loop = core.loop

    def begin() -> None:
        if not core.begin_close():
            loop.stop()
            return
        closed = loop.create_task(core.finish_close(timeout))
        closed.add_done_callback(end)

    def end(closed: asyncio.Task[None]) -> None:
        if not closed.cancelled() and (err := closed.exception()) is not None:
            log.warning("tierstore: closing a store dropped without close() failed: %r", err)
        loop.stop()

    _registry.closing(thread, core, _close_wait(timeout))
    with contextlib.suppress(RuntimeError):  # its loop is closed already
        loop.call_soon_threadsafe(begin)


log = logging.getLogger("tierstore")
_default: TieredStore | None = None
# default_store() holds it while a store starts: a fork from another thread then.
_default_lock = ForkSafeLock()


def default_store() -> TieredStore:
    """The process-wide store built from the environment (what ``store=None`` means).

    It is created on first use and again after it was closed.
    """
    global _default
    with _default_lock:
        if _default is None or _default.closed:
            _default = TieredStore()
        return _default
