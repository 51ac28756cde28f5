"""The paths the benchmark compares: each writes a list of tensors to disk and reads them back.

Every path writes its data to the disk (O_DIRECT, or each file written back with
``sync_file_range`` within the write's time: :func:`write_back`), and every
read produces fresh tensors from the disk, newest first (LIFO, as backward consumes them).
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import itertools
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tierstore.bench._system import PageCache, cached_bytes
from tierstore.tiers.raw._syscalls import write_out

if TYPE_CHECKING:
    from tierstore import StoreStats, TieredStore

__all__ = ["PATHS", "Timing", "settle"]

_IN_FLIGHT = 16
"""Requests in flight for the asynchronous file paths (aiofiles, the engine)."""


@dataclass(slots=True)
class Timing:
    """Seconds one path took to write and to read back a list of tensors."""

    write_s: float
    read_s: float
    cached_delta_bytes: int | None = None
    """Growth of the page cache (``Cached``) while spilling, where the path measures it."""
    write_cpu_s: float = 0.0
    """CPU seconds of the whole process (every thread) while writing, less what a store
    path's wait for the disk spent (Note: [The wait is not the store's CPU])."""
    read_cpu_s: float = 0.0
    """CPU seconds of the whole process while reading back."""
    stats: str = ""
    """The store's ``stats().summary()``, for store paths."""
    steady: Timing | None = None
    """The same tensors once more through the same store, after the first round was released:
    a training step after the first, whose spills land in extents that were written before
    (Note: [First spill and steady state])."""
    extra: dict[str, object] = field(default_factory=dict)


class Clock:
    """Wall time and the process's CPU time (all threads), read together."""

    __slots__ = ("cpu", "wall")

    def __init__(self) -> None:
        self.wall = time.perf_counter()
        self.cpu = time.process_time()


def _timing(w0: Clock, w1: Clock, r0: Clock, r1: Clock, cached: int | None = None) -> Timing:
    return Timing(w1.wall - w0.wall, r1.wall - r0.wall, cached, w1.cpu - w0.cpu, r1.cpu - r0.cpu)


@dataclass(frozen=True, slots=True)
class Context:
    """Where and how a path runs."""

    directory: Path
    second_directory: Path
    cache: PageCache


def _check(tensors: list[torch.Tensor], back: list[torch.Tensor], what: str) -> None:
    # ``back`` is newest first.
    for i, (t, b) in enumerate(zip(tensors, reversed(back), strict=True)):
        if not torch.equal(t, b):
            raise AssertionError(f"{what}: tensor {i} came back different")


def _poll(store: TieredStore, until: Callable[[StoreStats], bool]) -> None:
    # The store has no "wait until the disk is done" call; poll its stats snapshot. The
    # interval (1 ms) is far below one measurement (>= tens of milliseconds) and leaves the
    # store's loop thread the CPU (two cores here).
    while not until(store.stats()):
        time.sleep(0.001)


def settle(store: TieredStore, total: int) -> float:
    """Wait until ``total`` bytes are on disk and nothing is moving; return the CPU seconds the
    wait itself took on this thread.

    Note: [The wait is not the store's CPU]
        The poll wakes a thousand times a second and asks for a stats snapshot each time:
        about 30 µs of CPU a millisecond on the development VM, 0.01 CPU-s/GB at 4 GB/s, a
        tenth of what a big tensor's spill costs. A training loop does not wait so, so the
        write's CPU is the process's less this thread's during the wait. The waits of the
        other threads the poll wakes (the GIL handed over) are not taken out.
    """
    before = time.thread_time()
    _poll(store, lambda st: st.inflight_bytes == 0 and st.disk.bytes >= total)
    return time.thread_time() - before


def _drained(store: TieredStore) -> None:
    """Wait until the disk tier holds nothing and nothing is moving."""
    _poll(store, lambda st: st.inflight_bytes == 0 and st.disk.bytes == 0)


PathFn = Callable[["Context", list[torch.Tensor]], "Timing"]

_PAGE = 4096


_ROUNDS = itertools.count(1)
"""Round numbers for :func:`stamp`: never the same twice in a process."""


def stamp(tensors: list[torch.Tensor], round_: int | None = None) -> None:
    """Write ``(round, tensor index, page index)`` into the first 24 bytes of each 4 KiB
    page of each byte tensor, the last partial page included (what fits of it in a tensor
    under 24 bytes). ``round_`` defaults to a number no round of this process had.

    Note: [Every page differs]
        The benchmark's tensors are one random block each, copied: were their pages alike, a
        chunk read from another tensor's place on disk, or a steady-round write that never
        happened (its extent still holding the first round's bytes), would compare equal and
        pass the check. Every round of a store path restamps every page with a new round
        first (the same tensors go through every path and repeat).
    """
    round_ = next(_ROUNDS) if round_ is None else round_
    for i, t in enumerate(tensors):
        n = t.numel()
        full, tail = divmod(n, _PAGE)
        pages = full + (1 if tail else 0)
        marks = torch.empty((max(1, pages), 3), dtype=torch.int64)
        marks[:, 0] = round_
        marks[:, 1] = i
        marks[:, 2] = torch.arange(max(1, pages))
        raw = marks.view(torch.uint8)
        if full:
            t[: full * _PAGE].view(full, _PAGE)[:, :24] = raw[:full]
        if tail or not full:
            k = min(n - full * _PAGE, 24)
            t[full * _PAGE : full * _PAGE + k] = raw[pages - 1 if pages else 0, :k]


def _store_round(
    store: TieredStore, tensors: list[torch.Tensor], what: str, buffered: PageCache | None = None
) -> Timing:
    """Put every tensor, wait until all are on disk, get them back newest first, release.

    ``buffered``: the engine writes through the page cache (zarr). The files in the store's
    spill directories are then written back (:func:`write_back`), from as many threads as
    the store's I/O, within the write's time, and evicted before the reads, as the file
    paths' are: otherwise its figures would be the page cache's.
    """
    total = sum(t.numel() * t.element_size() for t in tensors)
    before = cached_bytes()
    t0 = Clock()
    handles = [store.put(t) for t in tensors]
    waited_cpu = settle(store, total)  # Note: [The wait is not the store's CPU]
    files = [] if buffered is None else _files_under(list(store.spill_dirs))
    if files:
        with cf.ThreadPoolExecutor(store.config.io_threads) as pool:
            files = [f for f, kept in zip(files, pool.map(_write_back, files), strict=True) if kept]
    t1 = Clock()
    delta = cached_bytes() - before
    if buffered is not None:
        buffered.evict(files)
    back = []
    t2 = Clock()
    for h in reversed(handles):
        back.append(store.get(h))
    t3 = Clock()
    for h in handles:
        store.release(h)
    _check(tensors, back, what)
    timing = _timing(t0, t1, t2, t3, delta)
    timing.write_cpu_s -= waited_cpu
    return timing


def _store_path(disk_format: str, two_dirs: bool, steady: bool) -> PathFn:
    """A store with no host tier; with ``steady``, a second round measures steady state.

    Note: [First spill and steady state]
        The first spill lands in a freshly grown spill file, whose extents ext4 (like XFS)
        keeps as *unwritten* until a write converts them, and converting costs journal work:
        fio writes a fresh file markedly slower than it overwrites the same file
        (docs/disk-engine.md, "First spill and steady state"). A training run spills into fresh
        space only in its first step; every later step reuses the extents the previous one
        freed. The benchmark therefore measures both, each against the matching raw limit: the
        first round against fio writing a new file, the second against fio overwriting it.
    """

    def run(ctx: Context, tensors: list[torch.Tensor]) -> Timing:
        from tierstore import TieredStore

        dirs = [ctx.directory, ctx.second_directory] if two_dirs else [ctx.directory]
        what = f"tierstore {disk_format}"
        # host_bytes=0: every tensor spills, so the figure is the disk tier's own.
        with TieredStore(
            host_bytes=0,
            device_bytes=0,
            min_bytes=0,
            disk_dir=[str(d) for d in dirs],
            disk_format=disk_format,
            timeout=None,
        ) as store:
            # The raw engine writes with O_DIRECT, or flushes and drops what it wrote itself.
            buffered = None if disk_format == "raw" else ctx.cache
            stamp(tensors)  # Note: [Every page differs]
            first = _store_round(store, tensors, what, buffered)
            if steady:
                _drained(store)
                stamp(tensors)
                first.steady = _store_round(store, tensors, what + " (steady)", buffered)
            first.stats = store.stats().summary()
        return first

    return run


def _engine_path(ctx: Context, tensors: list[torch.Tensor]) -> Timing:
    """The raw engine alone, without the store: what the store's overhead is measured against."""
    from tierstore.config import StoreConfig
    from tierstore.tiers.raw import RawEngine

    async def run(directory: Path) -> Timing:
        engine = RawEngine((directory,), StoreConfig.from_env())
        sem = asyncio.Semaphore(_IN_FLIGHT)
        views = [t.view(-1).view(torch.uint8) for t in tensors]

        async def write(k: int) -> None:
            async with sem:
                await engine.write(k, views[k])

        async def read(k: int) -> torch.Tensor:
            async with sem:
                out = torch.empty_like(views[k])
                await engine.read(k, out)
                return out

        try:
            t0 = Clock()
            await asyncio.gather(*(write(k) for k in range(len(views))))
            t1 = Clock()
            back = await asyncio.gather(*(read(k) for k in reversed(range(len(views)))))
            t2 = Clock()
        finally:
            await engine.close()
        _check([v for v in views], list(back), "raw engine")
        return _timing(t0, t1, t1, t2)

    work = Path(tempfile.mkdtemp(prefix="tierstore-bench-", dir=ctx.directory))
    try:
        return asyncio.run(run(work))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _files_under(directories: list[Path]) -> list[Path]:
    return [
        Path(root) / name for d in directories for root, _, names in os.walk(d) for name in names
    ]


def write_back(fd: int) -> None:
    """Write a file's dirty pages to the disk and wait, data only, as the store's buffered
    engine does (``sync_file_range``: no journal commit, no flush of the disk's cache, which
    the store's O_DIRECT writes do not pay either). The pages stay cached, clean, for the
    page-cache figure and the eviction before the reads."""
    write_out(fd, 0, 0)  # 0 bytes: to the end of the file


def _write_back(path: Path) -> bool:
    """:func:`write_back` ``path``; False if it is gone (a store deletes what it released)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        write_back(fd)
    finally:
        os.close(fd)
    return True


def _files(ctx: Context, n: int, suffix: str) -> tuple[Path, list[Path]]:
    work = Path(tempfile.mkdtemp(prefix="tierstore-bench-", dir=ctx.directory))
    return work, [work / f"{i:06d}{suffix}" for i in range(n)]


_SAVE_THREADS = 4
"""Threads of the ``torch.save`` path: as many as axolotl's disk offloader saves with."""


def _torch_save_path(ctx: Context, tensors: list[torch.Tensor]) -> Timing:
    """One ``torch.save`` file per tensor, as axolotl's disk offloader does, from as many
    threads (:data:`_SAVE_THREADS`); each written back. Loaded back newest first from as many."""
    work, paths = _files(ctx, len(tensors), ".pt")

    def save(t: torch.Tensor, p: Path) -> None:
        torch.save(t, p)
        _write_back(p)

    try:
        with cf.ThreadPoolExecutor(_SAVE_THREADS) as pool:
            t0 = Clock()
            list(pool.map(save, tensors, paths))
            t1 = Clock()
            ctx.cache.evict(paths)
            t2 = Clock()
            back = list(pool.map(lambda p: torch.load(p, weights_only=True), reversed(paths)))
            t3 = Clock()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _check(tensors, back, "torch.save")
    return _timing(t0, t1, t2, t3)


def _os_path(ctx: Context, tensors: list[torch.Tensor]) -> Timing:
    """Plain ``os.write``/``os.readv`` of whole files, one after another; each written back."""
    work, paths = _files(ctx, len(tensors), ".bin")
    try:
        before = cached_bytes()
        t0 = Clock()
        for t, p in zip(tensors, paths, strict=True):
            view = t.view(-1).view(torch.uint8).numpy().data
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                done = 0
                while done < len(view):
                    done += os.write(fd, view[done:])
                write_back(fd)
            finally:
                os.close(fd)
        t1 = Clock()
        # For contrast with the spill paths: what buffered writes leave in the page cache.
        delta = cached_bytes() - before
        ctx.cache.evict(paths)
        back = []
        t2 = Clock()
        for t, p in zip(reversed(tensors), reversed(paths), strict=True):
            out = torch.empty_like(t)
            view = out.view(-1).view(torch.uint8).numpy().data
            fd = os.open(p, os.O_RDONLY)
            try:
                done = 0
                while done < len(view):
                    n = os.readv(fd, [view[done:]])
                    if n == 0:
                        raise EOFError(p)
                    done += n
            finally:
                os.close(fd)
            back.append(out)
        t3 = Clock()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _check(tensors, back, "os")
    return _timing(t0, t1, t2, t3, delta)


def _aiofiles_path(ctx: Context, tensors: list[torch.Tensor]) -> Timing:
    """aiofiles whole-file writes and ``readinto`` reads, 16 files in flight; each written back."""
    import aiofiles

    work, paths = _files(ctx, len(tensors), ".bin")

    async def write_all() -> None:
        sem = asyncio.Semaphore(_IN_FLIGHT)

        async def one(t: torch.Tensor, p: Path) -> None:
            async with sem, aiofiles.open(p, "wb") as f:
                await f.write(t.view(-1).view(torch.uint8).numpy().data)
                await f.flush()
                await asyncio.to_thread(write_back, f.fileno())

        await asyncio.gather(*(one(t, p) for t, p in zip(tensors, paths, strict=True)))

    async def read_all() -> list[torch.Tensor]:
        sem = asyncio.Semaphore(_IN_FLIGHT)

        async def one(t: torch.Tensor, p: Path) -> torch.Tensor:
            out = torch.empty_like(t)
            view = out.view(-1).view(torch.uint8).numpy().data
            async with sem, aiofiles.open(p, "rb", buffering=0) as f:
                done = 0
                while done < len(view):
                    n = await f.readinto(view[done:])
                    if not n:
                        raise EOFError(p)
                    done += n
            return out

        pairs = zip(reversed(tensors), reversed(paths), strict=True)
        return list(await asyncio.gather(*(one(t, p) for t, p in pairs)))

    try:
        t0 = Clock()
        asyncio.run(write_all())
        t1 = Clock()
        ctx.cache.evict(paths)
        t2 = Clock()
        back = asyncio.run(read_all())
        t3 = Clock()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _check(tensors, back, "aiofiles")
    return _timing(t0, t1, t2, t3)


PATHS: dict[str, PathFn] = {
    "tierstore-raw": _store_path("raw", two_dirs=False, steady=True),
    "tierstore-raw-2dirs": _store_path("raw", two_dirs=True, steady=True),
    "tierstore-zarr": _store_path("zarr", two_dirs=False, steady=False),
    "raw-engine": _engine_path,
    "torch.save": _torch_save_path,
    "aiofiles": _aiofiles_path,
    "os": _os_path,
}
"""Every path by the name the results use (``raw-limit`` is measured separately)."""
