"""What a test may look at inside a store, without reaching into its private fields."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tierstore.core._checks import PLAIN_SUBCLASSES
from tierstore.testing._audit import audit_core

if TYPE_CHECKING:
    import asyncio
    from collections.abc import Callable, Iterator

    import torch

    from tierstore import AsyncTieredStore, TensorHandle, TieredStore
    from tierstore.core import StoreCore
    from tierstore.tiers import DiskEngine

__all__ = [
    "StoreInternals",
    "audit",
    "internals",
    "plain_tensor_type",
    "settled",
    "wait_for",
]


def wait_for(cond: Callable[[], bool], timeout: float = 15.0, what: str = "condition") -> None:
    """Poll ``cond`` until true.

    Raises:
        AssertionError: ``cond`` was still false after ``timeout`` seconds (default 15).
    """
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout}s")
        time.sleep(0.005)


def settled(store: TieredStore) -> bool:
    """No copy or write down a tier is in flight (``inflight_bytes`` is 0): every tensor put
    has reached the tier it was headed for. Reads back up are not counted."""
    return store.stats().inflight_bytes == 0


@contextlib.contextmanager
def plain_tensor_type(kind: type[torch.Tensor]) -> Iterator[None]:
    """Within the block, stores accept tensors of subclass ``kind`` as plain tensors (the
    stream simulator's stand-in for device tensors); other checks still apply."""
    PLAIN_SUBCLASSES.add(kind)
    try:
        yield
    finally:
        PLAIN_SUBCLASSES.discard(kind)


def internals(store: TieredStore | AsyncTieredStore) -> StoreInternals:
    """A view of ``store``'s insides for tests.

    Raises:
        RuntimeError: the store has not started (an ``AsyncTieredStore`` before its first
            call) or was reset after a fork.
    """
    core = store._core
    if core is None:
        raise RuntimeError("the store has not started: call it once first")
    return StoreInternals(core)


class StoreInternals:
    """Read-only views of one store's parts, and the one hook tests need (the engine wrapper).

    Made by :func:`internals`. Everything here may change with the store's implementation;
    it exists so that tests say what they look at in one place.
    """

    def __init__(self, core: StoreCore) -> None:
        self._core = core

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop that runs the store's transfers."""
        return self._core.loop

    @property
    def engine(self) -> DiskEngine | None:
        """The disk engine (the wrapper, once one is installed), or None without a disk tier."""
        return self._core.engine

    @property
    def spill_dirs(self) -> tuple[Path, ...]:
        """The store's private spill directories."""
        return tuple(Path(d) for d in self._core.spill_dirs)

    def wrap_engine(self, kind: Callable[[DiskEngine], Any]) -> Any:
        """Replace the disk engine by ``kind(engine)`` and return it.

        Raises:
            RuntimeError: no disk tier, or something is already on disk.
        """
        return self._core.wrap_engine(kind)

    def stats(self) -> Any:
        """:meth:`~tierstore.TieredStore.stats`, callable from any thread (also for an
        ``AsyncTieredStore``)."""
        return self._core.stats()

    def audit(self) -> dict[str, int]:
        """Recompute every counter from the live entries and compare.

        Returns:
            The recomputed bytes per tier, by tier name.

        Raises:
            AssertionError: a counter disagrees with the entries.
        """
        return audit_core(self._core)

    def entry(self, handle: TensorHandle) -> Any:
        """The entry of ``handle`` (its ``state``, ``fetch_future``, ... are attributes)."""
        return self._core.entry_of(handle)

    def states(self) -> list[str]:
        """The state of every live entry, oldest first."""
        core = self._core
        with core.lock:
            return [e.state.name for e in core.table.entries.values()]

    @property
    def prefetch_walk_steps(self) -> int:
        """Entries the prefetch walks have looked at (Note: [Resumable prefetch walk])."""
        return self._core.walk.steps

    @property
    def window_bytes(self) -> int:
        """Bytes of the copies fetched or being fetched ahead of gets (the prefetch window)."""
        core = self._core
        with core.lock:
            return core.table.window

    @property
    def deleting_bytes(self) -> int:
        """Spill bytes of released entries whose delete has not run yet."""
        return self._core.disk.deleting

    @property
    def read_pool(self) -> Any:
        """The pool of buffers that CPU tensors read back from disk land in."""
        return self._core.read_pool

    @property
    def pinned_pool(self) -> Any:
        """The pinned pool: the host tier of accelerator tensors."""
        return self._core.pinned


def audit(store: TieredStore | AsyncTieredStore) -> dict[str, int]:
    """Recompute ``store``'s counters from its live entries and compare; see
    :meth:`StoreInternals.audit`."""
    return internals(store).audit()
