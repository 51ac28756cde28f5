"""The store's engine room: entries, placement, the save semaphore and the I/O tasks.

Both public classes drive one :class:`StoreCore`. ``AsyncTieredStore`` binds it to the running
event loop; ``TieredStore`` binds it to a loop it owns on a background thread.

Note: [Threading model]
    Entry state lives in this object and changes only under ``self._lock``, a plain
    ``threading.Lock`` held for microseconds and never across an ``await``. Every disk read or
    write, and every CUDA copy, runs as a task on the store's event loop; the tasks take the
    lock only to record what they did. That lets ``put`` into a tier with room, and ``get`` of
    a tensor that is already back, finish in the caller's own thread without a hop to the loop
    (a hop costs 50-110 us on the development machine), while anything that must wait waits on
    a ``concurrent.futures.Future`` that any thread or coroutine can block on.

Note: [Batched hand-offs]
    Each hop to the loop thread, each task and each engine call costs tens of microseconds of
    Python on two cores, as much as writing a 64 KiB tensor. So work for the loop is queued
    (``_spawn``) and handed over with one wake-up however many puts and gets queued it, and the
    loop turns the disk writes and reads of small entries queued meanwhile into one task and
    one ``write_many``/``read_many`` call per batch, which the raw engine packs into few large
    requests (Note: [Small blobs travel in packs] in ``tiers/_raw.py``). Releases queued
    meanwhile free their spill space in one ``delete_many``, started before the spills so
    these can reuse it. Fewer tasks also mean fewer objects for the garbage collector, whose
    full collections walk every object torch and the store keep alive.

Note: [Release from a finalizer]
    Handles are released by ``weakref.finalize`` when they are garbage-collected, which can
    happen in any thread, even one that holds ``self._lock`` at that moment. The finalizer
    therefore only appends the key to a deque (atomic) and asks the loop to drain it; every
    public operation drains it first too, so a caller never sees a released entry counted.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import concurrent.futures as cf
import contextlib
import errno
import heapq
import itertools
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Coroutine, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from tierstore._handle import TensorHandle
from tierstore._malloc import trim_soon
from tierstore._spilldir import SpillDirectory, check_parent, sweep_stale
from tierstore._state import TERMINAL, TRANSIT, TensorState, Tier, transition
from tierstore._stats import StoreStats, TierStats
from tierstore.errors import (
    CorruptTensorError,
    SpillIOError,
    StoreClosedError,
    TensorModifiedError,
    TensorReleasedError,
    TierFullError,
    TierStoreError,
    UnsupportedTensorError,
)
from tierstore.tiers import WriteRequest, _accelerator, open_engine
from tierstore.tiers._device import (
    as_bytes,
    compact,
    copy_to_device,
    copy_to_host,
    current_stream,
    discard,
    from_bytes,
    hand_over,
    ready_event,
    upload,
)
from tierstore.tiers._hostpool import HostPool
from tierstore.tiers._pinned import PinnedPool

if TYPE_CHECKING:
    from tierstore.config import StoreConfig
    from tierstore.tiers import DiskEngine

__all__ = ["StoreCore"]

log = logging.getLogger("tierstore")

_T = TypeVar("_T")
S = TensorState
_WINDOW = frozenset({S.FETCHING, S.FETCHED})
# How long a failed disk stays unavailable before the store checks for space again.
_DISK_RETRY_SECONDS = 1.0
# Reads smaller than this use plain allocations: glibc reuses small blocks cheaply, and a pool
# of thousands of small maps would cost more to search than it saves.
_POOLED_READ_BYTES = 1 << 20
# A prefetch scan looks at most this many older entries, so one get never walks a huge table.
_PREFETCH_SCAN_LIMIT = 4096
# One scan starts at most this many fetches (Note: [Resumable prefetch walk]).
_PREFETCH_STEP = 256


# Disk I/O of entries up to this size is handed to the engine in batches of up to
# _BATCH_MAX_BYTES (Note: [Batched hand-offs]).
_BATCH_BYTES = 1 << 20
_BATCH_MAX_BYTES = 8 << 20
# The filesystem's free space is read at most this often; spills planned in between are
# subtracted from the last reading, and a spill that seems not to fit reads it again.
_FREE_SPACE_TTL_SECONDS = 0.05


_store_tokens = itertools.count(1)
# Dropped handles are released in batches: waking the loop thread for each one costs a GIL
# hand-off (tens of microseconds on two cores). Every store call drains the batch first anyway.
_DRAIN_DELAY_SECONDS = 0.005


class _HandleRef(weakref.ref[TensorHandle]):
    """The store's weak reference to a handle; its callback releases the entry."""

    __slots__ = ("key",)
    key: int


class _Entry:
    """One stored tensor. Fields other than ``state`` are its copies; which exist says where."""

    __slots__ = (
        "data",
        "device",
        "disk",
        "dtype",
        "error",
        "fetch_future",
        "fetched",
        "handle_ref",
        "host",
        "key",
        "movable",
        "nbytes",
        "prefetched",
        "ready",
        "shape",
        "state",
        "stream",
        "version",
    )

    def __init__(self, key: int, t: torch.Tensor, movable: bool) -> None:
        self.key = key
        # A plain tuple, not the tensor's torch.Size: the garbage collector stops tracking a
        # tuple of ints, never a tuple subclass (see the four-objects test in test_batching).
        self.shape = tuple(t.shape)
        self.dtype = t.dtype
        self.device = t.device
        self.nbytes = t.numel() * t.element_size()
        self.movable = movable
        self.state = S.DEVICE
        self.version = version_of(t)
        """The version counter of the tensor the store holds, when that is the caller's
        (Note: [Writes after put])."""
        self.data: torch.Tensor | None = None
        """The tensor on its own device."""
        self.host: torch.Tensor | None = None
        """The host-tier copy (on the CPU, the tensor itself)."""
        self.disk = 0
        """Bytes this entry's spill file occupies (reserved from the start of the write)."""
        self.fetched: torch.Tensor | None = None
        """A copy brought back to the device ahead of get."""
        self.fetch_future: cf.Future[torch.Tensor] | None = None
        """What a get waiting for the fetch in flight waits on; made by the first such get."""
        self.prefetched = False
        """The fetch in flight was begun by prefetch, not by a get."""
        self.ready: Any = None
        self.stream: Any = None
        """The stream current when the tensor was put: where autograd runs the backward that
        will get it, so a fetch allocates its copy there (Note: [Copy ordering on an
        accelerator] in ``tiers/_device.py``). None on the CPU."""
        self.error: BaseException | None = None
        self.handle_ref: _HandleRef | None = None

    def describe(self) -> str:
        shape = "x".join(str(s) for s in self.shape) or "scalar"
        dtype = str(self.dtype).removeprefix("torch.")
        return f"tensor #{self.key} ({shape} {dtype} from {self.device}, {self.nbytes} bytes)"

    def home(self) -> TensorState:
        """The resting state a fetched or fetching entry returns to."""
        return S.DISK if self.disk else S.HOST


class _Counters:
    """Cumulative counters; mutated under the core lock only."""

    def __init__(self) -> None:
        self.puts = self.gets = self.releases = self.bytes_put = 0
        self.bytes_to_host = self.bytes_to_disk = self.bytes_from_disk = self.bytes_to_device = 0
        self.seconds_to_host = self.seconds_to_disk = 0.0
        self.seconds_from_disk = self.seconds_to_device = 0.0
        self.get_wait_seconds = self.put_wait_seconds = 0.0
        self.prefetch_hits = self.prefetch_misses = self.kept_no_room = 0
        self.write_errors = self.read_errors = 0
        self.skipped: collections.Counter[str] = collections.Counter()
        self.skipped_bytes: collections.Counter[str] = collections.Counter()
        self.total_entries = dict.fromkeys(Tier, 0)
        self.total_bytes = dict.fromkeys(Tier, 0)


class StoreCore:
    """Thread-safe state of one store, bound to the event loop that runs its I/O.

    Args:
        config: the resolved configuration.
        loop: the event loop that runs this store's I/O tasks.
        loop_thread: the ident of the thread running ``loop``.

    Raises:
        ConfigError: a spill directory parent is missing, not a directory, or not writable.
    """

    def __init__(
        self, config: StoreConfig, loop: asyncio.AbstractEventLoop, loop_thread: int
    ) -> None:
        self.config = config
        self.loop = loop
        self.loop_thread = loop_thread
        self._lock = threading.Lock()
        self._keys = itertools.count(1)
        self._entries: dict[int, _Entry] = {}
        self._live_keys: list[int] = []
        self._used = dict.fromkeys(Tier, 0)
        self._count = dict.fromkeys(Tier, 0)
        # Bytes resting where the cascade may move them from: movable DEVICE and HOST entries.
        self._resting = {Tier.DEVICE: 0, Tier.HOST: 0}
        self._heaps: dict[Tier, list[int]] = {Tier.DEVICE: [], Tier.HOST: []}
        self._window = 0
        self._inflight = 0
        # Host bytes of device-to-host copies in flight: taken from the host tier's room as
        # soon as a copy starts, not when it lands.
        self._host_reserved = 0
        self._cursor: int | None = None
        # Where the last prefetch walk stopped, for the cursor it walked from: entries between
        # are already fetched, so the next walk resumes there (Note: [Resumable prefetch walk]).
        self._walk_cursor: int | None = None
        self._walk_next: int | None = None
        self.walk_steps = 0
        """Entries looked at by prefetch walks (tests check a sweep stays linear)."""
        self._semaphore_full = False
        self._put_waiters: list[cf.Future[None]] = []
        self._tasks: set[asyncio.Task[None]] = set()
        # Work queued for the loop thread (Note: [Batched hand-offs]): spills, fetches and
        # deletes each in a queue of their own, so queuing one makes no object; anything else
        # as a (coroutine function, arguments) pair.
        self._spawns: collections.deque[tuple[Callable[..., Coroutine[Any, Any, None]], Any]]
        self._spawns = collections.deque()
        self._spill_queue: collections.deque[_Entry] = collections.deque()
        self._fetch_queue: collections.deque[_Entry] = collections.deque()
        self._delete_queue: collections.deque[tuple[int, int]] = collections.deque()
        self._spawn_soon = False
        # The last reading of the filesystems' free space, and spills planned since.
        self._fs_free = 0
        self._fs_read_at: float | None = None
        self._fs_planned = 0
        self._dropped: collections.deque[int] = collections.deque()
        # One bound method for every handle's weakref, rather than a new one kept per handle.
        self._handle_dead = self._on_handle_dead
        self._drain_scheduled = False
        self.token = next(_store_tokens)
        self._stats = _Counters()
        self._closed = False
        self._warned_no_room = False
        self._warned_copy = False
        self._disk_failed_at: float | None = None
        # After ENOSPC (or a spill that found too little free space): the bytes that must be
        # free again before the disk tier is used (Note: [Disk full until space returns]).
        self._disk_need = 0
        # The last write error other than ENOSPC/EDQUOT while the disk tier pauses after it.
        self._disk_error: str | None = None
        # Spill bytes of released entries whose delete has not run yet: free for planning.
        self._deleting = 0
        # Released entries whose I/O is still finishing: their bytes still count.
        self._in_transit_released: set[_Entry] = set()

        self._spill_dirs: list[SpillDirectory] = []
        self._engine: DiskEngine | None = None
        self._disk_cap = 0
        # Read buffers are reused once their tensors die (Note: [Buffers come back when the
        # last tensor goes]); keep about a prefetch window of them.
        self._read_pool = HostPool(keep_bytes=max(config.prefetch_bytes, 64 << 20))
        # The host tier of accelerator tensors, pinned at its first use (Note: [The pinned
        # pool] in ``tiers/_pinned.py``); a CPU-only process never allocates it.
        self._pinned = PinnedPool(config.host_bytes)
        self._open_disk()

    # ------------------------------------------------------------------ disk tier set-up

    def _open_disk(self) -> None:
        cfg = self.config
        for parent in cfg.disk_dirs:
            check_parent(parent)
            sweep_stale(parent)
        if cfg.disk_bytes == 0:
            return
        free = _free_bytes(cfg.disk_dirs)
        cap = free if cfg.disk_bytes is None else min(cfg.disk_bytes, free)
        if cfg.disk_bytes is not None and cfg.disk_bytes > free:
            log.warning(
                "tierstore: TIERSTORE_DISK_BYTES=%d is more than the %d bytes free under %s; "
                "the disk tier is capped at the free space",
                cfg.disk_bytes,
                free,
                os.pathsep.join(map(str, cfg.disk_dirs)),
            )
        try:
            for p in cfg.disk_dirs:  # one by one: a failure removes those made before it
                self._spill_dirs.append(SpillDirectory(p))
            self._engine = open_engine(tuple(d.path for d in self._spill_dirs), cfg)
        except BaseException:
            for d in self._spill_dirs:
                d.remove()
            self._spill_dirs = []
            raise
        self._disk_cap = cap

    @property
    def spill_dirs(self) -> tuple[os.PathLike[str], ...]:
        """The private spill directories of this store (empty without a disk tier)."""
        return tuple(d.path for d in self._spill_dirs)

    @property
    def engine(self) -> DiskEngine | None:
        """The disk engine, or None when the disk tier is off."""
        return self._engine

    def wrap_engine(self, wrap: Callable[[DiskEngine], DiskEngine]) -> None:
        """Replace the disk engine by ``wrap(engine)``; tests inject faults and delays this way.

        Raises:
            RuntimeError: the store has no disk tier, or already holds tensors on disk.
        """
        with self._lock:
            if self._engine is None or self._used[Tier.DISK]:
                raise RuntimeError("wrap the engine before anything is spilled")
            self._engine = wrap(self._engine)

    # ------------------------------------------------------------------ bookkeeping

    def _set_state(self, e: _Entry, new: TensorState) -> None:
        """The one place an entry's state changes (Note: [One state, one table])."""
        old = e.state
        transition(e, new)
        if old is S.DEVICE and e.movable:
            self._resting[Tier.DEVICE] -= e.nbytes
        elif old is S.HOST:
            self._resting[Tier.HOST] -= e.nbytes
        if new is S.DEVICE and e.movable:
            self._resting[Tier.DEVICE] += e.nbytes
            heapq.heappush(self._heaps[Tier.DEVICE], e.key)
        elif new is S.HOST:
            self._resting[Tier.HOST] += e.nbytes
            heapq.heappush(self._heaps[Tier.HOST], e.key)
        if (old in _WINDOW) != (new in _WINDOW):
            self._window += e.nbytes if new in _WINDOW else -e.nbytes

    def _occupy(self, tier: Tier, nbytes: int) -> None:
        self._used[tier] += nbytes
        self._count[tier] += 1
        self._stats.total_entries[tier] += 1
        self._stats.total_bytes[tier] += nbytes

    def _vacate(self, tier: Tier, nbytes: int) -> None:
        self._used[tier] -= nbytes
        self._count[tier] -= 1

    def _set_data(self, e: _Entry, t: torch.Tensor | None) -> None:
        if e.data is not None:
            self._vacate(Tier.DEVICE, e.nbytes)
        if t is not None:
            self._occupy(Tier.DEVICE, e.nbytes)
        e.data = t

    def _set_host(self, e: _Entry, t: torch.Tensor | None) -> None:
        if e.host is not None:
            self._vacate(Tier.HOST, e.nbytes)
        if t is not None:
            self._occupy(Tier.HOST, e.nbytes)
        e.host = t

    def _set_fetched(self, e: _Entry, t: torch.Tensor | None) -> None:
        if e.fetched is not None:
            self._vacate(Tier.DEVICE, e.nbytes)
        if t is not None:
            self._occupy(Tier.DEVICE, e.nbytes)
        e.fetched = t

    def _set_disk(self, e: _Entry, footprint: int) -> None:
        if e.disk:
            self._vacate(Tier.DISK, e.disk)
        if footprint:
            self._occupy(Tier.DISK, footprint)
        e.disk = footprint

    def audit(self) -> dict[str, int]:
        """Recompute every counter from the live entries and compare (used by the tests).

        Returns:
            The recomputed bytes per tier.

        Raises:
            AssertionError: a counter disagrees with the entries.
        """
        with self._lock:
            self._drain_dropped_locked()
            used = dict.fromkeys(Tier, 0)
            objs = set(self._entries.values()) | self._task_entries()
            for e in objs:
                if e.data is not None:
                    used[Tier.DEVICE] += e.nbytes
                if e.fetched is not None:
                    used[Tier.DEVICE] += e.nbytes
                if e.host is not None:
                    used[Tier.HOST] += e.nbytes
                used[Tier.DISK] += e.disk
            assert used == self._used, f"tier bytes {self._used} != entries {used}"
            resting_dev = sum(
                e.nbytes for e in self._entries.values() if e.state is S.DEVICE and e.movable
            )
            resting_host = sum(e.nbytes for e in self._entries.values() if e.state is S.HOST)
            assert self._resting == {Tier.DEVICE: resting_dev, Tier.HOST: resting_host}
            window = sum(e.nbytes for e in self._entries.values() if e.state in _WINDOW)
            assert window == self._window, (window, self._window)
            assert self._live_keys == sorted(self._entries), "live key list out of order"
            return {t.value: n for t, n in used.items()}

    def _task_entries(self) -> set[_Entry]:
        # Released entries whose I/O is still finishing hold bytes too.
        return self._in_transit_released

    # ------------------------------------------------------------------ scheduling helpers

    def _spawn(self, fn: Callable[..., Coroutine[Any, Any, None]], *args: Any) -> None:
        """Run ``fn(*args)`` as a task on the store's loop, from any thread (under the lock)."""
        self._spawns.append((fn, args))
        self._wake_loop()

    def _wake_loop(self) -> None:
        """Have the loop start the queued work soon (any thread, under the lock).

        One wake-up starts everything queued meanwhile (Note: [Batched hand-offs]). The flag
        is tested after the work was queued and cleared before the queues are read, so
        whichever side runs second sees the other's work.
        """
        if self._spawn_soon:
            return
        self._spawn_soon = True
        if threading.get_ident() == self.loop_thread:
            self.loop.call_soon(self._run_spawns)
        else:
            self.loop.call_soon_threadsafe(self._run_spawns)

    def _run_spawns(self) -> None:
        """Start the queued work (on the loop): small disk writes and reads go in batches."""
        self._spawn_soon = False
        for fn, args in _drain(self._spawns):
            self._start_task(fn, args)
        deletes = _drain(self._delete_queue)
        if deletes:
            # First: space freed now is space the spills below can reuse.
            self._start_task(self._delete_many, (deletes,))
        for batch in _batches(_drain(self._spill_queue)):
            self._start_task(self._spill_many, (batch,))
        fetches = _drain(self._fetch_queue)
        batched = []
        for e in fetches:
            # Alone: a host copy going back to its GPU (no disk read to share), and a fetch a
            # get already waits on, which a batch would make wait for all its reads.
            if e.disk and e.fetch_future is None:
                batched.append(e)
            else:
                self._start_task(self._fetch_many, ([e],))
        for batch in _batches(batched):
            self._start_task(self._fetch_many, (batch,))

    def _start_task(
        self, fn: Callable[..., Coroutine[Any, Any, None]], args: tuple[Any, ...]
    ) -> None:
        task = self.loop.create_task(fn(*args))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError("this tierstore store is closed; create a new TieredStore")

    def _on_handle_dead(self, ref: _HandleRef) -> None:
        """Weakref callback of a handle: queue its release (Note: [Release from a finalizer])."""
        self._dropped.append(ref.key)
        if not self._drain_scheduled:
            self._drain_scheduled = True
            with contextlib.suppress(RuntimeError):  # the loop is closed: close() drained
                self.loop.call_soon_threadsafe(
                    self.loop.call_later, _DRAIN_DELAY_SECONDS, self._drain_dropped
                )

    def _drain_dropped(self) -> None:
        # Clear the flag before draining, so a handle dropped meanwhile schedules another.
        self._drain_scheduled = False
        with self._lock:
            self._drain_dropped_locked()

    def _drain_dropped_locked(self) -> None:
        while self._dropped:
            key = self._dropped.popleft()
            e = self._entries.get(key)
            if e is not None:
                self._release_locked(e)

    # ------------------------------------------------------------------ put

    def put_now(self, t: torch.Tensor) -> tuple[TensorHandle, cf.Future[None] | None]:
        """Store ``t``; return its handle and, under backpressure, a future to wait on.

        Raises:
            UnsupportedTensorError: ``t`` is not a plain strided CPU or CUDA tensor.
            TierFullError: no tier has room for it.
            StoreClosedError: the store is closed.
        """
        _check_tensor(t)
        ready = ready_event(t)
        stream = current_stream(t.device)
        with self._lock:
            self._check_open()
            self._drain_dropped_locked()
            nbytes = t.numel() * t.element_size()
            movable = nbytes >= self.config.min_bytes and nbytes > 0
            if movable and nbytes > self._free_room():
                off, advice = self._disk_advice()
                raise TierFullError(
                    f"no tier has room for a {nbytes}-byte {str(t.dtype).removeprefix('torch.')} "
                    f"tensor: device {self._used[Tier.DEVICE]}/{self.config.device_bytes}, "
                    f"host {self._used[Tier.HOST]}/{self.config.host_bytes}, "
                    f"disk {self._used[Tier.DISK]}/{self._disk_cap} bytes used{off}; {advice}"
                )
            key = next(self._keys)
            e = _Entry(key, t, movable)
            e.ready = ready
            e.stream = stream
            self._set_data(e, t.detach())
            if movable:
                self._resting[Tier.DEVICE] += nbytes
                heapq.heappush(self._heaps[Tier.DEVICE], key)
            self._entries[key] = e
            self._live_keys.append(key)
            self._stats.puts += 1
            self._stats.bytes_put += nbytes
            handle = TensorHandle(key, e.shape, e.dtype, e.device, nbytes, self.token)
            ref = _HandleRef(handle, self._handle_dead)
            ref.key = key
            e.handle_ref = ref
            try:
                self._plan_down(new=e)
            except TierFullError:
                self._unput_locked(e, handle)
                self._plan_down()
                del t  # Note: [A failed host copy keeps nothing]
                raise
            waiter: cf.Future[None] | None = None
            if self._semaphore_full:
                waiter = cf.Future()
                self._put_waiters.append(waiter)
            return handle, waiter

    def _disk_advice(self) -> tuple[str, str]:
        """Why the disk tier takes nothing now (or ``""``), and what to do about a full store.

        A disk that fails its writes is not fixed by a bigger ``TIERSTORE_DISK_BYTES``; the
        error says what failed instead.
        """
        if self._disk_usable():
            return "", "raise TIERSTORE_HOST_BYTES or TIERSTORE_DISK_BYTES, or release tensors"
        if self._engine is None:
            return "", "raise TIERSTORE_HOST_BYTES, or release tensors"
        if self._disk_error is not None:
            return (
                f" (disk tier unavailable: paused after a write error: {self._disk_error})",
                "fix what the write error names (see the warning logged with it), raise "
                "TIERSTORE_HOST_BYTES, or release tensors",
            )
        return (
            f" (disk tier unavailable: full until {self._disk_need} bytes are free under "
            f"{os.pathsep.join(map(str, self.config.disk_dirs))})",
            "free disk space, raise TIERSTORE_HOST_BYTES, or release tensors",
        )

    def _unput_locked(self, e: _Entry, handle: TensorHandle) -> None:
        """Undo the put of ``e`` that is raising: it leaves no entry, bytes or count behind."""
        del self._entries[e.key]
        self._live_keys.remove(e.key)
        self._set_state(e, S.RELEASED)
        self._set_data(e, None)
        st = self._stats
        st.puts -= 1
        st.bytes_put -= e.nbytes
        st.total_entries[Tier.DEVICE] -= 1
        st.total_bytes[Tier.DEVICE] -= e.nbytes
        handle._released = True
        # The weak reference dies with the entry, so the handle's death queues no release.
        e.handle_ref = None
        e.ready = None
        e.stream = None

    def _free_room(self) -> int:
        cfg = self.config
        dev = max(0, cfg.device_bytes - self._resting[Tier.DEVICE])
        host = max(0, cfg.host_bytes - self._used[Tier.HOST] - self._host_reserved)
        disk = max(0, self._disk_cap - self._used[Tier.DISK]) if self._disk_usable() else 0
        return min(dev + host + disk, (1 << 63) - 1)

    def _disk_usable(self) -> bool:
        """Whether the cascade may write to disk now (Note: [Disk full until space returns]).

        Note: [Disk full until space returns]
            A write error pauses the disk tier for ``_DISK_RETRY_SECONDS``, so a failing disk
            is not hammered. After ENOSPC/EDQUOT, or when the free-space check before a spill
            finds too little room, the tier also stays off until the filesystem really has
            that room again (free space, plus the engine's reusable extents, plus deletes
            still pending). While it is off, :meth:`_free_room` counts no disk room, so
            ``put`` raises ``TierFullError`` instead of growing the host tier without bound.
        """
        if self._engine is None:
            return False
        if self._disk_failed_at is None and not self._disk_need:
            return True
        failed_at = self._disk_failed_at
        if failed_at is not None and time.monotonic() - failed_at < _DISK_RETRY_SECONDS:
            return False
        if self._disk_need and self._disk_free() < self._disk_need:
            return False
        self._disk_failed_at = None
        self._disk_need = 0
        self._disk_error = None
        if failed_at is not None:
            log.info("tierstore: retrying the disk tier after an earlier failure")
        return True

    # ------------------------------------------------------------------ the cascade

    def _pop_oldest(self, tier: Tier, state: TensorState) -> _Entry | None:
        heap = self._heaps[tier]
        while heap:
            e = self._entries.get(heap[0])
            if e is not None and e.state is state:
                return e
            heapq.heappop(heap)
        return None

    def _plan_down(self, new: _Entry | None = None) -> None:
        """Move the oldest entries of over-full tiers down (Note: [The cascade] in docs).

        Args:
            new: the entry ``put`` is adding now, if any.

        Raises:
            TierFullError: the compact host copy of ``new`` could not be allocated (Note:
                [A failed host copy keeps nothing]); the caller undoes its put.
        """
        if self._closed:
            return  # close() is draining the transfers in flight; start no new ones
        cfg = self.config
        limit = cfg.max_inflight_bytes
        blocked = False
        while self._resting[Tier.DEVICE] > cfg.device_bytes:
            e = self._pop_oldest(Tier.DEVICE, S.DEVICE)
            if e is None:
                break
            if e.device.type == "cpu":
                # On the CPU the host tier holds the tensor itself: no copy, no I/O.
                heapq.heappop(self._heaps[Tier.DEVICE])
                assert e.data is not None
                if self._check_unchanged(e, e.data):
                    try:
                        host = compact(e.data)
                    except (RuntimeError, MemoryError) as exc:
                        self._host_copy_failed(e, exc, new)
                        break
                    if host is not e.data:
                        e.version = version_of(host)  # a copy of the store's own
                    self._set_state(e, S.MOVING_TO_HOST)
                    self._set_host(e, host)
                    self._set_data(e, None)
                    self._set_state(e, S.HOST)
                continue
            if self._inflight and self._inflight + e.nbytes > limit:
                blocked = True
                break
            heapq.heappop(self._heaps[Tier.DEVICE])
            self._set_state(e, S.MOVING_TO_HOST)
            self._inflight += e.nbytes
            self._host_reserved += e.nbytes
            self._spawn(self._copy_to_host, e)
        # Copies still on their way count: they land in the host tier.
        while (
            self._resting[Tier.HOST] + self._host_reserved > cfg.host_bytes and self._disk_usable()
        ):
            e = self._pop_oldest(Tier.HOST, S.HOST)
            if e is None:
                break
            assert self._engine is not None
            footprint = self._engine.footprint(e.nbytes)
            if self._used[Tier.DISK] + footprint > self._disk_cap:
                self._note_no_room(e)
                break
            if not self._disk_has_room(footprint):
                # The filesystem filled up under us (other files, other processes): no
                # error happened, so no pause; the tier is back as soon as the space is.
                self._disk_need = footprint
                self._note_no_room(e)
                break
            if self._inflight and self._inflight + e.nbytes > limit:
                blocked = True
                break
            heapq.heappop(self._heaps[Tier.HOST])
            self._set_state(e, S.MOVING_TO_DISK)
            self._set_disk(e, footprint)
            self._fs_planned += footprint
            self._inflight += e.nbytes
            self._spill_queue.append(e)
            self._wake_loop()
        self._semaphore_full = blocked
        if not blocked and self._put_waiters:
            waiters, self._put_waiters = self._put_waiters, []
            for w in waiters:
                if not w.done():
                    w.set_result(None)

    def _host_copy_failed(self, e: _Entry, exc: BaseException, new: _Entry | None) -> None:
        """The compact host copy of CPU entry ``e`` could not be made; it stays on DEVICE.

        Note: [A failed host copy keeps nothing]
            On the CPU the host tier holds the tensor itself, but a view is copied out of its
            base first, so that the store does not keep a larger storage alive (DESIGN
            invariant 2). That copy can fail for want of memory (a view of a 1 GiB base under
            a tight ``RLIMIT_AS``). When it is the tensor being put, ``put`` raises
            ``TierFullError`` and undoes itself: no entry, no counted bytes. Nor does the
            error pin the view: a notebook keeps the last exception, and with it every frame
            of its traceback, so the frames it passes drop the tensor before it leaves, and
            the allocator's own traceback is cut from its cause. The adapters
            then keep the tensor where it is, as for any full store. An older entry whose copy
            fails stays in the device tier, holding the caller's view, and is tried again at
            the next put; the cascade stops there for now.

        Raises:
            TierFullError: ``e`` is ``new``.
        """
        if e is new:
            # The allocator's traceback holds the frame that held the view.
            exc.__traceback__ = None
            raise TierFullError(
                f"no room in host memory for a {e.nbytes}-byte "
                f"{str(e.dtype).removeprefix('torch.')} view: the store keeps a view as a "
                "compact copy, so as not to keep the larger storage behind it alive, and "
                f"allocating that copy failed ({exc}). Nothing was stored; free host memory, "
                "or keep this tensor yourself"
            ) from exc
        heapq.heappush(self._heaps[Tier.DEVICE], e.key)
        if not self._warned_copy:
            self._warned_copy = True
            log.warning(
                "tierstore: copying %s into host memory failed (%s); it stays where it is and "
                "is tried again at the next put (warned once)",
                e.describe(),
                exc,
            )

    def _disk_has_room(self, footprint: int) -> bool:
        # Other processes share the disk: a spill that seems not to fit reads the space again.
        return self._disk_free() >= footprint or self._disk_free(fresh=True) >= footprint

    def _disk_free(self, *, fresh: bool = False) -> int:
        """Free bytes for spilling: the filesystems' free space plus the engine's reusable.

        The free space is read at most every ``_FREE_SPACE_TTL_SECONDS`` (two system calls per
        spill would cost as much as packing a small tensor); spills planned since the reading
        are subtracted from it.
        """
        now = time.monotonic()
        if fresh or self._fs_read_at is None or now - self._fs_read_at > _FREE_SPACE_TTL_SECONDS:
            self._fs_free = _free_bytes(self.config.disk_dirs)
            self._fs_read_at = now
            self._fs_planned = 0
        reusable = self._engine.reusable_bytes() if self._engine is not None else 0
        return self._fs_free - self._fs_planned + reusable + self._deleting

    def _note_no_room(self, e: _Entry) -> None:
        self._stats.kept_no_room += 1
        if not self._warned_no_room:
            self._warned_no_room = True
            log.warning(
                "tierstore: the disk tier is full (%d of %d bytes); %s stays in host memory. "
                "Raise TIERSTORE_DISK_BYTES or free disk space. (warned once)",
                self._used[Tier.DISK],
                self._disk_cap,
                e.describe(),
            )

    # ------------------------------------------------------------------ downward I/O tasks

    async def _copy_to_host(self, e: _Entry) -> None:
        assert e.data is not None
        t0 = time.perf_counter()
        try:
            host = await copy_to_host(e.data, e.ready, self._pinned)
        except Exception as exc:
            with self._lock:
                self._inflight -= e.nbytes
                self._host_reserved -= e.nbytes
                log.error("tierstore: copying %s to host failed: %s", e.describe(), exc)
                if e.state in TERMINAL:
                    self._free_copies(e)
                else:
                    self._set_state(e, S.DEVICE)
                self._plan_down()
            return
        with self._lock:
            self._inflight -= e.nbytes
            self._host_reserved -= e.nbytes
            self._stats.bytes_to_host += e.nbytes
            self._stats.seconds_to_host += time.perf_counter() - t0
            if e.state in TERMINAL:
                self._free_copies(e)
            elif self._check_unchanged(e, e.data):
                self._set_host(e, host)
                self._set_data(e, None)
                e.ready = None
                e.version = None  # the host copy is the store's own
                self._set_state(e, S.HOST)
            self._plan_down()

    async def _spill_many(self, entries: list[_Entry]) -> None:
        """Write entries to disk, in one engine call (Note: [Batched hand-offs])."""
        assert self._engine is not None
        requests = []
        for e in entries:
            assert e.host is not None
            requests.append(WriteRequest(e.key, as_bytes(e.host), e.dtype, e.shape))
        t0 = time.perf_counter()
        outcomes = await self._engine.write_many(requests)
        with self._lock:
            self._stats.seconds_to_disk += time.perf_counter() - t0
            for e, exc in zip(entries, outcomes, strict=True):
                self._spill_ended(e, exc)
            self._plan_down()
            self._plan_prefetch()
        trim_soon()  # Note: [Returning host memory]

    def _spill_ended(self, e: _Entry, exc: BaseException | None) -> None:
        self._inflight -= e.nbytes
        changed = exc if isinstance(exc, TensorModifiedError) else None
        if exc is None:
            self._stats.bytes_to_disk += e.nbytes
        else:
            footprint = e.disk
            self._set_disk(e, 0)  # the engine keeps nothing of a failed write
            if changed is None:
                self._stats.write_errors += 1
                self._disk_failed(e, footprint, exc)
        if e.state in TERMINAL:
            self._free_copies(e)  # released, or failed, while the write ran
        elif changed is not None:
            self._fail(e, _changed_error(e, str(changed)))
        elif e.host is not None and not self._check_unchanged(e, e.host):
            pass  # the bytes written are not those put (Note: [Writes after put])
        elif exc is not None:
            self._set_state(e, S.HOST)
        else:
            self._set_host(e, None)
            self._set_state(e, S.DISK)

    def _disk_failed(self, e: _Entry, footprint: int, exc: BaseException) -> None:
        self._disk_failed_at = time.monotonic()
        code = exc.errno if isinstance(exc, OSError) else None
        why = errno.errorcode.get(code, "") if code else ""
        if code in (errno.ENOSPC, errno.EDQUOT):
            self._disk_need = max(footprint, 1)
            until = "until that much space is free again"
        else:
            detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            self._disk_error = f"{why}: {detail}" if why else detail
            until = f"for {_DISK_RETRY_SECONDS:.0f}s"
        log.warning(
            "tierstore: writing %s to disk failed (%s%s); it stays in memory and the disk tier "
            "pauses %s",
            e.describe(),
            f"{why}: " if why else "",
            exc,
            until,
        )

    # ------------------------------------------------------------------ get and prefetch

    def get_now(self, handle: TensorHandle) -> torch.Tensor | cf.Future[torch.Tensor]:
        """The tensor if it is ready now, else a future that resolves to it.

        A caller that receives a future must call :meth:`consumed` after it resolves.

        Raises:
            TensorReleasedError: the handle was released or belongs to another store.
            CorruptTensorError: the spilled copy was found corrupt earlier.
            StoreClosedError: the store is closed.
        """
        with self._lock:
            self._check_open()
            self._drain_dropped_locked()
            e = self._lookup(handle)
            self._cursor = e.key
            result = self._get_locked(e)
            self._plan_prefetch()
            return result

    def _get_locked(self, e: _Entry) -> torch.Tensor | cf.Future[torch.Tensor]:
        """What a get of ``e`` returns now, or the future of it.

        Note: [What get returns]
            ``get`` returns a contiguous tensor with the dtype, shape and device of the tensor
            that was put, bit for bit, whose storage holds exactly its bytes:
            ``storage_offset() == 0`` and ``untyped_storage().nbytes() == nbytes``. Nothing of
            any other tensor can be reached through it (``torch.save`` writes exactly its
            bytes), and code that rebuilds views of it with ``as_strided`` may count offsets
            from 0. Every path keeps this: a read from disk lands in a pooled buffer wider than
            the tensor (the engine reads whole pages) and hands back a tensor made on exactly
            the tensor's bytes inside it; a tensor still resting where it was put comes back
            as itself when it already owns exactly its storage, and as a compact copy when it
            is a view. Storage from the read pool cannot grow (as with ``torch.frombuffer``):
            ``resize_`` to a larger size raises, so ``clone()`` it first to use it as a
            resizable ``out=``. The adapters rely on this contract, and the differential tests
            in ``tests/adapters/test_bitexact.py`` cover every path it has.
        """
        st = self._stats
        state = e.state
        if state is S.FAILED:
            assert e.error is not None
            raise e.error
        if state is S.FETCHED:
            assert e.fetched is not None
            out = e.fetched
            hand_over(out)  # the caller's stream waits for the copy (no-op on the CPU)
            self._consume_locked(e)
            st.prefetch_hits += 1
            st.gets += 1
            return out
        if state is S.FETCHING:
            if e.fetch_future is None:  # a prefetch nobody waited on so far
                e.fetch_future = cf.Future()
            st.prefetch_hits += 1
            return e.fetch_future
        source = e.data if e.data is not None else e.host
        if source is not None and (source.device == e.device or e.device.type == "cpu"):
            # Resting on its device, or on the CPU where host memory is the device, or moving
            # down with its source still intact.
            if not self._check_unchanged(e, source, io_done=state not in TRANSIT):
                assert e.error is not None
                raise e.error
            st.prefetch_hits += 1
            st.gets += 1
            return compact(source)  # Note: [What get returns]
        if source is not None and state in (S.HOST, S.MOVING_TO_DISK):
            # An accelerator tensor in host memory (perhaps being written to disk): queue the
            # copy back on the caller's stream and return; nothing waits for it here.
            st.prefetch_misses += 1
            st.gets += 1
            st.bytes_to_device += e.nbytes
            return copy_to_device(source, e.device, self._pinned)
        st.prefetch_misses += 1
        fut: cf.Future[torch.Tensor] = cf.Future()
        self._start_fetch(e, fut)
        return fut

    def consumed(self, handle: TensorHandle, t: torch.Tensor) -> None:
        """Record that a get which waited on a future has taken ``t`` (in the getter's thread)."""
        hand_over(t)  # the caller's stream waits for the copy (no-op on the CPU)
        with self._lock:
            self._stats.gets += 1
            e = self._entries.get(handle.key)
            if e is not None and e.state is S.FETCHED and e.fetched is t:
                self._consume_locked(e)
            self._plan_prefetch()

    def _consume_locked(self, e: _Entry) -> None:
        # The caller holds the tensor now; keeping the fetched copy would pin it on the device
        # after backward is done with it (a retain_graph run would bring everything back).
        self._set_fetched(e, None)
        e.fetch_future = None
        self._set_state(e, e.home())

    def _start_fetch(self, e: _Entry, fut: cf.Future[torch.Tensor] | None = None) -> None:
        """Begin bringing ``e`` back: for the get waiting on ``fut``, or as a prefetch (None).

        A prefetch makes no future: most are consumed after they finish, and a future (with
        its condition and lock) per prefetched tensor was a tenth of the Python a small
        put+get cost. The first get that finds the fetch still running makes one.
        """
        self._set_state(e, S.FETCHING)
        e.fetch_future = fut
        e.prefetched = fut is None
        self._fetch_queue.append(e)
        self._wake_loop()

    def prefetch_now(self, handles: Iterable[TensorHandle]) -> None:
        """Start bringing these entries back, newest first, within the prefetch window."""
        with self._lock:
            self._check_open()
            self._drain_dropped_locked()
            entries = sorted((self._lookup(h) for h in handles), key=lambda x: -x.key)
            budget = self.config.prefetch_bytes - self._window
            for e in entries:
                if not self._needs_fetch(e):
                    continue
                if e.nbytes > budget:
                    break
                budget -= e.nbytes
                self._start_fetch(e)

    def _needs_fetch(self, e: _Entry) -> bool:
        return e.state is S.DISK or (e.state is S.HOST and e.device.type != "cpu")

    def _plan_prefetch(self) -> None:
        """Bring back the entries just older than the cursor, newest first (LIFO).

        Note: [Resumable prefetch walk]
            Backward moves the cursor down one entry at a time, and everything between the
            cursor and where the last walk stopped is already fetched or fetching. Walking from
            the cursor each time would make a backward sweep quadratic in the number of
            entries (4096 small tensors in one window: seconds of pure bookkeeping), so the
            walk resumes where it stopped, and restarts at the cursor only when the cursor moves
            up (a new backward pass).

            One walk also starts at most ``_PREFETCH_STEP`` fetches: planning a whole 256 MiB
            window of 64 KiB tensors (4096 fetches) at once held the lock for about 100 ms, and
            the first ``get`` of backward, whose own read waited behind that, took 150-350 ms.
            The walk goes on when a fetch ends (``_fetch_many``) and at every ``get``, so the
            window still fills while the caller waits; 256 fetches are 16 MiB of 64 KiB
            tensors, and a whole window of big ones.
        """
        if self._cursor is None or self._closed:
            return
        budget = self.config.prefetch_bytes - self._window
        if budget <= 0:
            return
        start = self._cursor
        if (
            self._walk_cursor is not None
            and self._walk_next is not None
            and self._cursor <= self._walk_cursor
        ):
            start = min(start, self._walk_next)
        i = bisect.bisect_left(self._live_keys, start) - 1
        scanned = 0
        started = 0
        while i >= 0 and scanned < _PREFETCH_SCAN_LIMIT:
            e = self._entries[self._live_keys[i]]
            if self._needs_fetch(e):
                if e.nbytes > budget or started == _PREFETCH_STEP:
                    break
                budget -= e.nbytes
                started += 1
                self._start_fetch(e)
            i -= 1
            scanned += 1
        self.walk_steps += scanned
        self._walk_cursor = self._cursor
        # Resume at the entry that did not fit (or below the last one looked at).
        self._walk_next = self._live_keys[i] + 1 if i >= 0 else 0

    async def _fetch_many(self, entries: list[_Entry]) -> None:
        """Bring entries back, the disk reads in one engine call (Note: [Batched hand-offs])."""
        with self._lock:
            live = []
            for e in entries:
                if _released(e):
                    # Released before the read began: skip it (a prefetch nobody will consume).
                    fut = e.fetch_future
                    self._free_copies(e)
                    if fut is not None and not fut.done():
                        fut.set_exception(TensorReleasedError(f"{e.describe()} was released"))
                else:
                    live.append(e)
            if len(live) < len(entries):
                self._plan_prefetch()
        if not live:
            return
        disk = [e for e in live if e.disk]
        targets: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        read_error: dict[int, BaseException | None] = {}
        for e in disk:
            try:
                targets[e.key] = self._read_buffer(e)
            except Exception as exc:
                # No memory for the buffer: this read fails and the entry stays on disk, as
                # after a read error; a get waiting on it raises instead of waiting forever.
                read_error[e.key] = exc
        reading = [e for e in disk if e.key in targets]
        t0 = time.perf_counter()
        if reading:
            assert self._engine is not None
            read_errors = await self._engine.read_many(
                [(e.key, targets[e.key][0]) for e in reading]
            )
            read_error.update({e.key: err for e, err in zip(reading, read_errors, strict=True)})
        t1 = time.perf_counter()
        buffers = {key: data for key, (_, data) in targets.items()}
        del targets  # the read windows: only ``data`` may keep a pooled buffer busy now
        results: list[tuple[_Entry, torch.Tensor | Exception]] = []
        for e in live:
            err = read_error.get(e.key)
            if err is not None and not isinstance(err, Exception):
                raise err  # cancelled at close
            if err is not None:
                results.append((e, err))
                continue
            try:
                buf = buffers.get(e.key)
                src = e.host if buf is None else from_bytes(buf, e.dtype, e.shape)
                assert src is not None
                if e.device.type == "cpu":
                    results.append((e, src))
                else:
                    # Allocated on the stream that will consume it, most likely; a getter on
                    # another stream is ordered by hand_over.
                    consumer = e.stream if e.stream is not None else current_stream(e.device)
                    results.append((e, upload(src, e.device, consumer, self._pinned)))
            except Exception as exc:
                results.append((e, exc))
        t2 = time.perf_counter()
        ready: list[tuple[cf.Future[torch.Tensor], torch.Tensor]] = []
        with self._lock:
            st = self._stats
            if disk:
                st.bytes_from_disk += sum(e.nbytes for e in disk if read_error[e.key] is None)
                st.seconds_from_disk += t1 - t0
            for e, out in results:
                fut = e.fetch_future
                if isinstance(out, Exception):
                    self._fetch_failed(e, fut, out)
                    continue
                if e.device.type != "cpu":
                    st.bytes_to_device += e.nbytes
                if e.state is S.RELEASED:
                    discard(out)
                    self._free_copies(e)
                    if fut is not None:
                        fut.set_exception(TensorReleasedError(f"{e.describe()} was released"))
                    continue
                self._set_fetched(e, out)
                self._set_state(e, S.FETCHED)
                if fut is not None:
                    ready.append((fut, out))
            if any(e.device.type != "cpu" for e in live):
                st.seconds_to_device += t2 - t1
            self._plan_prefetch()  # keep the window full while the caller waits
        for fut, out in ready:
            if not fut.done():
                fut.set_result(out)

    def _read_buffer(self, e: _Entry) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, data)``: what a disk read of ``e`` fills, and the entry's bytes in it.

        Big CPU tensors read into a pooled buffer spanning the pages the engine's layout asks
        for (``read_window``), so the read goes straight into it; ``data`` is then a tensor
        whose storage is exactly the entry's bytes inside that buffer (Note: [What get
        returns]). Accelerator tensors read the same way into the pinned pool (Note: [The
        pinned pool]), whose buffer the copy to the device holds until it ends; a full pool
        gives pageable memory. Small CPU tensors read into a plain allocation, where ``out``
        and ``data`` are the same tensor.
        """
        assert self._engine is not None
        if e.device.type != "cpu" or e.nbytes >= _POOLED_READ_BYTES:
            lead, span = self._engine.read_window(e.key, e.nbytes)
            pool = self._read_pool if e.device.type == "cpu" else self._pinned
            got = pool.take(e.nbytes, lead=lead, span=span)
            if got is not None:
                return got
        buf = torch.empty(e.nbytes, dtype=torch.uint8)
        return buf, buf

    def _fetch_failed(self, e: _Entry, fut: cf.Future[torch.Tensor] | None, exc: Exception) -> None:
        """Record a failed fetch: FAILED if the copy is corrupt, else back to its home tier.

        Note: [A failed prefetch is retried once]
            A get may find its entry already being fetched by a prefetch that began before the
            disk recovered. When such a prefetch fails while a get waits on it, its future is
            handed to one fresh read, as if the get had started it; only that read's failure
            reaches the get. A failed read the get began itself raises at once, and a corrupt
            copy is final.
        """
        self._stats.read_errors += 1
        if e.state is S.RELEASED:
            self._free_copies(e)
            if fut is not None:
                fut.set_exception(TensorReleasedError(f"{e.describe()} was released"))
            return
        if isinstance(exc, CorruptTensorError):
            err: BaseException = CorruptTensorError(
                f"{e.describe()}: spilled copy is corrupt: {exc}"
            )
            self._set_state(e, S.FAILED)
            e.error = err
            self._free_copies(e)
            log.error("tierstore: %s", err)
        else:
            self._set_state(e, e.home())
            if e.prefetched and fut is not None:
                self._start_fetch(e, fut)
                return
            err = SpillIOError(f"reading {e.describe()} back from disk failed: {exc}")
            err.__cause__ = exc
        e.fetch_future = None
        if fut is not None and not fut.done():
            fut.set_exception(err)

    def note_get_wait(self, seconds: float) -> None:
        with self._lock:
            self._stats.get_wait_seconds += seconds

    def note_put_wait(self, seconds: float) -> None:
        with self._lock:
            self._stats.put_wait_seconds += seconds

    def note_skipped(self, reason: str, nbytes: int) -> None:
        """Count a tensor an adapter chose not to store, under ``reason``."""
        with self._lock:
            self._stats.skipped[reason] += 1
            self._stats.skipped_bytes[reason] += nbytes

    # ------------------------------------------------------------------ release

    def release(self, handle: TensorHandle) -> None:
        """Release the handle's entry now (idempotent for handles of this store).

        Raises:
            TypeError: ``handle`` is not a :class:`TensorHandle`.
            TensorReleasedError: the handle belongs to another store.
        """
        _check_handle(handle)
        with self._lock:
            self._drain_dropped_locked()
            if handle._released:
                return
            e = self._lookup(handle)
            handle._released = True
            self._release_locked(e)

    def _release_locked(self, e: _Entry) -> None:
        del self._entries[e.key]
        i = bisect.bisect_left(self._live_keys, e.key)
        del self._live_keys[i]
        self._stats.releases += 1
        if e.state in TERMINAL:
            return
        in_transit = e.state in TRANSIT
        self._set_state(e, S.RELEASED)
        if in_transit:
            # The task moving it frees what it holds when the I/O ends (Note: [One state,
            # one table]); until then its bytes still count.
            self._in_transit_released.add(e)
        else:
            self._free_copies(e)
        self._plan_prefetch()

    def _check_unchanged(self, e: _Entry, t: torch.Tensor, *, io_done: bool = True) -> bool:
        """Whether ``t``, the caller's tensor the store holds for ``e``, is as it was put.

        If not, ``e`` fails with a :class:`TensorModifiedError` that says what changed, and
        False is returned; ``get`` raises that error from then on. Its copies are freed now,
        or, when ``io_done`` is False, by the transfer still running (as for a release).

        Note: [Writes after put]
            On the CPU, and on a device until its copy is made, the store holds the caller's
            own tensor rather than a copy. Writing it in place, or resizing its storage (as
            FSDP frees a flat parameter with ``storage.resize_(0)``), after ``put`` breaks the
            contract, and the store cannot give back what was put. It notices instead of
            returning other bytes, crashing, or blaming the disk: the version counter recorded
            at put is compared whenever the store copies, spills or returns the tensor, and the
            storage's size is checked first (the raw engine checks it again on its I/O threads,
            right before touching the memory). The entry then fails with an error saying so.
        """
        why = _changed(e, t)
        if why is None:
            return True
        self._fail(e, _changed_error(e, why), io_done=io_done)
        return False

    def _fail(self, e: _Entry, err: TierStoreError, *, io_done: bool = True) -> None:
        """End ``e`` in FAILED with ``err``, which every later get raises."""
        log.error("tierstore: %s", err)
        in_transit = e.state in TRANSIT and not io_done
        self._set_state(e, S.FAILED)
        e.error = err
        if in_transit:
            # The task moving it frees what it holds when its I/O ends, as after a release.
            self._in_transit_released.add(e)
        else:
            self._free_copies(e)

    def _free_copies(self, e: _Entry) -> None:
        if e.host is not None or e.data is not None:
            trim_soon()  # Note: [Returning host memory]
        self._in_transit_released.discard(e)
        self._set_data(e, None)
        self._set_host(e, None)
        if e.fetched is not None:
            discard(e.fetched)  # an upload nobody took (Note: [Copy ordering on an accelerator])
        self._set_fetched(e, None)
        if e.disk:
            footprint = e.disk
            self._set_disk(e, 0)
            if not self._closed:  # at close the engine deletes every file at once
                self._deleting += footprint
                self._delete_queue.append((e.key, footprint))
                self._wake_loop()
        e.ready = None

    async def _delete_many(self, deletes: list[tuple[int, int]]) -> None:
        """Free the spill space of released entries: ``(key, footprint)`` pairs, one call."""
        outcomes: list[BaseException | None] = []
        try:
            if self._engine is not None:
                outcomes = await self._engine.delete_many([key for key, _ in deletes])
        except Exception as exc:  # the file goes at close anyway
            outcomes = [exc] * len(deletes)
        finally:
            with self._lock:
                self._deleting -= sum(footprint for _, footprint in deletes)
        for (key, _), err in zip(deletes, outcomes, strict=False):
            if err is not None:
                log.warning("tierstore: freeing spill space of tensor #%d failed: %s", key, err)

    # ------------------------------------------------------------------ queries

    def _lookup(self, handle: TensorHandle) -> _Entry:
        _check_handle(handle)
        e = self._entries.get(handle.key)
        if e is None or e.handle_ref is None or e.handle_ref() is not handle:
            if handle._owner != self.token:
                why = "is not in this store (another store's handle, or one made before a fork)"
            else:
                why = "was released"
            raise TensorReleasedError(f"{handle!r} {why}")
        return e

    def state_of(self, handle: TensorHandle) -> TensorState:
        """The entry's state (RELEASED once released).

        Raises:
            TypeError: ``handle`` is not a :class:`TensorHandle`.
            TensorReleasedError: another store's handle.
        """
        _check_handle(handle)
        with self._lock:
            self._drain_dropped_locked()
            if handle._released and handle._owner == self.token:
                return S.RELEASED
            return self._lookup(handle).state

    def tier_of(self, handle: TensorHandle) -> Tier:
        """Where the entry's bytes are: the tier a get would read them from.

        Raises:
            TensorReleasedError: released, or another store's handle.
            CorruptTensorError: the entry failed.
        """
        with self._lock:
            self._drain_dropped_locked()
            e = self._lookup(handle)
            if e.state is S.FAILED:
                assert e.error is not None
                raise e.error
            if e.fetched is not None or e.data is not None:
                return Tier.DEVICE
            if e.host is not None:
                return Tier.HOST
            return Tier.DISK

    def stats(self) -> StoreStats:
        """A frozen snapshot of the store."""
        with self._lock:
            self._drain_dropped_locked()
            return self._snapshot_locked()

    def _snapshot_locked(self) -> StoreStats:
        st = self._stats
        caps = {
            Tier.DEVICE: self.config.device_bytes,
            Tier.HOST: self.config.host_bytes,
            Tier.DISK: self._disk_cap,
        }
        tiers = {
            t: TierStats(
                entries=self._count[t],
                bytes=self._used[t],
                capacity=caps[t],
                total_entries=st.total_entries[t],
                total_bytes=st.total_bytes[t],
            )
            for t in Tier
        }
        return StoreStats(
            device=tiers[Tier.DEVICE],
            host=tiers[Tier.HOST],
            disk=tiers[Tier.DISK],
            live_entries=len(self._entries),
            puts=st.puts,
            gets=st.gets,
            releases=st.releases,
            bytes_put=st.bytes_put,
            bytes_to_host=st.bytes_to_host,
            bytes_to_disk=st.bytes_to_disk,
            bytes_from_disk=st.bytes_from_disk,
            bytes_to_device=st.bytes_to_device,
            seconds_to_host=st.seconds_to_host,
            seconds_to_disk=st.seconds_to_disk,
            seconds_from_disk=st.seconds_from_disk,
            seconds_to_device=st.seconds_to_device,
            get_wait_seconds=st.get_wait_seconds,
            put_wait_seconds=st.put_wait_seconds,
            prefetch_hits=st.prefetch_hits,
            prefetch_misses=st.prefetch_misses,
            inflight_bytes=self._inflight,
            kept_no_room=st.kept_no_room,
            skipped=dict(st.skipped),
            skipped_bytes=dict(st.skipped_bytes),
            write_errors=st.write_errors,
            read_errors=st.read_errors,
            disk_available=self._disk_usable(),
        )

    # ------------------------------------------------------------------ close

    def begin_close(self) -> bool:
        """Refuse new work; return False if the store was already closed."""
        with self._lock:
            if self._closed:
                return False
            self._closed = True
            for w in self._put_waiters:
                if not w.done():
                    w.set_exception(StoreClosedError("the store was closed while put waited"))
            self._put_waiters = []
            return True

    async def finish_close(self, timeout: float) -> None:
        """Let in-flight I/O end (cancel it after ``timeout`` seconds), then delete everything."""
        deadline = time.monotonic() + timeout
        # Finishing tasks may start others (a fetch completing a prefetch walk); wait until no
        # task is left, then cancel whatever outlived the timeout.
        while True:
            self._run_spawns()  # queued work becomes tasks this loop can wait for
            pending = {t for t in self._tasks if t is not asyncio.current_task()}
            if not pending:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                for t in pending:
                    t.cancel()
                log.warning(
                    "tierstore: cancelled %d transfers still running at close", len(pending)
                )
                await asyncio.wait(pending, timeout=5)
                break
            await asyncio.wait(pending, timeout=left)
        with self._lock:
            summary = self._snapshot_locked().summary()
            for e in list(self._entries.values()):
                if e.fetch_future is not None and not e.fetch_future.done():
                    e.fetch_future.set_exception(StoreClosedError("the store was closed"))
                with contextlib.suppress(Exception):
                    self._set_state(e, S.RELEASED)
                if e.fetched is not None:
                    discard(e.fetched)
                e.data = e.host = e.fetched = None
                e.disk = 0
            self._entries.clear()
            self._live_keys.clear()
            self._in_transit_released.clear()
        try:
            if self._engine is not None:
                await self._engine.close()
        finally:
            for d in self._spill_dirs:
                d.remove()
        log.info("%s", summary)

    def forget_after_fork(self) -> None:
        """In a forked child: drop everything without touching the parent's files or locks."""
        self._closed = True
        self._entries.clear()
        for d in self._spill_dirs:
            d.forget()
        self._spill_dirs = []
        self._engine = None

    @property
    def closed(self) -> bool:
        return self._closed


def _drain(queue: collections.deque[_T]) -> list[_T]:
    """Everything in ``queue``, emptied with atomic pops (another thread may append)."""
    items: list[_T] = []
    while queue:
        items.append(queue.popleft())
    return items


def _batches(entries: list[_Entry]) -> Iterable[list[_Entry]]:
    """Runs of ``entries`` for one task each: big entries alone, small ones together.

    Small entries (at most ``_BATCH_BYTES``) go in consecutive runs of at most
    ``_BATCH_MAX_BYTES`` (one at least); a bigger entry is a batch of its own, which keeps
    its chunks alone in the engine call (Note: [Batched hand-offs]).
    """
    batch: list[_Entry] = []
    size = 0
    for e in entries:
        if e.nbytes > _BATCH_BYTES:
            yield [e]
            continue
        if batch and size + e.nbytes > _BATCH_MAX_BYTES:
            yield batch
            batch, size = [], 0
        batch.append(e)
        size += e.nbytes
    if batch:
        yield batch


def _released(e: _Entry) -> bool:
    # A function, not an inline test: the state changes across the task's awaits, and an
    # inline test would let the type checker narrow it for the rest of the coroutine.
    return e.state is S.RELEASED


def _check_handle(handle: object) -> None:
    if not isinstance(handle, TensorHandle):
        raise TypeError(f"expected a TensorHandle from put(), got {type(handle).__name__}")


def _check_tensor(t: object) -> None:
    if not isinstance(t, torch.Tensor):
        raise UnsupportedTensorError(f"put() takes a torch.Tensor, got {type(t).__name__}")
    if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
        raise UnsupportedTensorError(
            f"tensor subclass {type(t).__name__} is not supported; store its plain data "
            "(e.g. t.as_subclass(torch.Tensor)) or keep it in memory"
        )
    if t.layout is not torch.strided:
        raise UnsupportedTensorError(
            f"{t.layout} tensors are not supported; convert with .to_dense() or keep in memory"
        )
    if t.is_nested:
        raise UnsupportedTensorError("nested tensors are not supported; keep them in memory")
    if t.is_quantized:
        raise UnsupportedTensorError(
            "quantized tensors are not supported; store .int_repr() and the scales instead"
        )
    if t.device.type != "cpu" and not _accelerator.is_accelerator(t.device):
        raise UnsupportedTensorError(
            f"tensors on device {str(t.device)!r} are not supported; tierstore moves CPU "
            f"tensors and tensors on this machine's accelerator "
            f"({_accelerator.accelerator_type() or 'none here'})"
        )


def _free_bytes(dirs: Iterable[os.PathLike[str]]) -> int:
    seen: set[int] = set()
    free = 0
    for d in dirs:
        try:
            st = os.statvfs(d)
            dev = os.stat(d).st_dev
        except OSError:
            continue
        if dev in seen:
            continue
        seen.add(dev)
        free += st.f_bavail * st.f_frsize
    return free


def version_of(t: torch.Tensor) -> int | None:
    """``t``'s version counter, or None for tensors that keep none (inference mode)."""
    try:
        return t._version
    except RuntimeError:
        return None


def _changed(e: _Entry, t: torch.Tensor) -> str | None:
    """How ``t`` changed since ``e`` was put, or None (Note: [Writes after put])."""
    # The bytes of storage the tensor reaches (an expanded view reaches fewer than it shows).
    reach = sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))
    need = (t.storage_offset() + reach + 1) * t.element_size() if t.numel() else 0
    have = t.untyped_storage().nbytes()
    if have < need:
        return f"its storage was resized to {have} bytes (it needs {need}), as resize_(0) does"
    if e.version is not None and version_of(t) != e.version:
        return f"it was written in place (version {e.version} at put, {version_of(t)} now)"
    return None


def _changed_error(e: _Entry, why: str) -> TensorModifiedError:
    return TensorModifiedError(
        f"{e.describe()} changed after put(): {why}. The store no longer holds the bytes that "
        "were put. Leave a tensor untouched until its handle is released, or put a clone()"
    )
