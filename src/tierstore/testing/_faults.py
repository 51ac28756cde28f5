"""Fault injection at the disk engine boundary: a wrapping engine and short-I/O patches.

Install the wrapper on a store before anything is spilled::

    faulty = install_faults(store)             # a FaultyEngine around the store's own engine
    faulty.fail_writes(errno.ENOSPC)           # every write fails with ENOSPC from now on
    faulty.fail_reads(errno.EIO, times=1)      # the next read fails once

Everything here uses the ``DiskEngine`` contract only, so it holds for any engine (raw, zarr).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno as errno_mod
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, overload

from tierstore.testing._internals import internals
from tierstore.tiers import DiskEngine

if TYPE_CHECKING:
    import torch

    from tierstore import AsyncTieredStore, TieredStore

__all__ = ["FaultyEngine", "backdoor_files", "install_faults", "short_io"]


class _Fault:
    def __init__(self, err: int | BaseException, times: int | None) -> None:
        self.err = err
        self.times = times

    def take(self) -> BaseException | None:
        if self.times is not None:
            if self.times <= 0:
                return None
            self.times -= 1
        if isinstance(self.err, BaseException):
            return self.err
        return OSError(self.err, os.strerror(self.err))


class FaultyEngine(DiskEngine, register=False):
    """Wraps a real engine; injects errors, delays and gates on write and read.

    Write faults are raised before the inner write (so nothing is allocated, as the contract
    demands of a failed write); read faults before the inner read.
    """

    name = "faulty"
    """Shown as ``wrapped_by`` in :meth:`describe`; a wrapper is not a disk format of its own."""

    def __init__(self, inner: DiskEngine) -> None:
        super().__init__(inner.directories, inner.config)
        self.inner = inner
        self._lock = threading.Lock()
        self._write_fault: _Fault | None = None
        self._read_fault: _Fault | None = None
        self.write_delay = 0.0
        self.read_delay = 0.0
        self.write_gate: threading.Event | None = None
        self.before_write: Callable[[int], None] | None = None
        self.writes = self.reads = self.deletes = 0
        self.failed_writes = self.failed_reads = 0
        self.written: set[int] = set()

    # -- configuration ----------------------------------------------------------------------

    def fail_writes(
        self, err: int | BaseException = errno_mod.EIO, times: int | None = None
    ) -> None:
        """Fail the next ``times`` writes (every write when None) with ``err``."""
        with self._lock:
            self._write_fault = _Fault(err, times)

    def fail_reads(
        self, err: int | BaseException = errno_mod.EIO, times: int | None = None
    ) -> None:
        """Fail the next ``times`` reads (every read when None) with ``err``."""
        with self._lock:
            self._read_fault = _Fault(err, times)

    def heal(self) -> None:
        """Stop injecting faults."""
        with self._lock:
            self._write_fault = self._read_fault = None

    # -- the contract -----------------------------------------------------------------------

    def footprint(self, nbytes: int) -> int:
        return self.inner.footprint(nbytes)

    def reusable_bytes(self) -> int:
        return self.inner.reusable_bytes()

    def placeable_bytes(self) -> int:
        return self.inner.placeable_bytes()

    def read_window(self, key: int, nbytes: int) -> tuple[int, int]:
        return self.inner.read_window(key, nbytes)

    async def write(self, key: int, src: torch.Tensor, **kwargs: Any) -> None:
        if self.write_gate is not None:
            while not self.write_gate.is_set():
                await asyncio.sleep(0.002)
        if self.write_delay:
            await asyncio.sleep(self.write_delay)
        if self.before_write is not None:
            self.before_write(key)
        self._count_or_fail(write=True)
        await self.inner.write(key, src, **kwargs)
        with self._lock:
            self.written.add(key)

    async def read(self, key: int, out: torch.Tensor) -> None:
        if self.read_delay:
            await asyncio.sleep(self.read_delay)
        self._count_or_fail(write=False)
        await self.inner.read(key, out)

    def _count_or_fail(self, *, write: bool) -> None:
        """Count a write or read, and raise the fault injected for it, if any."""
        with self._lock:
            fault = self._write_fault if write else self._read_fault
            exc = fault.take() if fault else None
            if write:
                self.writes += 1
                self.failed_writes += exc is not None
            else:
                self.reads += 1
                self.failed_reads += exc is not None
        if exc is not None:
            raise exc

    async def delete(self, key: int) -> None:
        with self._lock:
            self.deletes += 1
            self.written.discard(key)
        await self.inner.delete(key)

    async def close(self) -> None:
        await self.inner.close()

    def forget_after_fork(self) -> None:
        """In a forked child: as the wrapped engine does."""
        self.inner.forget_after_fork()

    def describe(self) -> dict[str, object]:
        return {**self.inner.describe(), "wrapped_by": self.name}


_Wrapper = TypeVar("_Wrapper", bound=FaultyEngine)


@overload
def install_faults(store: TieredStore | AsyncTieredStore) -> FaultyEngine: ...
@overload
def install_faults(store: TieredStore | AsyncTieredStore, kind: type[_Wrapper]) -> _Wrapper: ...
def install_faults(
    store: TieredStore | AsyncTieredStore, kind: type[FaultyEngine] = FaultyEngine
) -> Any:
    """Wrap ``store``'s disk engine in a ``kind`` (a :class:`FaultyEngine` or a subclass of
    it) and return the wrapper.

    Raises:
        RuntimeError: the store has no disk tier, or already holds tensors on disk (install
            the wrapper before anything is spilled).
    """
    return internals(store).wrap_engine(kind)


def backdoor_files(store: TieredStore) -> list[Path]:
    """The data files the engine made in the store's spill directories (the lock excluded)."""
    files: list[Path] = []
    for d in store.spill_dirs:
        for p in sorted(Path(d).rglob("*")):
            if p.is_file() and not p.is_symlink() and p.name != ".lock":
                files.append(p)
    return files


@contextlib.contextmanager
def short_io(max_bytes: int = 4096) -> Iterator[dict[str, int]]:
    """Make every ``os.pwrite``/``os.preadv`` move at most ``max_bytes`` per call.

    The limit is a multiple of 4096, so the rest of the transfer stays page-aligned and an
    O_DIRECT engine can go on where the short call stopped. Yields call counters.
    """
    assert max_bytes % 4096 == 0
    real_pwrite, real_preadv = os.pwrite, os.preadv
    counts = {"short_writes": 0, "short_reads": 0}

    def pwrite(fd: int, data: Any, offset: int) -> int:
        view = memoryview(data).cast("B")
        if len(view) > max_bytes:
            counts["short_writes"] += 1
            view = view[:max_bytes]
        return real_pwrite(fd, view, offset)

    def preadv(fd: int, buffers: Any, offset: int, *args: Any) -> int:
        # The limit is on the call's total: a scattered read of several small pieces is cut
        # short as well as one large piece.
        bufs, room = [], max_bytes
        for b in buffers:
            view = memoryview(b).cast("B")
            if len(view) > room:
                counts["short_reads"] += 1
                if room:
                    bufs.append(view[:room])
                break
            bufs.append(view)
            room -= len(view)
        return real_preadv(fd, bufs, offset, *args)

    os.pwrite, os.preadv = pwrite, preadv
    try:
        yield counts
    finally:
        os.pwrite, os.preadv = real_pwrite, real_preadv
