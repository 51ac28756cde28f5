"""The entries: one per stored tensor, and the table that keeps them with the bytes each tier
holds. Every method runs under the store's lock."""

from __future__ import annotations

import bisect
import contextlib
import heapq
import logging
from typing import TYPE_CHECKING, Any, Literal

from tierstore._state import TRANSIT, TensorState, Tier, transition
from tierstore.core._checks import change_of, changed_error, version_of
from tierstore.errors import StoreClosedError, TensorModifiedError
from tierstore.tiers._device import discard

if TYPE_CHECKING:
    import concurrent.futures as cf
    from collections.abc import Callable, Iterator

    import torch

    from tierstore.core._handles import HandleRef
    from tierstore.errors import TierStoreError

__all__ = ["WINDOW", "Copy", "Entry", "EntryTable", "in_order"]

log = logging.getLogger("tierstore")

S = TensorState
WINDOW = frozenset({S.FETCHING, S.FETCHED})
"""States whose bytes count against the prefetch window."""

Copy = Literal["data", "host", "fetched"]
"""The in-memory copies of an entry: on its device, in the host tier, fetched back."""
_COPY_TIER: dict[str, Tier] = {"data": Tier.DEVICE, "host": Tier.HOST, "fetched": Tier.DEVICE}


class Entry:
    """One stored tensor. Fields other than ``state`` are its copies; which exist says where."""

    __slots__ = (
        "address",
        "data",
        "device",
        "disk",
        "dtype",
        "error",
        "fetch_future",
        "fetched",
        "got_in",
        "handle_ref",
        "held_back",
        "host",
        "kept",
        "key",
        "movable",
        "nbytes",
        "on_cpu",
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
        device = self.device = t.device
        self.on_cpu = device.type == "cpu"
        """On the CPU the host tier holds the tensor itself: moving it there is no copy."""
        self.nbytes = t.numel() * t.element_size()
        self.movable = movable
        self.state = S.DEVICE
        self.version = version_of(t)
        """The version counter of the tensor the store holds, when that is the caller's
        (Note: [Writes after put])."""
        self.address: int | None = t.data_ptr()
        """Where the bytes of the tensor the store holds lie, when that is the caller's: a
        storage freed and allocated again moves them and keeps the version."""
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
        self.got_in = -1
        """The backward sweep whose get last asked for it (Note: [Got once a sweep])."""
        self.held_back = False
        """The caller has this tensor at hand: not brought back ahead of a get (Note: [Held
        back])."""
        self.ready: Any = None
        """On an accelerator, the event put recorded on the caller's stream."""
        self.stream: Any = None
        """The stream current when the tensor was put: where autograd runs the backward that
        will get it, so a fetch allocates its copy there (Note: [Copy ordering on an
        accelerator]). None on the CPU."""
        self.error: BaseException | None = None
        self.handle_ref: HandleRef | None = None
        self.kept = False
        """Counted in ``kept_no_room`` already: the cascade meets it at every pass while
        the disk has no room, and it counts once."""

    def describe(self) -> str:
        shape = "x".join(str(s) for s in self.shape) or "scalar"
        dtype = str(self.dtype).removeprefix("torch.")
        return f"tensor #{self.key} ({shape} {dtype} from {self.device}, {self.nbytes} bytes)"

    def home(self) -> TensorState:
        """The resting state a fetched or fetching entry returns to."""
        return S.DISK if self.disk else S.HOST

    def failure(self) -> BaseException:
        """A fresh copy of the error this entry failed with, for one caller to raise.

        Note: [A failed entry raises a copy]
            Raising an exception stores the traceback of the raise in it, and the traceback's
            frames hold the caller's handle. Raising the error the entry keeps would tie the
            handle to the entry, which the store holds: the handle could never die, so the
            entry would never be released, and every get would lengthen the traceback. So
            each raise gets a fresh copy with the same message and cause.
        """
        err = self.error
        assert err is not None
        fresh = type(err)(*err.args)
        fresh.__cause__ = err.__cause__
        return fresh

    def moving_down(self) -> bool:
        """Whether it is on its way to where a prefetch would fetch it from: spilling, or an
        accelerator tensor being copied to host memory."""
        return self.state is S.MOVING_TO_DISK or (
            self.state is S.MOVING_TO_HOST and not self.on_cpu
        )

    def needs_fetch(self) -> bool:
        """Whether a prefetch would bring it closer: on disk, or an accelerator tensor in host
        memory."""
        return self.state is S.DISK or (self.state is S.HOST and not self.on_cpu)


class EntryTable:
    """The live entries, by key and in key order, what each tier holds, and how entries end.

    Args:
        spill_freed: told the key and footprint of each spill whose entry is gone, so that
            its space is freed.

    Attributes:
        entries: the live entries by key.
        live_keys: their keys, ascending (oldest first).
        used: bytes each tier holds, copies in flight into it included.
        count: copies each tier holds.
        resting: movable bytes resting where the cascade may move them from (DEVICE, HOST).
        host_reserved: host bytes of device-to-host copies in flight, taken from the host
            tier's room as soon as a copy starts, not when it lands.
        window: bytes of fetched and fetching copies (the prefetch window's use).
        fetching: bytes of entries being fetched.
        total_entries, total_bytes: copies and bytes ever placed in each tier.
        peak, step_peak: the most bytes each tier held at once, since the table was made and
            since :meth:`start_step`.
        off_device: bytes of entries whose only copies are in the host tier or on disk, each
            entry counted once (Note: [Off the device]); ``peak_off_device`` and
            ``step_peak_off_device`` are its peaks.
        offloaded: bytes of entries that moved from the device into the host tier, each
            entry counted once.
        in_transit: released or failed entries whose I/O is still finishing; their bytes
            still count until the task moving them frees them.
    """

    def __init__(self, spill_freed: Callable[[int, int], None]) -> None:
        self._spill_freed = spill_freed
        self.entries: dict[int, Entry] = {}
        self.live_keys: list[int] = []
        self.used = dict.fromkeys(Tier, 0)
        self.count = dict.fromkeys(Tier, 0)
        self.resting = {Tier.DEVICE: 0, Tier.HOST: 0}
        self.host_reserved = 0
        self.window = self.fetching = 0
        self.total_entries = dict.fromkeys(Tier, 0)
        self.total_bytes = dict.fromkeys(Tier, 0)
        self.peak = dict.fromkeys(Tier, 0)
        self.step_peak = dict.fromkeys(Tier, 0)
        self.off_device = self.peak_off_device = self.step_peak_off_device = 0
        self.offloaded = 0
        self.in_transit: set[Entry] = set()
        # Keys of entries resting in DEVICE (movable ones) and HOST, as min-heaps. A key stays
        # when its entry leaves (lazy deletion): readers skip it, it is dropped once it
        # reaches the top, and ``_push`` rebuilds a heap grown past twice the live entries.
        self._heaps: dict[Tier, list[int]] = {Tier.DEVICE: [], Tier.HOST: []}

    def add(self, e: Entry, t: torch.Tensor) -> None:
        """Add ``e``, newly put, resting on its device and holding ``t``."""
        self.set_copy(e, "data", t)
        self.entries[e.key] = e
        self.live_keys.append(e.key)
        if e.movable:
            self.resting[Tier.DEVICE] += e.nbytes
            self._push(Tier.DEVICE, e.key)

    def remove(self, e: Entry) -> None:
        """Drop ``e`` from the live entries (its copies are freed separately)."""
        del self.entries[e.key]
        del self.live_keys[bisect.bisect_left(self.live_keys, e.key)]

    def set_state(self, e: Entry, new: TensorState) -> None:
        """The one place an entry's state changes (Note: [One state, one table])."""
        old = e.state
        transition(e, new)
        if old is S.DEVICE and e.movable:
            self.resting[Tier.DEVICE] -= e.nbytes
        elif old is S.HOST:
            self.resting[Tier.HOST] -= e.nbytes
        if new is S.DEVICE and e.movable:
            self.resting[Tier.DEVICE] += e.nbytes
            self._push(Tier.DEVICE, e.key)
        elif new is S.HOST:
            self.resting[Tier.HOST] += e.nbytes
            self._push(Tier.HOST, e.key)
        if (old in WINDOW) != (new in WINDOW):
            self.window += e.nbytes if new in WINDOW else -e.nbytes
        if (old is S.FETCHING) != (new is S.FETCHING):
            self.fetching += e.nbytes if new is S.FETCHING else -e.nbytes

    def set_copy(self, e: Entry, copy: Copy, t: torch.Tensor | None) -> None:
        """Replace one of ``e``'s in-memory copies (None: drop it), counting it in its tier."""
        old = getattr(e, copy)
        if old is None and t is None:
            return  # nothing to drop: releases clear every copy, most already gone
        tier = _COPY_TIER[copy]
        was = _off_device(e)
        if old is not None:
            self._vacate(tier, e.nbytes)
        if t is not None:
            self._occupy(tier, e.nbytes)
        setattr(e, copy, t)
        if _off_device(e) is not was:
            # Dropping the device copy of an entry the host tier holds is its move down.
            self._off_device_changed(e, offload=copy == "data")

    def set_disk(self, e: Entry, footprint: int) -> None:
        """Set the spill bytes ``e`` occupies (0: none)."""
        was = _off_device(e)
        if e.disk:
            self._vacate(Tier.DISK, e.disk)
        if footprint:
            self._occupy(Tier.DISK, footprint)
        e.disk = footprint
        if _off_device(e) is not was:
            self._off_device_changed(e, offload=False)

    def _off_device_changed(self, e: Entry, *, offload: bool) -> None:
        """``e`` just went off the device, or came back (Note: [Off the device])."""
        if not _off_device(e):
            self.off_device -= e.nbytes
            return
        if offload:
            self.offloaded += e.nbytes
        off = self.off_device = self.off_device + e.nbytes
        if off > self.step_peak_off_device:
            self.step_peak_off_device = off
            self.peak_off_device = max(self.peak_off_device, off)

    def start_step(self) -> None:
        """Begin a step's peaks at what the tiers hold now: held at the boundary, held in it."""
        self.step_peak = dict(self.used)
        self.step_peak_off_device = self.off_device

    def _occupy(self, tier: Tier, nbytes: int) -> None:
        used = self.used[tier] = self.used[tier] + nbytes
        self.count[tier] += 1
        self.total_entries[tier] += 1
        self.total_bytes[tier] += nbytes
        # The step's peak never exceeds the store's: it starts from what is held now.
        if used > self.step_peak[tier]:
            self.step_peak[tier] = used
            self.peak[tier] = max(self.peak[tier], used)

    def _vacate(self, tier: Tier, nbytes: int) -> None:
        self.used[tier] -= nbytes
        self.count[tier] -= 1

    def device_peaks(self) -> tuple[int, int]:
        """The device tier's peaks, since the table was made and in this step: what
        :meth:`unput` puts back."""
        return self.peak[Tier.DEVICE], self.step_peak[Tier.DEVICE]

    def unput(self, e: Entry, peaks: tuple[int, int]) -> None:
        """Undo :meth:`add` for a put that is raising: no entry, bytes, count or peak stay
        (``peaks``: :meth:`device_peaks` before the add)."""
        self.remove(e)
        self.set_state(e, S.RELEASED)
        self.set_copy(e, "data", None)
        self.total_entries[Tier.DEVICE] -= 1
        self.total_bytes[Tier.DEVICE] -= e.nbytes
        self.peak[Tier.DEVICE], self.step_peak[Tier.DEVICE] = peaks
        # The weak reference dies with the entry, so the handle's death queues no release.
        e.handle_ref = None
        e.ready = None
        e.stream = None

    # ------------------------------------------------------------------ how entries end

    def release(self, e: Entry) -> bool:
        """End ``e``: its copies are freed now, or by the transfer moving it when that ends
        (Note: [One state, one table]); until then its bytes still count. False when it had
        ended already (failed)."""
        self.remove(e)
        if e.state in (S.RELEASED, S.FAILED):
            return False
        in_transit = e.state in TRANSIT
        self.set_state(e, S.RELEASED)
        if in_transit:
            self.in_transit.add(e)
        else:
            self.free_copies(e)
        return True

    def check_unchanged(self, e: Entry, t: torch.Tensor, *, io_done: bool = True) -> bool:
        """Whether ``t``, the caller's tensor the store holds for ``e``, is as it was put.

        If not, ``e`` fails with a :class:`~tierstore.TensorModifiedError` that says what
        changed (Note: [Writes after put]), and False is returned; ``get`` raises that error
        from then on. Its copies are freed now, or, when ``io_done`` is False, by the transfer
        still running (as for a release).
        """
        why = change_of(e, t)
        if why is None:
            return True
        self.fail(e, changed_error(e, why), io_done=io_done)
        return False

    def fail(self, e: Entry, err: TierStoreError, *, io_done: bool = True) -> None:
        """End ``e`` in FAILED with ``err``, which every later get raises.

        Logged as an error, but for a change the caller made (Note: [Writes after put]),
        logged at DEBUG: the get raises it, and an entry never read back again harms nothing.
        """
        level = logging.DEBUG if isinstance(err, TensorModifiedError) else logging.ERROR
        log.log(level, "tierstore: %s", err)
        in_transit = e.state in TRANSIT and not io_done
        self.set_state(e, S.FAILED)
        e.error = err
        if in_transit:
            # The task moving it frees what it holds when its I/O ends, as after a release.
            self.in_transit.add(e)
        else:
            self.free_copies(e)

    def free_copies(self, e: Entry) -> None:
        """Drop every copy of a released or failed entry; its spill space is freed soon.

        No heap trim here (Note: [Returning host memory]): what a release frees on the CPU is
        the tensor itself, which the caller would have freed without a store.
        """
        self.in_transit.discard(e)
        # Home copies first: dropping a device copy while a home copy is left would count the
        # entry off the device for a moment (Note: [Off the device]).
        self.set_copy(e, "host", None)
        if e.disk:
            footprint = e.disk
            self.set_disk(e, 0)
            self._spill_freed(e.key, footprint)
        self.set_copy(e, "data", None)
        if e.fetched is not None:
            discard(e.fetched)  # an upload nobody took (Note: [Copy ordering on an accelerator])
        self.set_copy(e, "fetched", None)
        e.ready = None

    def drop_all(self) -> None:
        """Forget every entry at close: waiting gets fail, fetched uploads are discarded."""
        # Entries released during their read too: close cancelled that read, and the get
        # waiting on it would wait for ever.
        for e in [*self.entries.values(), *self.in_transit]:
            if e.fetch_future is not None and not e.fetch_future.done():
                e.fetch_future.set_exception(StoreClosedError("the store was closed"))
            with contextlib.suppress(Exception):
                self.set_state(e, S.RELEASED)
            if e.fetched is not None:
                discard(e.fetched)
            e.data = e.host = e.fetched = None
            e.disk = 0
        self.entries.clear()
        self.live_keys.clear()
        self.in_transit.clear()
        self.off_device = 0

    def _push(self, tier: Tier, key: int) -> None:
        """Add ``key`` to ``tier``'s heap, rebuilding the heap from its live keys when the
        keys of entries gone outnumber them.

        Note: [Keys of entries gone]
            Keys leave a heap only from its top, and only when the cascade reads the tier,
            which it does when the tier is over its capacity. A host tier that never fills
            kept one key per put for the store's life (60,000 keys after 60,000 puts and
            releases, none live). Rebuilding once the heap holds more than twice the live
            entries (plus a few) costs O(live) every O(live) pushes.
        """
        heap = self._heaps[tier]
        heapq.heappush(heap, key)
        if len(heap) > 2 * len(self.entries) + 64:
            state = S.DEVICE if tier is Tier.DEVICE else S.HOST
            entries = self.entries
            live = {k for k in heap if (e := entries.get(k)) is not None and e.state is state}
            heap[:] = live
            heapq.heapify(heap)

    def resting_oldest_first(self, tier: Tier) -> Iterator[Entry]:
        """The entries resting in ``tier`` (movable ones on the device), oldest first.

        Reading does not change the table: the cascade plans over it, then carries out its
        plan. Keys of entries that left the tier are dropped from the top first.
        """
        state = S.DEVICE if tier is Tier.DEVICE else S.HOST
        heap = self._heaps[tier]
        entries = self.entries
        while heap:
            e = entries.get(heap[0])
            if e is not None and e.state is state:
                break
            heapq.heappop(heap)
        seen: set[int] = set()
        for key in in_order(heap):
            e = entries.get(key)
            if e is not None and e.state is state and key not in seen:
                seen.add(key)
                yield e


def _off_device(e: Entry) -> bool:
    """Whether ``e``'s bytes are off the device: only home copies (host, disk) exist.

    Note: [Off the device]
        What the store saves the device is the bytes of entries with no copy on it: in the
        host tier, on disk, or both at once while a spill runs (counted once, by the entry's
        own bytes). A fetched copy waiting for get is back on the device; once get has taken
        it the entry counts as off again, since the store holds only its home copy. A CPU
        tensor in the host tier counts too: the host tier holds the tensor itself, so on a
        CPU-only machine this is what the store moved out of the device tier, which is device
        memory wherever there is an accelerator.
    """
    return e.data is None and e.fetched is None and (e.host is not None or e.disk > 0)


def in_order(heap: list[int]) -> Iterator[int]:
    """The items of a binary min-heap, smallest first, without changing it.

    Yields ``k`` items in O(k log k): a second heap holds the frontier of the first.
    """
    if not heap:
        return
    frontier = [(heap[0], 0)]
    n = len(heap)
    while frontier:
        item, i = heapq.heappop(frontier)
        yield item
        for child in (2 * i + 1, 2 * i + 2):
            if child < n:
                heapq.heappush(frontier, (heap[child], child))
