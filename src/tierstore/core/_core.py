"""StoreCore: the store's operations, wiring its parts under one lock.

Both public classes drive one :class:`StoreCore`. ``AsyncTieredStore`` binds it to the running
event loop; ``TieredStore`` binds it to a loop it owns on a background thread.

Note: [Threading model]
    Entry state lives in this object's parts and changes only under ``self.lock``, a plain
    ``threading.Lock`` held briefly and never across an ``await``. Every disk read or write,
    and every device copy, runs as a task on the store's event loop; the tasks take the lock
    only to record what they did. That lets ``put`` into a tier with room, and ``get`` of a
    tensor that is already back, finish in the caller's own thread without a hop to the loop
    (a hop costs more than a small put and get together; docs/architecture.md, "Threading
    model"), while anything that must wait waits on a ``concurrent.futures.Future`` that any
    thread or coroutine can block on.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from typing import TYPE_CHECKING, Literal

from tierstore._state import TensorState, Tier
from tierstore.core import _disk_room, _moves
from tierstore.core._checks import check_handle, check_min_bytes, check_tensor
from tierstore.core._counters import Counters, tier_stats
from tierstore.core._disk_room import DiskRoom
from tierstore.core._disk_tier import open_disk_tier
from tierstore.core._entries import Entry, EntryTable
from tierstore.core._handles import DROPPED_POLL_MAX_SECONDS, DROPPED_POLL_SECONDS, Handles
from tierstore.core._handoff import HandOff
from tierstore.core._lock import StoreLock
from tierstore.core._prefetch import PENDING, PrefetchWalk, newest_first_within
from tierstore.core._reads import read_now
from tierstore.core._save_semaphore import SaveSemaphore
from tierstore.core._steps import Steps
from tierstore.core._transfers import Transfers
from tierstore.errors import StoreClosedError, TensorReleasedError, TierFullError
from tierstore.tiers._device import current_stream, discard, hand_over, ready_event
from tierstore.tiers._pinned import PinnedPool
from tierstore.tiers._readpool import SWEEP_KEEP_BYTES, ReadPool

if TYPE_CHECKING:
    import asyncio
    import concurrent.futures as cf
    import os
    from collections.abc import Callable, Iterable, Iterator

    import torch

    from tierstore._handle import TensorHandle
    from tierstore._stats import StepStats, StoreStats
    from tierstore.config import StoreConfig
    from tierstore.tiers import DiskEngine

__all__ = ["StoreCore"]

log = logging.getLogger("tierstore")

S = TensorState

_store_tokens = itertools.count(1)


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
        self.lock = StoreLock()  # Note: [A call from inside the store]
        self.closed = False
        self.warned_no_room = self.warned_copy = False
        self.table = EntryTable(self._spill_freed)
        self.handles = Handles(loop, next(_store_tokens), self._drain_dropped_soon)
        self._polling_dropped = False
        self._poll_every = DROPPED_POLL_SECONDS
        self._poll_timer: asyncio.TimerHandle | None = None
        self._retry_armed = False
        self._retry_timer: asyncio.TimerHandle | None = None
        self.counters = Counters()
        self.semaphore = SaveSemaphore(config.max_inflight_bytes)
        self.walk = PrefetchWalk()
        self.sweep = 0
        """The backward sweep gets are in now (Note: [Got once a sweep])."""
        self._lowest_passed_got: int | None = None
        """The lowest key a walk passed over as got in this sweep (Note: [Got once a sweep])."""
        self.transfers = Transfers(self)
        self.handoff = HandOff(
            loop,
            loop_thread,
            self.transfers.spill_many,
            self.transfers.fetch_many,
            self.transfers.delete_many,
        )
        self._keys = itertools.count(1)
        # Read buffers are reused once their tensors die; keep about a prefetch window of
        # them (Note: [Buffers come back when the last tensor goes]).
        self.read_pool = ReadPool(keep_bytes=max(config.prefetch_bytes, 64 << 20))
        # The host tier of accelerator tensors, pinned at its first use; a CPU-only process
        # never allocates it (Note: [The pinned pool]). A window's worth beyond the host
        # tier is room for copies on their way to disk (Note: [Staging room in the pinned
        # pool]).
        self.pinned = PinnedPool(config.host_bytes + config.max_inflight_bytes)
        self.disk_tier = open_disk_tier(config)
        self.disk = DiskRoom(self.disk_tier.engine, self.disk_tier.capacity, config.disk_dirs)
        self.steps = Steps(self._snapshot_locked())
        self.final_stats: StoreStats | None = None
        """The snapshot taken when the store closed: what ``stats()`` returns after close."""

    @property
    def engine(self) -> DiskEngine | None:
        """The disk engine, or None when the disk tier is off."""
        return self.disk.engine

    @property
    def spill_dirs(self) -> tuple[os.PathLike[str], ...]:
        """The private spill directories of this store (empty without a disk tier)."""
        return tuple(d.path for d in self.disk_tier.dirs)

    def wrap_engine(self, wrap: Callable[[DiskEngine], DiskEngine]) -> DiskEngine:
        """Replace the disk engine by ``wrap(engine)`` and return it (``tierstore.testing``).

        Raises:
            RuntimeError: the store has no disk tier, or already holds tensors on disk.
        """
        with self.lock:
            if self.disk.engine is None or self.table.used[Tier.DISK]:
                raise RuntimeError("wrap the engine before anything is spilled")
            self.disk.engine = wrap(self.disk.engine)
            return self.disk.engine

    # ------------------------------------------------------------------ put

    def put_now(
        self, t: torch.Tensor, min_bytes: int | None = None
    ) -> tuple[TensorHandle, cf.Future[None] | None]:
        """Store ``t``; return its handle and, under backpressure, a future to wait on.

        ``min_bytes``: ``t`` stays where it is if smaller (default: the store's).

        Raises:
            UnsupportedTensorError: ``t`` is not a plain strided CPU or accelerator tensor.
            TierFullError: no tier has room for it.
            StoreClosedError: the store is closed.
            ValueError: ``min_bytes`` is not a non-negative integer or None.
        """
        check_tensor(t)
        check_min_bytes(min_bytes)
        if min_bytes is None:
            min_bytes = self.config.min_bytes
        ready = ready_event(t)
        stream = current_stream(t.device)
        with self.lock:
            self._check_open()
            self.drain_dropped()
            nbytes = t.numel() * t.element_size()
            movable = nbytes >= min_bytes and nbytes > 0
            if movable and not self._has_room(nbytes):
                # What waits for room (copies paused after a failure) is tried again all
                # the same: every put runs the cascade.
                self.cascade()
                raise _moves.tier_full(self, nbytes, t.dtype)
            e = Entry(next(self._keys), t, movable)
            e.ready = ready
            e.stream = stream
            peaks = self.table.device_peaks()
            self.table.add(e, t.detach())
            self.counters.puts += 1
            self.counters.bytes_put += nbytes
            handle = self.handles.new(e)
            self._watch_dropped()
            try:
                self.cascade(new=e)
            except TierFullError:
                self.table.unput(e, peaks)
                self.counters.puts -= 1
                self.counters.bytes_put -= nbytes
                handle._released = True
                self.cascade()
                del t  # Note: [A failed host copy keeps nothing]
                raise
            return handle, self.semaphore.waiter()

    def _has_room(self, nbytes: int) -> bool:
        """Whether a put of ``nbytes`` fits: in the tiers above the disk, or with what it
        pushes down, on disk.

        Note: [Room for a put]
            A put fits when the disk tier can take what the cascade will write once the put
            lands and every move waiting now has run: entries over a tier's capacity whose
            move is held back (by the save semaphore, or by copies paused after a failure)
            have no room reserved below yet, but will take it. Counting only each tier's
            free room, puts from several threads (each admitted before it waits) filled the
            host tier several tensors past its capacity and the disk tier past its own,
            where a put should have raised ``TierFullError``. The cascade moves whole
            entries, oldest first, so the count follows it entry by entry
            (:meth:`_spills_after`) and measures each as the disk does, in footprints (whole
            pages, chunk files). Counted in bytes, a 64 KiB put beside a 4 MiB host entry
            was admitted into a 4 MiB host tier whose oldest entry the 1 MiB disk could not
            take, and the host tier ran past its capacity; counted in bytes, a tensor whose
            footprint did not fit was admitted and kept in host memory.
        """
        cfg, table = self.config, self.table
        if table.resting[Tier.DEVICE] + nbytes <= cfg.device_bytes:
            return True  # it rests on its device and moves nothing
        room: int | None = None
        for size in self._spills_after(nbytes):
            if room is None:
                room = self.disk.room(table.used[Tier.DISK])  # 0: no disk tier, or paused
            if room <= 0 or (room := room - self.disk.footprint(size)) < 0:
                return False
        return True

    def _spills_after(self, nbytes: int) -> Iterator[int]:
        """The sizes of the entries the cascade will write to disk, oldest first, once a put
        of ``nbytes`` lands and every move held back now has run (Note: [Room for a put]).

        The oldest entries resting on the device go to the host tier while the device tier
        is over ``device_bytes``, the new one last. The host tier then holds what it holds,
        less the spills in flight (their disk room is taken), plus the copies on their way
        into it and what comes down; fetched copies of accelerator entries whose home is the
        host tier count there, since they return to it. While it is over ``host_bytes``, the
        cascade writes its oldest entries whole. The copies landing and the fetched copies
        (an accelerator's; on the CPU there are none) are older than what comes down, but
        the walk cannot name them without reading every entry: they count first, as one
        size, whole. Then the oldest resting entries, then what came down.
        """
        cfg, table = self.config, self.table
        down: list[int] = []
        over = table.resting[Tier.DEVICE] + nbytes - cfg.device_bytes
        if over > 0 and table.resting[Tier.DEVICE]:
            for e in table.resting_oldest_first(Tier.DEVICE):
                down.append(e.nbytes)
                over -= e.nbytes
                if over <= 0:
                    break
        if over > 0:
            down.append(nbytes)
        spilling = self.semaphore.inflight - table.host_reserved
        held = table.used[Tier.HOST] - spilling + table.host_reserved
        over = held + sum(down) - cfg.host_bytes
        unnamed = held - table.resting[Tier.HOST]
        if over > 0 and unnamed > 0:
            yield unnamed
            over -= unnamed
        if over > 0 and table.resting[Tier.HOST]:
            for e in table.resting_oldest_first(Tier.HOST):
                yield e.nbytes
                over -= e.nbytes
                if over <= 0:
                    return
        for size in down:
            if over <= 0:
                return
            yield size
            over -= size

    def cascade(self, new: Entry | None = None) -> None:
        """Plan the cascade and carry it out (Note: [The cascade]).

        Raises:
            TierFullError: the compact host copy of ``new``, the entry ``put`` is adding, could
                not be made (Note: [A failed host copy keeps nothing]).
        """
        if not self.closed:  # while close() drains the transfers in flight, start none
            _moves.cascade(self, new)

    def retry_later(self) -> None:
        """Run the cascade again once a pause after a failure may be over (the lock held, from
        any thread).

        Note: [Tried again after a pause]
            A failed spill pauses the disk tier, a failed copy to the host pauses copies, and
            what could not move waits above its tier's capacity. The cascade runs at every
            put, get and release, so in training the next call moves it; but a process that
            only waits after the failure (an evaluation, a checkpoint save) held it there for
            as long. While a cascade leaves something waiting on a pause, one timer on the
            store's loop runs it again after ``RETRY_SECONDS`` (1 s), and that run arms the next
            while the wait goes on; nothing waiting, nothing is armed.
        """
        if self._retry_armed or self.closed:
            return
        self._retry_armed = True
        try:
            self.loop.call_soon_threadsafe(self._arm_retry)
        except RuntimeError:  # the loop is closed: so is the store
            self._retry_armed = False

    def _arm_retry(self) -> None:
        with self.lock:
            if not self.closed:
                self._retry_timer = self.loop.call_later(_disk_room.RETRY_SECONDS, self._retry)

    def _retry(self) -> None:
        with self.lock:
            self._retry_armed, self._retry_timer = False, None
            self.cascade()

    # ------------------------------------------------------------------ get and prefetch

    def get_now(self, handle: TensorHandle) -> torch.Tensor | cf.Future[torch.Tensor]:
        """The tensor if it is ready now, else a future that resolves to it.

        A caller that receives a future must call :meth:`consumed` after it resolves.

        Raises:
            TensorReleasedError: the handle was released or belongs to another store.
            CorruptTensorError: the spilled copy was found corrupt earlier.
            TensorModifiedError: the tensor was changed after put.
            StoreClosedError: the store is closed.
        """
        with self.lock:
            self._check_open()
            self.drain_dropped()
            e = self.handles.lookup(self.table.entries, handle)
            if e.got_in == self.sweep:
                # Asked for again: a new sweep (a retain_graph backward). The walk starts
                # afresh if it passed over entries as got below this one, which the new
                # sweep will need.
                self.sweep += 1
                lowest, self._lowest_passed_got = self._lowest_passed_got, None
                if lowest is not None and lowest < e.key:
                    self.walk.restart()
            e.got_in = self.sweep
            e.held_back = False  # asked for after all: later sweeps bring it back ahead
            self.walk.cursor = e.key
            result = read_now(self, e)
            self.plan_prefetch()
            self.end_of_sweep()
            return result

    def consumed(self, handle: TensorHandle, t: torch.Tensor) -> None:
        """Record that a get which waited on a future has taken ``t`` (in the getter's thread)."""
        hand_over(t)  # the caller's stream waits for the copy (no-op on the CPU)
        with self.lock:
            self.counters.gets += 1
            e = self.table.entries.get(handle.key)
            if e is not None and e.state is S.FETCHED and e.fetched is t:
                self.consume(e)
            self.plan_prefetch()
            self.end_of_sweep()

    def end_of_sweep(self) -> None:
        """Hand the read pool's free buffers back once every read older than the last get has
        its buffer (Note: [A finished sweep hands its buffers back]): a fetch still running
        may not have taken one yet, and would map a new buffer for what was just unmapped."""
        pool = self.read_pool
        if pool.mapped_bytes > SWEEP_KEEP_BYTES and self._swept() and not self.table.fetching:
            pool.shrink()

    def _swept(self) -> bool:
        """Whether the last get reached the oldest entry: its walk did, or, with prefetching
        off (no walk runs), no live entry is older than it."""
        if self.walk.exhausted:
            return True
        cursor, live = self.walk.cursor, self.table.live_keys
        return (
            self.config.prefetch_bytes == 0
            and cursor is not None
            and (not live or live[0] >= cursor)
        )

    def consume(self, e: Entry) -> None:
        """The caller holds the fetched copy now: the entry returns to its home tier.

        Keeping the fetched copy would pin it on the device after backward is done with it
        (a ``retain_graph`` run would bring everything back).
        """
        self.table.set_copy(e, "fetched", None)
        e.fetch_future = None
        self.table.set_state(e, e.home())

    def start_fetch(self, e: Entry, fut: cf.Future[torch.Tensor] | None = None) -> None:
        """Begin bringing ``e`` back: for the get waiting on ``fut``, or as a prefetch (None).

        A prefetch makes no future: most are consumed after they finish, and a future (with
        its condition and lock) per prefetched tensor was a large part of the Python a small
        put and get cost. The first get that finds the fetch still running makes one.
        """
        self.table.set_state(e, S.FETCHING)
        e.fetch_future = fut
        e.prefetched = fut is None
        self.handoff.fetch(e)

    def prefetch_now(self, handles: Iterable[TensorHandle]) -> None:
        """Start bringing these entries back, newest first, within the prefetch window."""
        with self.lock:
            self._check_open()
            self.drain_dropped()
            wanted = [self.handles.lookup(self.table.entries, h) for h in handles]
            for e in wanted:
                e.held_back = False
            budget = self.config.prefetch_bytes - self.table.window
            sizes = ((e.key, e.nbytes) for e in wanted if e.needs_fetch())
            for key in newest_first_within(sizes, budget, self.table.window == 0):
                self.start_fetch(self.table.entries[key])

    def hold_back_now(self, handles: Iterable[TensorHandle]) -> None:
        """Leave these entries where they rest until a get asks for them; drop the copies
        brought back ahead for them (Note: [Held back])."""
        with self.lock:
            self._check_open()
            self.drain_dropped()
            held = [self.handles.lookup(self.table.entries, h) for h in handles]
            for e in held:
                e.held_back = True
                self.drop_prefetched(e)
            self.plan_prefetch()  # the window room they held goes to others

    def drop_prefetched(self, e: Entry) -> None:
        """Drop the copy of a held-back entry brought back ahead, if no get waits for it."""
        if e.held_back and e.state is S.FETCHED and e.fetch_future is None:
            assert e.fetched is not None
            discard(e.fetched)  # an upload nobody took (Note: [Copy ordering on an accelerator])
            self.consume(e)

    def plan_prefetch(self) -> None:
        """Bring back the entries just older than the cursor, newest first (Note: [Resumable
        prefetch walk])."""
        if self.closed:
            return
        entries = self.table.entries
        budget = self.config.prefetch_bytes - self.table.window
        empty = self.table.window == 0
        for key in self.walk.plan(self.table.live_keys, self._fetch_size, budget, empty):
            self.start_fetch(entries[key])

    def _fetch_size(self, key: int) -> int | None:
        """Note: [Got once a sweep]
        Backward does not unpack in exactly the reverse order of saving: a get for an
        entry newer than the last one moves the cursor up, and the walk restarts there.
        It passed entries backward had already read, back on disk after their gets, and
        fetched them again for nothing (a small Llama read 10 % more than it wrote, each
        such copy holding window room until its release). An entry already got in this
        sweep is not fetched ahead; a second get of one begins a new sweep, as the next
        backward of a ``retain_graph`` graph does, and the walk starts afresh from it if it
        passed over entries as got below it (resumed, it would stay below them). Only then: a
        storage saved by several nodes is got once per node in a ``retain_graph`` backward,
        and a restart at each of those gets rescanned the window (not linear).
        """
        e = self.table.entries[key]
        if e.held_back:
            return None
        if e.got_in == self.sweep:
            if self._lowest_passed_got is None or key < self._lowest_passed_got:
                self._lowest_passed_got = key
            return None
        if e.needs_fetch():
            return e.nbytes
        return PENDING if e.moving_down() else None

    # ------------------------------------------------------------------ release

    def release(self, handle: TensorHandle) -> None:
        """Release the handle's entry now (idempotent for handles of this store).

        Raises:
            TypeError: ``handle`` is not a :class:`TensorHandle`.
            TensorReleasedError: the handle belongs to another store.
        """
        check_handle(handle)
        with self.lock:
            self.drain_dropped()
            if handle._owner == self.handles.token and (
                handle._released or not self.handles.is_live(self.table.entries, handle)
            ):
                # Released already; or a finalizer's release of a handle the collector is
                # freeing, whose weakref died first and queued its entry's release.
                return
            e = self.handles.lookup(self.table.entries, handle)
            handle._released = True
            self._release(e)

    def release_later(self, handle: TensorHandle) -> None:
        """Release the handle's entry as a dropped handle's is, soon: for a call made while
        this thread holds the lock (Note: [A call from inside the store]).

        Raises:
            TypeError: ``handle`` is not a :class:`TensorHandle`.
            TensorReleasedError: the handle belongs to another store.
        """
        check_handle(handle)
        if handle._owner != self.handles.token:
            raise TensorReleasedError(
                f"{handle!r} is not in this store (another store's handle, or one made "
                "before a fork)"
            )
        if not handle._released:
            handle._released = True
            self.handles.drop(handle.key)

    def _release(self, e: Entry) -> None:
        self.counters.releases += 1
        if self.table.release(e):
            self.plan_prefetch()
        # Backward drops a tensor read back before the entry it came from: the last ones of a
        # sweep are free by the time their entries go.
        self.end_of_sweep()

    def drain_dropped(self) -> None:
        """Release the entries of handles dropped since the last call (the lock held)."""
        dropped, entries = self.handles.dropped, self.table.entries
        while dropped:
            item = dropped.popleft()
            e = entries.get(item if isinstance(item, int) else item.key)
            if e is not None:
                self._release(e)

    def _drain_dropped_soon(self) -> None:
        with self.lock:
            self.drain_dropped()

    def _watch_dropped(self) -> None:
        """Poll for dropped handles while entries exist, every ``DROPPED_POLL_SECONDS`` from
        now on (the lock held; Note: [Release from a finalizer] in _handles.py)."""
        backed_off = self._poll_every > DROPPED_POLL_SECONDS
        self._poll_every = DROPPED_POLL_SECONDS
        if not self._polling_dropped or backed_off:
            start = not self._polling_dropped
            self._polling_dropped = True
            with contextlib.suppress(RuntimeError):  # the loop is closed: so is the store
                self.loop.call_soon_threadsafe(
                    self._poll_dropped if start else self._poll_dropped_sooner
                )

    def _poll_dropped_sooner(self) -> None:
        """The poll backed off while the store idled: bring the next one forward."""
        with self.lock:
            timer = self._poll_timer
            if timer is not None and timer.when() - self.loop.time() > DROPPED_POLL_SECONDS:
                timer.cancel()
                self._poll_timer = self.loop.call_later(self._poll_every, self._poll_dropped)

    def _poll_dropped(self) -> None:
        # An idle store backs off, doubling the wait up to DROPPED_POLL_MAX_SECONDS while
        # nothing is dropped: a loop woken 50 times a second for a tensor held for the night
        # costs CPU, and every call drains anyway. A put or a drain resets it.
        drained = False
        try:
            if self.handles.dropped:  # read without the lock: most ticks find nothing
                with self.lock:
                    drained = True
                    self.drain_dropped()
        finally:  # a drain that raised must not end the polling
            with self.lock:
                if self.table.entries and not self.closed:
                    self._poll_every = (
                        DROPPED_POLL_SECONDS
                        if drained
                        else min(2 * self._poll_every, DROPPED_POLL_MAX_SECONDS)
                    )
                    self._poll_timer = self.loop.call_later(self._poll_every, self._poll_dropped)
                else:
                    self._polling_dropped, self._poll_timer = False, None

    def _spill_freed(self, key: int, footprint: int) -> None:
        if not self.closed:  # at close the engine deletes every file at once
            self.disk.deleting += footprint
            self.handoff.delete(key, footprint)

    def _check_open(self) -> None:
        if self.closed:
            raise StoreClosedError("this store is closed; create a new one")

    # ------------------------------------------------------------------ queries

    def entry_of(self, handle: TensorHandle) -> Entry:
        """The live entry of ``handle`` (``tierstore.testing``).

        Raises:
            TensorReleasedError: released, or another store's handle.
        """
        with self.lock:
            return self.handles.lookup(self.table.entries, handle)

    def state_of(self, handle: TensorHandle) -> TensorState:
        """The entry's state (RELEASED once released).

        Raises:
            TypeError: ``handle`` is not a :class:`TensorHandle`.
            TensorReleasedError: another store's handle.
        """
        check_handle(handle)
        with self.lock:
            self.drain_dropped()
            if handle._released and handle._owner == self.handles.token:
                return S.RELEASED
            return self.handles.lookup(self.table.entries, handle).state

    def tier_of(self, handle: TensorHandle) -> Tier:
        """Where the entry's bytes are: the tier a get would read them from.

        Raises:
            TypeError: ``handle`` is not a :class:`~tierstore.TensorHandle`.
            TensorReleasedError: released, or another store's handle.
            CorruptTensorError, TensorModifiedError: the entry failed (its bytes were
                damaged on disk, or the tensor was written after ``put``); the error a
                ``get`` raises.
        """
        check_handle(handle)
        with self.lock:
            self.drain_dropped()
            e = self.handles.lookup(self.table.entries, handle)
            if e.state is S.FAILED:
                raise e.failure()  # Note: [A failed entry raises a copy]
            if e.fetched is not None or e.data is not None:
                return Tier.DEVICE
            if e.host is not None:
                return Tier.HOST
            return Tier.DISK

    def stats(self) -> StoreStats:
        """A frozen snapshot of the store."""
        with self.lock:
            self.drain_dropped()
            return self._snapshot_locked()

    def _snapshot_locked(self) -> StoreStats:
        capacities = {
            Tier.DEVICE: self.config.device_bytes,
            Tier.HOST: self.config.host_bytes,
            Tier.DISK: self.disk.capacity,
        }
        return self.counters.snapshot(
            tier_stats(self.table, capacities),
            live_entries=len(self.table.entries),
            inflight_bytes=self.semaphore.inflight,
            disk_available=self.disk.recheck(),
            table=self.table,
        )

    def step_stats(self, step: int | None, *, end: bool) -> StepStats:
        """The step so far, numbered ``step`` (default: one more than the last); with
        ``end``, the next step starts now, its counts and peaks from here."""
        with self.lock:
            self.drain_dropped()
            now = self._snapshot_locked()
            result = self.steps.stats(now, self.table, step)
            if end:
                self.steps.advance(now, self.table, result.step)
            return result

    def waiting(self, kind: Literal["get", "put"]) -> contextlib.AbstractContextManager[None]:
        """Count the time the block takes as a ``get`` or ``put`` waiting (also when it
        raises)."""
        return self.counters.waiting(kind, self.lock)

    def note_skipped(self, reason: str, nbytes: int) -> None:
        """Count a tensor an adapter chose not to store, under ``reason``."""
        with self.lock:
            self.counters.skipped[reason] += 1
            self.counters.skipped_bytes[reason] += nbytes

    # ------------------------------------------------------------------ close

    def begin_close(self) -> bool:
        """Refuse new work; return False if the store was already closed."""
        with self.lock:
            if self.closed:
                return False
            self.closed = True
            self.semaphore.close()
            return True

    async def finish_close(self, timeout: float) -> None:
        """Let in-flight I/O end (cancel it after ``timeout`` seconds), then delete everything."""
        await self.handoff.finish(timeout)
        await self.tear_down()

    async def tear_down(self) -> None:
        """Drop every entry, close the engine and delete the spill directories.

        Run on the store's loop by :meth:`finish_close`, or alone on another loop once the
        store's own loop has closed and nothing can be in flight on it any more.
        """
        with self.lock:
            self.drain_dropped()  # handles dropped before the close: released, as stats() shows
            self.final_stats = self._snapshot_locked()
            summary = self.final_stats.summary()
            self.table.drop_all()
            if self._retry_timer is not None:
                self._retry_timer.cancel()
        # The closed store object may live on (a caller's reference): its free read buffers,
        # up to the pool's keep_bytes, go now; busy ones when their tensors die.
        self.read_pool.clear()
        # Copies up from pinned pieces may still run on the device: the pieces go back to
        # torch's pinned cache with the pool, and must not be reused before they end.
        self.pinned.synchronize()
        try:
            if self.disk.engine is not None:
                await self.disk.engine.close()
        finally:
            self.disk_tier.remove()
        log.info("%s", summary)

    def forget_after_fork(self) -> None:
        """In a forked child: drop everything without touching the parent's files or locks."""
        self.closed = True
        self.table.entries.clear()
        self.disk_tier.forget()
        if self.disk.engine is not None:
            self.disk.engine.forget_after_fork()
        self.disk.engine = None
