"""The read pool: reusable page-aligned host buffers that CPU tensors read back from disk land in.

Note: [Buffers come back when the last tensor goes]
    ``get`` hands its caller a tensor the caller owns, so a read cannot go into a buffer the store
    keeps. But fresh memory is slow: it page-faults as it is filled, about ten times slower than
    memory used before (docs/architecture.md, "Lifetime and cleanup"). Each buffer here is an
    anonymous ``mmap``; ``take`` wraps it in a new ``memoryview`` and makes its tensors from that
    view with ``torch.frombuffer``, and every storage made so holds a reference to the view until
    the storage dies, views of the tensors included. When the last one dies the view dies, and a
    weak reference's callback puts the buffer on its size's free list, in whatever thread dropped
    it. So a tensor still in use is never overwritten, and ``take`` and ``shrink`` cost the same
    however many buffers callers hold (scanning every buffer for its reference count, as the
    pool once did, cost a read-back 1 MiB tensor tens of microseconds once callers held a few
    hundred). Buffers are page-aligned, so O_DIRECT reads land in them directly.

Note: [A finished sweep hands its buffers back]
    Free buffers still count in the process's memory. Kept through a whole step they cost the
    memory a read-back saves: with ``tierstore.checkpoint`` the peak of a training step comes
    at the end of backward, in the recompute of the first layer, when every parameter's
    gradient exists and torch's own checkpoint holds nothing but that layer's input. A pool
    still holding the buffers of the later layers' inputs there made the store's peak higher
    than torch's by those buffers. So when a backward sweep has nothing left to read (the
    store calls :meth:`ReadPool.shrink`), the free buffers are unmapped, all but
    ``SWEEP_KEEP_BYTES`` of small ones: a loop that reads one small tensor at a time keeps
    reusing its buffer. Within a sweep nothing changes: buffers cycle through the window, and
    only the first touch of each is paid again in the next step (a window per step, not the
    bytes read).

Note: [Small buffers share huge pages]
    Memory the process has never touched costs the kernel a fault and a page of zeros per
    4 KiB: 0.33-0.35 CPU-s/GB here, most of what reading 1 MiB tensors cost, since the sweep's
    end unmaps the buffers and the next sweep touches new ones. A 2 MiB transparent huge page
    comes in one fault, at about 0.09 CPU-s/GB, but only in a 2 MiB-aligned range of a
    mapping of at least that size, so buffers of 2 MiB and more ask for huge pages and smaller
    ones could not. Buffers of ``SLAB_MIN_PIECE`` up to 1 MiB whose size divides 2 MiB are
    therefore pieces of a 2 MiB slab mapped with ``MADV_HUGEPAGE``: each piece is a
    ``memoryview`` slice that is taken, freed and trimmed like a buffer of its own, and the
    slab is unmapped when its last piece is let go (``mapped_bytes`` counts pieces, so a slab
    with a piece still in use counts less than it maps). The price is memory: a touched slab is
    2 MiB resident however few of its pieces are in use, so a lone 512 KiB read holds four
    times its bytes until it is dropped, which is why smaller buffers keep maps of their own.
    Freed pieces are taken before fresh ones and a slab is mapped only when its size has no
    fresh piece left, so at most one slab per size holds pieces never used: a training step
    whose layer inputs are 1 MiB peaked 2-3 MiB higher, within the noise of one run
    (docs/performance.md, "Small tensors").

    Linux from 6.7 places every anonymous mapping of 2 MiB or more on a 2 MiB boundary; older
    kernels place it on any page, where a slab would hold no huge page at all and a bigger
    buffer one fewer than it could. A mapping that lands off the boundary is made again 2 MiB
    larger and cut at the boundary: the part never touched costs address space, not memory.
"""

from __future__ import annotations

import ctypes
import mmap
import threading
import weakref
from collections import deque

import torch

__all__ = ["ReadPool"]

_PAGE = mmap.PAGESIZE
_HUGE = 2 << 20
SLAB_MIN_PIECE = 512 << 10
"""The smallest buffer cut from a huge-page slab; smaller ones get maps of their own (Note:
[Small buffers share huge pages])."""
SWEEP_KEEP_BYTES = 1 << 20
"""Free bytes :meth:`ReadPool.shrink` keeps by default (Note: [A finished sweep hands its
buffers back])."""
MAX_BUFFERS = 8192
"""Buffers a pool maps at most. Each is a mapping of its own, and Linux allows a process
65,530 by default (``vm.max_map_count``); adjacent ones usually merge, but a caller holding
many small tensors read back should not be the one that makes torch's next allocation fail."""


def _new_map(size: int) -> mmap.mmap:
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if size >= _HUGE and hasattr(mmap, "MADV_HUGEPAGE"):
        # Where transparent huge pages are "madvise", this makes the first touch of memory
        # freed moments before (as the forward's spilled activations are) several times
        # cheaper. Memory a VM's host had taken back (free page reporting) comes in slower
        # with huge pages than without; a pool maps new buffers only in its first round, so
        # that case is left to pay. docs/benchmarks.md has the figures.
        m.madvise(mmap.MADV_HUGEPAGE)
    return m


def _address(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def _new_huge(size: int) -> memoryview:
    """``size`` bytes (2 MiB or more) from a 2 MiB boundary, where huge pages can back every
    2 MiB of them (Note: [Small buffers share huge pages])."""
    whole = memoryview(_new_map(size))
    if _address(whole) % _HUGE == 0:
        return whole
    whole.release()
    wider = memoryview(_new_map(size + _HUGE))
    start = -_address(wider) % _HUGE
    cut = wider[start : start + size]
    wider.release()
    return cut


def _unmap(buffer: mmap.mmap | memoryview) -> None:
    """Unmap a free buffer: a map of its own, or a slab's piece (the slab is unmapped once all
    its pieces are let go)."""
    if isinstance(buffer, memoryview):
        buffer.release()
    else:
        buffer.close()


class _Lease(weakref.ref[memoryview]):
    """A weak reference to the view a taken buffer's tensors hold; its death frees the buffer.

    One object per busy buffer besides the view: the garbage collector walks each of them in
    every full collection, and small tensors read back can number thousands.
    """

    __slots__ = ("buffer", "busy", "free")
    # Identity, not the referent's hash: a writable memoryview has none.
    __hash__ = object.__hash__
    __eq__ = object.__eq__

    buffer: mmap.mmap | memoryview
    free: deque[mmap.mmap | memoryview] | _Unmapper
    busy: set[_Lease]


class _Unmapper:
    """Where the buffers of a cleared pool go when their tensors die: unmapped at once."""

    @staticmethod
    def append(buffer: mmap.mmap | memoryview) -> None:
        _unmap(buffer)


_UNMAPPER = _Unmapper()


def _handed_back(lease: _Lease) -> None:
    # Runs wherever the last tensor died, perhaps in a thread holding the pool's lock (inside
    # a garbage collection): no lock here, and both operations are atomic under the GIL.
    lease.busy.discard(lease)
    lease.free.append(lease.buffer)


def _tensors(
    view: memoryview, nbytes: int, lead: int, span: int
) -> tuple[torch.Tensor, torch.Tensor]:
    window = torch.frombuffer(view, dtype=torch.uint8, count=span)
    if lead == 0 and nbytes == span:
        return window, window
    # frombuffer with an offset gives a storage that starts at ``lead``: the data's own bytes.
    return window, torch.frombuffer(view, dtype=torch.uint8, count=nbytes, offset=lead)


class ReadPool:
    """Page-aligned host buffers, reused once no tensor refers to them; those of 512 KiB and
    1 MiB (from 512 KiB up, the sizes dividing 2 MiB) are cut from huge-page slabs (Note:
    [Small buffers share huge pages]).

    Args:
        keep_bytes: when a new buffer has to be mapped, free buffers beyond this many bytes
            are unmapped first. Until then, buffers freed by their tensors stay mapped for
            reuse: after a caller held many tensors read back at once and dropped them, the
            pool keeps that much memory until the next read needs a buffer of a new size,
            :meth:`shrink` (which the store calls when a backward sweep ends) or ``clear``.
            In training, backward drops each tensor soon after it comes back, so the pool
            stays near the prefetch window.
    """

    def __init__(self, keep_bytes: int, max_buffers: int = MAX_BUFFERS) -> None:
        self.keep_bytes = keep_bytes
        self.max_buffers = max_buffers
        # Free buffers by page-rounded size, the most recently freed last.
        self._free: dict[int, deque[mmap.mmap | memoryview]] = {}
        # Never-used pieces of huge-page slabs, by size (Note: [Small buffers share huge pages]).
        self._fresh: dict[int, deque[memoryview]] = {}
        # The leases of busy buffers: a weak reference's callback fires only while it lives.
        self._busy: set[_Lease] = set()
        self._lock = threading.Lock()
        self.buffers = 0
        self.mapped_bytes = 0
        self.reused = 0
        self.created = 0

    def take(
        self, nbytes: int, *, lead: int = 0, span: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A free page-aligned buffer of ``span`` bytes (default ``nbytes``), as two tensors.

        Returns:
            ``(window, data)``, or ``None`` when no buffer of that size is free and
            ``max_buffers`` are in use (free ones of other sizes are unmapped to make room;
            the caller allocates plainly then). ``window`` is the whole buffer from its first
            page: what a disk read fills (Note: [A tensor's lead]). ``data`` is the ``nbytes``
            at ``lead``, a tensor whose storage is exactly those bytes
            (``storage_offset() == 0``), so nothing else in the buffer can be reached through
            it. Either keeps the buffer busy while it lives.

        Raises:
            ValueError: ``lead + nbytes`` does not fit in ``span``.
        """
        span = nbytes if span is None else span
        if lead < 0 or lead + nbytes > span:
            raise ValueError(f"{nbytes} bytes at lead {lead} do not fit in a span of {span}")
        size = max(_PAGE, -(-span // _PAGE) * _PAGE)
        with self._lock:
            free = self._free.setdefault(size, deque())
            fresh = self._fresh.get(size)
            m: mmap.mmap | memoryview
            if free:
                m = free.pop()
                self.reused += 1
            elif fresh:
                m = fresh.pop()
                self.created += 1
            else:
                # A slab of pieces where the size fits one (Note: [Small buffers share huge
                # pages]), otherwise a map of its own.
                slab = SLAB_MIN_PIECE <= size < _HUGE and _HUGE % size == 0
                pieces = _HUGE // size if slab else 1
                self._trim(self.keep_bytes - pieces * size, self.max_buffers - pieces)
                if self.buffers + pieces > self.max_buffers:
                    return None
                if slab:
                    whole = _new_huge(_HUGE)
                    slots = [whole[i * size : (i + 1) * size] for i in range(pieces)]
                    whole.release()
                    m = slots.pop(0)
                    self._fresh.setdefault(size, deque()).extend(slots)
                else:
                    m = _new_huge(size) if size >= _HUGE else _new_map(size)
                self.buffers += pieces
                self.mapped_bytes += pieces * size
                self.created += 1
            view = memoryview(m)
            lease = _Lease(view, _handed_back)
            lease.buffer, lease.free, lease.busy = m, free, self._busy
            self._busy.add(lease)
        return _tensors(view, nbytes, lead, span)

    def shrink(self, keep_free: int = SWEEP_KEEP_BYTES) -> int:
        """Unmap free buffers, largest first, until at most ``keep_free`` bytes of free ones
        are left (Note: [A finished sweep hands its buffers back]).

        Returns:
            The bytes unmapped.
        """
        with self._lock:
            before = self.mapped_bytes
            free = sum(size * len(maps) for size, maps in self._free.items())
            free += sum(size * len(slots) for size, slots in self._fresh.items())
            if free > keep_free:
                self._trim(self.mapped_bytes - free + keep_free)
            return before - self.mapped_bytes

    def _trim(self, limit: int, max_buffers: int | None = None) -> None:
        """Unmap free buffers, largest first, while more than ``limit`` bytes or more than
        ``max_buffers`` buffers are mapped."""
        most = self.buffers if max_buffers is None else max_buffers
        for size in sorted(set(self._free) | set(self._fresh), reverse=True):
            for free in (self._fresh.get(size), self._free.get(size)):
                while free and (self.mapped_bytes > limit or self.buffers > most):
                    _unmap(free.popleft())  # the longest free first
                    self.buffers -= 1
                    self.mapped_bytes -= size

    def clear(self) -> None:
        """Unmap every free buffer now, and every busy one when its tensors die."""
        with self._lock:
            free, fresh, busy = self._free, self._fresh, self._busy
            self._free, self._fresh, self._busy = {}, {}, set()
            self.buffers = 0
            self.mapped_bytes = 0
            # A tensor dying on another thread hands its buffer back without the lock
            # (``_handed_back``): from now on to the unmapper, and until then into the free
            # lists, which are emptied one buffer at a time (iterating one while another
            # thread appended raised "deque mutated during iteration", and the store's close
            # failed with it).
            for lease in list(busy):
                lease.free = _UNMAPPER
            for maps in free.values():
                while maps:
                    _unmap(maps.popleft())
            for slots in fresh.values():
                while slots:
                    _unmap(slots.popleft())
