"""The pinned pool: the host tier's page-locked memory, allocated once and carved into buffers.

Note: [The pinned pool]
    Copies between an accelerator and host memory run asynchronously only from page-locked
    memory, and pinning is expensive and scarce: each ``pin_memory`` allocation is a driver
    call, PyTorch's own pinned cache rounds every request up to a power of two and never gives
    memory back, and WSL caps pinned memory at 1-2 GB. So the store pins a region that grows
    in large pieces as the host tier fills, up to ``TIERSTORE_HOST_BYTES`` (Note: [Pinned as
    needed, in power-of-two pieces]), and cuts page-aligned buffers out of it with a first-fit
    allocator. Page alignment lets the disk engine
    write from and read into a buffer with ``O_DIRECT``, without a bounce copy.

    A buffer is a ``ctypes`` array over its pages, wrapped by ``torch.frombuffer``; every
    storage made from it holds the array until the storage dies, views included. When the last
    one goes, a finalizer queues the pages for reuse (a deque: the finalizer may run in any
    thread, even one inside ``take``), and the next ``take`` returns them to the free list.
    A copy the accelerator still runs holds no Python reference, so a buffer that a
    host-to-device copy reads is kept busy until that copy's event has completed
    (:meth:`PinnedPool.hold`), as PyTorch's caching host allocator does with recorded events.

    If pinning a piece fails, that piece and every later one are pageable memory, with one
    warning: copies from them are then synchronous and slower, but correct.

Note: [Staging room in the pinned pool]
    Every accelerator tensor reaches the disk through host memory: the cascade copies it into
    the host tier, counting the copy against ``host_bytes``, and spills the oldest host entries
    once the tier is over. A pool of exactly ``host_bytes`` is full whenever the tier is, and
    with ``host_bytes=0`` always, so those copies fell back to pageable memory: a copy into
    pageable memory is synchronous, so it stalled the store's loop thread, which submits the
    disk I/O, for the whole copy, and the buffer is not page-aligned, so its ``O_DIRECT`` write
    needed a bounce copy as well. (On an H100 machine GPU tensors reached the disk at half the
    rate CPU tensors did through the same store; that this was the cause has not been measured
    on a GPU yet.) The store therefore sizes its pool at ``host_bytes`` plus the in-flight
    window (``TIERSTORE_MAX_INFLIGHT_BYTES``, 256 MiB by default), which bounds the bytes being
    copied down at once. Reads of accelerator tensors from disk use the same room, each buffer
    only until its copy to the device has ended (with ``host_bytes=0`` they too went through
    pageable memory before). The pool still pins only what is used.
"""

from __future__ import annotations

import bisect
import collections
import ctypes
import logging
import mmap
import os
import threading
import weakref
from typing import Any

import torch

from tierstore._fork_safe_lock import ForkSafeLock
from tierstore._stats import format_size
from tierstore.tiers import _accelerator

__all__ = ["PinnedPool"]

log = logging.getLogger("tierstore")

_PAGE = mmap.PAGESIZE
_FIRST_PIECE = 64 << 20
_warned_pageable = False
_warn_lock = ForkSafeLock()


def _pages(nbytes: int) -> int:
    return max(1, -(-nbytes // _PAGE))


class PinnedPool:
    """Page-aligned host buffers cut from one region of ``capacity`` bytes, pinned if possible.

    Args:
        capacity: the most bytes the region grows to, pinned piece by piece as
            :meth:`take` needs them; at most the machine's memory. 0 disables the pool:
            every :meth:`take` returns None.

    Thread-safe. The region lives as long as the pool and every buffer taken from it.
    """

    def __init__(self, capacity: int) -> None:
        # More than the machine has cannot be pinned, nor is it needed ("unlimited").
        capacity = min(capacity, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        self.capacity = capacity // _PAGE * _PAGE
        self._lock = threading.Lock()
        self._regions: list[Any] = []
        self._starts: list[int] = []
        self._addresses: list[int] = []
        self.pinned: bool | None = None
        """True while every piece is pinned, False once pinning one failed, None before any."""
        # Free extents as (first page, page count), sorted by first page.
        self._free: list[tuple[int, int]] = []
        self._freed: collections.deque[tuple[int, int]] = collections.deque()
        self._held: list[tuple[Any, torch.Tensor]] = []
        self.used_bytes = 0
        """Bytes of buffers taken and not yet returned."""

    def pieces(self) -> list[tuple[int, int]]:
        """``(address, bytes)`` of each piece of the region (none before the first take)."""
        with self._lock:
            return [
                (address, (self._starts[i + 1] - self._starts[i]) * _PAGE)
                for i, address in enumerate(self._addresses)
            ]

    def _grow(self, pages: int) -> bool:
        """Add a piece that can hold ``pages`` (under the lock); False if capacity forbids.

        Note: [Pinned as needed, in power-of-two pieces]
            The region grows piece by piece as buffers are taken, each piece as large as
            everything pinned before it (at least 64 MiB and the request), so the pool pins
            at most about twice what the store has used at its peak (fragmentation aside),
            never the whole ``host_bytes`` up front: with ``host_bytes="unlimited"`` that
            would try to lock all of the machine's memory, and PyTorch keeps what it pinned
            cached, out of the OS's reach, even when a later piece fails. Each piece is a
            power of two pages, because PyTorch's pinned allocator rounds every request up to
            one (24 GiB asked would lock 32). A buffer never straddles two pieces.
        """
        have = self._starts[-1] if self._starts else 0
        room = self.capacity // _PAGE - have
        want = max(have, _FIRST_PIECE // _PAGE, pages)
        size = 1 << (want - 1).bit_length()
        while size > room:
            size >>= 1
        if size < pages:
            return False
        # Once a piece failed to pin, later ones are pageable without trying again.
        pinned = _pinned_piece(size, have) if self.pinned is not False else None
        self.pinned = pinned is not None
        piece: tuple[Any, int, int]
        if pinned is not None:
            piece = pinned
        else:
            region = mmap.mmap(-1, size * _PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            piece = (region, ctypes.addressof(ctypes.c_char.from_buffer(region)), size)
        # Pieces are numbered into one page space; extents never cross a piece's end.
        owner, address, count = piece
        if not self._starts:
            self._starts.append(0)
        self._regions.append(owner)
        self._addresses.append(address)
        self._starts.append(have + count)
        if count:
            self._insert(have, count)
        return count >= pages

    def take(
        self, nbytes: int, *, lead: int = 0, span: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A free buffer of ``span`` bytes (default ``nbytes``), or None when none fits.

        Returns:
            ``(window, data)``, as ``ReadPool.take``: ``window`` is the whole buffer from its
            first page, ``data`` the ``nbytes`` at ``lead`` as a tensor whose storage is
            exactly those bytes. Either keeps the buffer busy while it lives. None when the
            pool is disabled, or full (for the moment: buffers come back as their tensors
            die and their copies end); the caller then uses ordinary memory.

        Raises:
            ValueError: ``lead + nbytes`` does not fit in ``span``.
        """
        span = nbytes if span is None else span
        if lead < 0 or lead + nbytes > span:
            raise ValueError(f"{nbytes} bytes at lead {lead} do not fit in a span of {span}")
        if self.capacity == 0:
            return None
        pages = _pages(span)
        with self._lock:
            self._reap()
            first = self._carve(pages)
            if first is None and self._grow(pages):
                first = self._carve(pages)
            if first is None:
                return None
            self.used_bytes += pages * _PAGE
        piece = bisect.bisect_right(self._starts, first) - 1
        address = self._addresses[piece] + (first - self._starts[piece]) * _PAGE
        block = (ctypes.c_uint8 * (pages * _PAGE)).from_address(address)
        # The finalizer holds the pool weakly (buffers may outlive it) and the region strongly:
        # the array only points into it, and a buffer in use must never be unmapped.
        weakref.finalize(block, _give_back, weakref.ref(self), first, pages, self._regions)
        window = torch.frombuffer(block, dtype=torch.uint8, count=span)
        if lead == 0 and nbytes == span:
            return window, window
        return window, torch.frombuffer(block, dtype=torch.uint8, count=nbytes, offset=lead)

    def hold(self, t: torch.Tensor, event: Any) -> None:
        """Keep ``t`` (and the buffer under it) alive until ``event`` has completed."""
        with self._lock:
            self._held.append((event, t))

    def _reap(self) -> None:
        """Drop holds whose events completed; return freed buffers to the free list."""
        if self._held:
            self._held = [(ev, t) for ev, t in self._held if not ev.query()]
        while self._freed:
            first, pages = self._freed.popleft()
            self.used_bytes -= pages * _PAGE
            self._insert(first, pages)

    def _carve(self, pages: int) -> int | None:
        for i, (first, count) in enumerate(self._free):
            if count >= pages:
                if count == pages:
                    del self._free[i]
                else:
                    self._free[i] = (first + pages, count - pages)
                return first
        return None

    def _insert(self, first: int, pages: int) -> None:
        """Return an extent to the free list, merged with its neighbours in the same piece."""
        piece = bisect.bisect_right(self._starts, first) - 1
        lo, hi = self._starts[piece], self._starts[piece + 1]
        i = bisect.bisect_left(self._free, (first, 0))
        if i < len(self._free) and first + pages == self._free[i][0] < hi:
            pages += self._free.pop(i)[1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == first > lo:
            first, pages = self._free[i - 1][0], self._free[i - 1][1] + pages
            del self._free[i - 1]
            i -= 1
        self._free.insert(i, (first, pages))

    def free_bytes(self) -> int:
        """Bytes not taken now (after returning what has come back)."""
        with self._lock:
            self._reap()
            return self.capacity - self.used_bytes

    def synchronize(self) -> None:
        """Wait for every held copy to end and drop the holds (at close)."""
        with self._lock:
            held, self._held = self._held, []
        for event, _ in held:
            event.synchronize()


def _pinned_piece(pages: int, have: int) -> tuple[torch.Tensor, int, int] | None:
    """``(owner, first page address, usable pages)`` of ``pages`` pinned pages, or None if
    pinning failed (warned once per process; ``have`` pages were pinned before)."""
    global _warned_pageable
    try:
        t = _accelerator.pinned_empty(pages * _PAGE)
    except RuntimeError as exc:
        with _warn_lock:
            warn, _warned_pageable = not _warned_pageable, True
        if warn:
            log.warning(
                "tierstore: pinning %s more of host memory failed (%s; %s was pinned before); "
                "the host tier uses pageable memory from now on, so copies between the "
                "accelerator and the host are synchronous and slower. Lower "
                "TIERSTORE_HOST_BYTES or raise the locked-memory limit (ulimit -l). "
                "(warned once)",
                format_size(pages * _PAGE),
                exc,
                format_size(have * _PAGE),
            )
        return None
    start = -(-t.data_ptr() // _PAGE) * _PAGE
    return t, start, (t.data_ptr() + pages * _PAGE - start) // _PAGE


def _give_back(
    pool_ref: weakref.ref[PinnedPool], first: int, pages: int, regions: list[Any]
) -> None:
    pool = pool_ref()
    if pool is not None:
        pool._freed.append((first, pages))
