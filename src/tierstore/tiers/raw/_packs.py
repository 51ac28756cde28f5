"""Small blobs travel together: writes gather into packs, reads of neighbours into one request.

Note: [Small blobs travel in packs]
    A request for a 64 KiB blob costs about as much Python, GIL hand-off and kernel time as
    one for 8 MiB. Blobs up to ``PACK_MAX`` that arrive in one turn of the event loop are
    therefore assembled in one bounce buffer and written as one extent with one ``pwrite``
    (group commit: while ``io_threads`` packs are in flight the open one keeps growing); each
    blob keeps its own page-aligned piece and CRC, so it is read and freed on its own. Small
    reads that arrive together are sorted by offset and neighbours are read with one
    ``pread``. A caller's blobs share one :class:`Waiter` rather than a future each: per-blob
    futures, with their callbacks and contexts, were a quarter of the objects the garbage
    collector had to walk for every spilled tensor. For the same reason a packed blob is
    recorded in one :class:`~tierstore.tiers.raw._layout.PackedBlob`, not a ``Blob`` with its
    lists, chunk and extent. docs/disk-engine.md, "Small blobs", has the figures.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tierstore.tiers._on_thread import on_thread, outlive_cancel
from tierstore.tiers.raw._layout import PackedBlob
from tierstore.tiers.raw._syscalls import pad

if TYPE_CHECKING:
    from collections.abc import Coroutine
    from concurrent.futures import Executor

    import torch

    from tierstore.tiers.raw._chunk_io import ChunkIO
    from tierstore.tiers.raw._striping import Striping

__all__ = ["PACK_MAX", "READ_GAP", "PackItem", "Packs", "ReadItem", "Waiter", "all_done"]

PACK_MAX = 1 << 20
# Blobs up to this size travel in packs; bigger ones are cut into chunks that already keep the
# threads busy.
READ_GAP = 256 << 10
# Two small blobs whose extents are at most this far apart are read with one request: reading
# a gap this size costs less than a second request.


class Waiter:
    """One caller's small requests: one future, set when the last of them has ended.

    A future per blob would cost a future, a callback and a context each (and the garbage
    collector's time for them all), for hundreds of blobs per call. Cancelling the caller
    cancels :attr:`done`, which tells the packs that nobody owns what they write for it.
    """

    __slots__ = ("done", "pending")

    def __init__(self, pending: int) -> None:
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.pending = pending
        """Requests not ended yet."""

    def finish_one(self) -> None:
        self.pending -= 1
        if self.pending == 0 and not self.done.done():
            self.done.set_result(None)


@dataclass(slots=True)
class PackItem:
    """A small blob waiting for its pack: the bytes, and then its placed record or error."""

    src: torch.Tensor
    waiter: Waiter
    address: int = 0
    """Where ``src``'s bytes were when the write was asked for."""
    blob: PackedBlob | None = None
    error: BaseException | None = None


@dataclass(slots=True)
class ReadItem:
    """A small read waiting to be grouped with its neighbours, and then its error if any."""

    blob: PackedBlob
    out: torch.Tensor
    waiter: Waiter
    error: BaseException | None = None


class Packs:
    """The open pack, the small reads asked for this turn, and the tasks writing and reading
    them (Note: [Small blobs travel in packs]).

    Args:
        io: the blocking transfers.
        striping: where a pack's extent goes.
        pool: the I/O threads.
        threads: how many packs may be written at once before the open one waits to grow.
        chunk: the most bytes one pack or one grouped read spans.
    """

    def __init__(
        self, io: ChunkIO, striping: Striping, pool: Executor, threads: int, chunk: int
    ) -> None:
        self._io = io
        self._striping = striping
        self._pool = pool
        self._threads = threads
        self._chunk = chunk
        self.max = min(PACK_MAX, chunk)
        """The largest blob that travels in a pack."""
        self._pack: list[PackItem] = []
        self._pack_bytes = 0
        self._packs_writing = 0
        self._pack_soon = False
        self._reads: list[ReadItem] = []
        self._reads_soon = False
        self._tasks: set[asyncio.Task[None]] = set()
        self.packs_written = 0
        """Packs written; tests and ``info`` read it."""
        self.grouped_reads = 0
        """Requests that read several small blobs at once."""

    def packable(self, nbytes: int) -> bool:
        return 0 < nbytes <= self.max

    async def drain(self) -> None:
        """Start what is queued and wait until no pack or read group is in flight."""
        self._start_pack()
        self._start_reads()
        while self._tasks:
            await asyncio.wait(set(self._tasks))

    # -- writes ------------------------------------------------------------------------------

    def enqueue_write(self, src: torch.Tensor, waiter: Waiter) -> PackItem:
        """Add ``src`` to the open pack; ``waiter`` hears when its piece is written."""
        # Copies of 256 KiB and more let the GIL go, and a caller's resize_(0) may run between
        # any check and the copy: Note: [A spill's source cannot be freed].
        src.numpy()
        item = PackItem(src, waiter, src.data_ptr())
        padded = pad(src.numel())
        if self._pack_bytes + padded > self._chunk:
            self._start_pack()
        self._pack.append(item)
        self._pack_bytes += padded
        if self._pack_bytes >= self._chunk:
            self._start_pack()
        elif not self._pack_soon:
            self._pack_soon = True
            asyncio.get_running_loop().call_soon(self._pack_due)
        return item

    def _pack_due(self) -> None:
        self._pack_soon = False
        if self._packs_writing < self._threads:
            self._start_pack()
        # Otherwise the open pack keeps growing until a pack in flight finishes.

    def _start_pack(self) -> None:
        if not self._pack:
            return
        items, self._pack, self._pack_bytes = self._pack, [], 0
        self._packs_writing += 1
        self._track(self._flush_pack(items))

    def _track(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _flush_pack(self, items: list[PackItem]) -> None:
        blobs: list[PackedBlob] = []
        try:
            f, offset = await self._striping.place_pack(sum(pad(it.src.numel()) for it in items))
            for it in items:
                n = it.src.numel()
                blobs.append(PackedBlob(f, offset, n))
                offset += pad(n)
            sources = [(it.src, it.address) for it in items]
            changed = await outlive_cancel(
                on_thread(self._pool, self._io.write_pack, sources, blobs)
            )
        except BaseException as exc:
            for b in blobs:
                b.free()
            for it in items:
                it.error = exc
                it.waiter.finish_one()
        else:
            self.packs_written += 1
            for it, b, error in zip(items, blobs, changed, strict=True):
                if error is not None:
                    it.error = error
                    b.free()  # its source changed: that blob alone is not written
                    it.waiter.finish_one()
                elif it.waiter.done.cancelled():
                    b.free()  # its writer was cancelled: nobody owns the blob
                else:
                    it.blob = b
                    it.waiter.finish_one()
        finally:
            self._packs_writing -= 1
            if self._pack and not self._pack_soon:
                self._pack_due()

    # -- reads -------------------------------------------------------------------------------

    def enqueue_read(self, blob: PackedBlob, out: torch.Tensor, waiter: Waiter) -> ReadItem:
        """Read ``blob`` into ``out`` with the neighbours asked for in this turn of the loop."""
        item = ReadItem(blob, out, waiter)
        self._reads.append(item)
        if not self._reads_soon:
            self._reads_soon = True
            asyncio.get_running_loop().call_soon(self._start_reads)
        return item

    def _start_reads(self) -> None:
        """Read the small reads asked for so far: neighbours on disk with one request each.

        The groups start in the order their first read was asked for, not in disk order: the
        store asks newest first (LIFO), and the tensor backward wants next must not wait
        behind a whole window of reads that happen to lie before it in the file.
        """
        self._reads_soon = False
        if not self._reads:
            return
        items, self._reads = self._reads, []
        by_place = sorted(
            range(len(items)), key=lambda i: (items[i].blob.file.fd, items[i].blob.offset)
        )
        groups: list[list[int]] = []
        group = [by_place[0]]
        for i in by_place[1:]:
            first, last = items[group[0]].blob, items[group[-1]].blob
            b = items[i].blob
            # A blob asked for twice this turn starts a group of its own: a group's scatter
            # lays out disjoint pieces in disk order, and two reads of one place are not.
            if (
                b.file is first.file
                and 0 <= b.offset - (last.offset + pad(last.size)) <= READ_GAP
                and b.offset + pad(b.size) - first.offset <= self._chunk
            ):
                group.append(i)
            else:
                groups.append(group)
                group = [i]
        groups.append(group)
        groups.sort(key=min)
        for g in groups:
            self._track(self._read_group([items[i] for i in g]))

    async def _read_group(self, items: list[ReadItem]) -> None:
        errors: list[BaseException | None]
        blobs = [it.blob for it in items]
        outs = [it.out for it in items]
        try:
            # Note: [A finished transfer holds no memory]
            errors = list(
                await outlive_cancel(on_thread(self._pool, self._io.read_span, blobs, outs))
            )
        except Exception as exc:
            if len(items) == 1:
                errors = [exc]
            else:
                # The span failed as a whole (a file cut short inside it, an unreadable
                # sector): each blob is read alone, so only those really hit fail.
                try:
                    errors = await self._read_each(blobs, outs)
                except BaseException as again:  # cancelled: every reader still hears
                    errors = [again] * len(items)
        except BaseException as exc:
            errors = [exc] * len(items)
        else:
            if len(items) > 1:
                self.grouped_reads += 1
        for it, err in zip(items, errors, strict=True):
            it.error = err
            it.waiter.finish_one()

    async def _read_each(
        self, blobs: list[PackedBlob], outs: list[torch.Tensor]
    ) -> list[BaseException | None]:
        errors: list[BaseException | None] = []
        for b, out in zip(blobs, outs, strict=True):
            error: BaseException | None
            try:
                (error,) = await outlive_cancel(
                    on_thread(self._pool, self._io.read_span, [b], [out])
                )
            except Exception as exc:
                error = exc
            errors.append(error)
        return errors


async def all_done(futures: list[asyncio.Future[Any]]) -> None:
    """Wait until every future is done; a cancelled caller cancels those still pending, and
    still waits for them before it raises ``CancelledError``, however often it is cancelled.

    Cancelling a :class:`Waiter` only detaches its caller: packs and read groups go on with
    the memory they hold, and a written blob nobody owns is freed (see ``_flush_pack``).
    """
    if not futures:
        return

    def cancel_all() -> None:
        for fut in futures:
            fut.cancel()

    # Cancelled again while the futures end, it keeps waiting: the caller would otherwise read
    # outcomes that are not there yet.
    await outlive_cancel(asyncio.gather(*futures, return_exceptions=True), cancel_all)
