"""AsyncTieredStore: the asyncio API of the store."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from tierstore import _registry
from tierstore._fork_safe_lock import ForkSafeLock
from tierstore._process_bound import ProcessBound
from tierstore.config import ALIASES, StoreConfig, check_timeout, unknown_setting
from tierstore.core import StoreCore
from tierstore.core._lock import held_here, refuse_inside
from tierstore.core._steps import check_step_number, finish_step
from tierstore.errors import StoreClosedError, TierFullError, WrongThreadError

if TYPE_CHECKING:
    from types import TracebackType

    from tierstore._handle import TensorHandle
    from tierstore._state import TensorState, Tier
    from tierstore._stats import StepStats, StoreStats

__all__ = ["AsyncTieredStore", "resolve_config"]

log = logging.getLogger("tierstore")


def resolve_config(
    config: StoreConfig | None, overrides: dict[str, object], keywords: tuple[str, ...] = ()
) -> StoreConfig:
    """``config`` with ``overrides`` applied, or the environment with them when None.

    Args:
        config: the configuration given, or None.
        overrides: keyword arguments naming fields of :class:`StoreConfig` (or aliases).
        keywords: the calling class's own keywords, listed with the fields when an override
            names none of them.

    Raises:
        ConfigError: an unknown keyword (the error lists every known one), or a bad value.
    """
    fields = {f.name for f in dataclasses.fields(StoreConfig)}
    for key, value in overrides.items():
        if ALIASES.get(key, key) not in fields:
            raise unknown_setting(key, value, keywords)
    if config is None:
        return StoreConfig.from_env(**overrides)
    return config.replace(**overrides) if overrides else config


_renewing = ForkSafeLock()
"""Held only while a forked child swaps in a store's own binding lock (Note: [Binding to a
loop]): never while a core is made."""


class AsyncTieredStore(ProcessBound):  # Note: [A copy of a store is the store]
    """The tiered store as coroutines, bound to the event loop it is first used on.

    Example:
        >>> async def main():
        ...     async with AsyncTieredStore(host_bytes="64MiB") as store:
        ...         h = await store.put(torch.ones(1 << 20))
        ...         return (await store.get(h)).sum().item()

    Args:
        config: a :class:`StoreConfig`; by default read from the ``TIERSTORE_*`` environment.
        close_timeout: seconds :meth:`close` lets transfers finish before cancelling them
            (default 60; a positive number up to 1e9).
        **overrides: fields of :class:`StoreConfig` (``host_bytes="64MiB"``, ...); they win.

    Raises:
        ConfigError: a bad configuration value, named with its variable, or a ``close_timeout``
            that is not a positive, finite number of seconds.

    Attributes:
        config: the resolved :class:`~tierstore.StoreConfig`.
    """

    def __init__(
        self, config: StoreConfig | None = None, *, close_timeout: float = 60.0, **overrides: object
    ) -> None:
        seconds = check_timeout(close_timeout, name="close_timeout", allow_none=False)
        assert seconds is not None
        self._close_timeout = seconds
        self.config = resolve_config(config, overrides, ("config", "close_timeout"))
        self._core: StoreCore | None = None
        self._closed = False
        self._closing: asyncio.Task[None] | None = None
        # Note: [Binding to a loop]
        self._binding = threading.Lock()
        self._binding_pid = os.getpid()
        self._binder: tuple[int, int] | None = None

    def _bound(self) -> StoreCore:
        if self._closed:
            raise StoreClosedError("this AsyncTieredStore is closed; create a new one")
        loop = asyncio.get_running_loop()
        core = self._core
        if core is None:
            core = self._bind(loop)
        refuse_inside(core.lock, "AsyncTieredStore")
        if core.loop is not loop:
            raise WrongThreadError(
                "this AsyncTieredStore belongs to the event loop it was opened on; use it "
                "there, or use TieredStore, which any thread may call"
            )
        return core

    def _bind(self, loop: asyncio.AbstractEventLoop) -> StoreCore:
        """Make the core, bound to ``loop``, unless another loop's first call just did.

        Note: [Binding to a loop]
            Two loops' first calls at once each built a core, and one was lost with its
            directory and I/O threads, which ``close()`` never reached: the core is made
            under a lock of this store's. Making it allocates, so the collector can run a
            finalizer there that calls this store again: that raises instead of waiting on
            the lock its own thread holds (a lock shared by every store hung any first call
            made so). A fork while another thread holds the lock leaves it held in the
            child by no thread: each process takes a lock of its own at its first bind,
            swapped in under a lock shared by every store but held only for the swap.

        Raises:
            WrongThreadError: called again from this thread while it makes the core.
        """
        me = (os.getpid(), threading.get_ident())
        if self._binding_pid != me[0]:  # the first bind in a forked child
            with _renewing:
                if self._binding_pid != me[0]:
                    self._binding, self._binder = threading.Lock(), None
                    self._binding_pid = me[0]
        if self._binder == me:
            raise WrongThreadError(
                "AsyncTieredStore was called while this thread was opening it (from a __del__ "
                "the garbage collector ran, or a signal handler); call it from elsewhere"
            )
        with self._binding:
            core = self._core
            if core is not None:
                return core
            self._binder = me
            try:
                core = self._core = StoreCore(self.config, loop, me[1])
            finally:
                self._binder = None
            _registry.register(self)
            return core

    async def open(self) -> AsyncTieredStore:
        """Create the spill directory and bind to the running loop (done by the first call)."""
        self._bound()
        return self

    async def __aenter__(self) -> AsyncTieredStore:
        return await self.open()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def put(self, t: torch.Tensor, *, min_bytes: int | None = None) -> TensorHandle:
        """Store ``t``; see :meth:`tierstore.TieredStore.put`."""
        core = self._bound()
        try:
            handle, waiter = core.put_now(t, min_bytes)
        except TierFullError:
            del t  # Note: [A failed host copy keeps nothing]
            raise
        if waiter is not None:
            with core.waiting("put"):
                await asyncio.shield(asyncio.wrap_future(waiter))
        return handle

    async def get(self, handle: TensorHandle) -> torch.Tensor:
        """The tensor, back on its device; see :meth:`tierstore.TieredStore.get`."""
        core = self._bound()
        ready = core.get_now(handle)
        if isinstance(ready, torch.Tensor):
            return ready
        try:
            with core.waiting("get"):
                t = await asyncio.shield(asyncio.wrap_future(ready))
        except BaseException:
            del ready  # Note: [A failed wait keeps no handle]
            raise
        core.consumed(handle, t)
        return t

    async def prefetch(self, handles: Iterable[TensorHandle]) -> None:
        """Start bringing these tensors closer, newest first, within the prefetch window.

        Raises:
            TypeError: one of ``handles`` is not a :class:`~tierstore.TensorHandle`.
            TensorReleasedError: one was released, or is another store's; nothing is
                started then.
            StoreClosedError: the store is closed.
        """
        self._bound().prefetch_now(handles)

    async def hold_back(self, handles: Iterable[TensorHandle]) -> None:
        """Do not bring these tensors back ahead of a get: the caller has them at hand. A
        copy already brought back for them is dropped; a later :meth:`get` still returns
        them (read on demand), and a :meth:`get` or :meth:`prefetch` of one undoes this.

        Raises:
            TypeError: one of ``handles`` is not a :class:`~tierstore.TensorHandle`.
            TensorReleasedError: one was released, or is another store's; nothing is held
                back then.
            StoreClosedError: the store is closed.
        """
        self._bound().hold_back_now(handles)

    async def release(self, handle: TensorHandle) -> None:
        """Free the entry now instead of when the handle is garbage-collected (nothing after
        :meth:`close`, which released everything)."""
        if self._closed:
            return
        core = self._core
        if core is not None and held_here(core.lock):  # Note: [A call from inside the store]
            core.release_later(handle)
            return
        self._bound().release(handle)

    async def tier_of(self, handle: TensorHandle) -> Tier:
        """Where the tensor's bytes are now."""
        return self._bound().tier_of(handle)

    async def state_of(self, handle: TensorHandle) -> TensorState:
        """The entry's :class:`~tierstore.TensorState`."""
        return self._bound().state_of(handle)

    async def stats(self) -> StoreStats:
        """A frozen :class:`~tierstore.StoreStats` snapshot; after :meth:`close`, the one
        taken as it closed."""
        final = self._core.final_stats if self._closed and self._core is not None else None
        return final if final is not None else self._bound().stats()

    async def step_stats(self, step: int | None = None) -> StepStats:
        """The current step so far; see :meth:`tierstore.TieredStore.step_stats`."""
        return self._bound().step_stats(check_step_number(step), end=False)

    async def end_step(self, step: int | None = None) -> StepStats:
        """End a training step; see :meth:`tierstore.TieredStore.end_step`."""
        return finish_step(self, self._bound(), step, self.config.min_bytes)

    def note_skipped(self, reason: str, nbytes: int) -> None:
        """Count a tensor an adapter chose not to store (shows in ``stats().skipped``)."""
        core = self._core
        # Only counted: from inside the store (Note: [A call from inside the store]) it is lost.
        if core is not None and not held_here(core.lock):
            core.note_skipped(reason, nbytes)

    async def close(self) -> None:
        """Finish or cancel transfers, delete the spill directory; idempotent.

        Closing runs as a task of its own: a ``close()`` that is cancelled leaves it running,
        and calling ``close()`` again waits for the same task (and raises what it raised).

        Once the loop the store was opened on has closed (``asyncio.run(train(store))``
        then ``asyncio.run(store.close())``), the running loop closes it: nothing can be in
        flight on a closed loop.

        Raises:
            WrongThreadError: called on another event loop than the one the store was opened
                on while that loop is still open, or from inside the store (a finalizer);
                nothing is closed then.
        """
        core = self._core
        running = asyncio.get_running_loop()
        if core is not None and core.loop is not running and not core.loop.is_closed():
            raise WrongThreadError(
                "this AsyncTieredStore belongs to the event loop it was opened on; close it "
                "there (at exit, the interpreter removes its files if it is never closed)"
            )
        if core is not None:
            refuse_inside(core.lock, "AsyncTieredStore.close()")
        self._closed = True
        if core is None:
            _registry.unregister(self)
            return
        if core.begin_close():
            closing = (
                core.finish_close(self._close_timeout) if core.loop is running else core.tear_down()
            )
            self._closing = running.create_task(closing)
            self._closing.add_done_callback(self._closed_or_not)
        if self._closing is not None:
            # Shielded: cancelling this caller must not cancel the deletion half-way.
            await asyncio.shield(self._closing)

    def _closed_or_not(self, task: asyncio.Task[None]) -> None:
        # Only a close that finished leaves nothing for the exit hook (_close_at_exit).
        if _finished(task):
            _registry.unregister(self)
        elif not task.cancelled():
            log.warning("tierstore: closing an AsyncTieredStore failed: %r", task.exception())

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called."""
        return self._closed

    def _close_at_exit(self) -> None:
        # The loop may be gone at exit; removing the files needs no loop. A close that began
        # and never finished (its loop stopped first) leaves them too.
        core = self._core
        if core is None:
            return
        unfinished = self._closing is not None and not _finished(self._closing)
        if core.begin_close() or unfinished:
            core.disk_tier.remove()

    def _reset_after_fork(self) -> None:
        # Note: [A fresh store after fork] (in _sync.py): the child's first call binds a new
        # core to the child's loop. A store closed, or closing, in the parent stays closed.
        if self._core is not None:
            self._core.forget_after_fork()
        self._core = None
        self._closing = None


def _finished(task: asyncio.Task[None]) -> bool:
    """Whether a close task ran to its end without an error."""
    return task.done() and not task.cancelled() and task.exception() is None
