"""The raw disk engine (the default): preallocated spill files, extents, O_DIRECT, striping.

Each spill directory holds one spill file, grown with ``posix_fallocate`` and carved into
page-aligned extents by a first-fit allocator. A blob is cut into chunks of
``io_chunk_bytes``, striped over the directories, and its chunks are written and read in
parallel on a dedicated pool of ``io_threads`` threads; each chunk carries a CRC32C kept in
memory (the files die with the process, so nothing on disk needs to describe itself). Small
blobs travel in packs. docs/disk-engine.md explains the design and the measurements behind
the defaults.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from tierstore.errors import ConfigError, CorruptTensorError
from tierstore.tiers._checksum import IMPLEMENTATION as CHECKSUM_IMPLEMENTATION
from tierstore.tiers._engine import DiskEngine, WriteRequest, check_bytes, is_bytes
from tierstore.tiers._on_thread import on_threads, outlive_cancel
from tierstore.tiers.raw._chunk_io import ChunkIO
from tierstore.tiers.raw._layout import LEAD_ALIGN, Blob, PackedBlob
from tierstore.tiers.raw._packs import PackItem, Packs, ReadItem, Waiter, all_done
from tierstore.tiers.raw._probe import DirectIOProbe, probe_direct_io
from tierstore.tiers.raw._spill_file import SpillFile
from tierstore.tiers.raw._striping import Striping
from tierstore.tiers.raw._syscalls import PAGE, pad

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from pathlib import Path

    import torch

    from tierstore.config import StoreConfig

    _ChunkFn = Callable[[Blob, int, memoryview, int, torch.Tensor], None]

__all__ = ["RawEngine"]

log = logging.getLogger("tierstore")


class RawEngine(DiskEngine):
    """Spill blobs into preallocated, striped, page-aligned extents (``TIERSTORE_DISK_FORMAT=raw``).

    Args:
        directories: private spill directories, one per ``TIERSTORE_DISK_DIR`` entry; chunks
            are striped across them.
        config: ``io_threads`` (default 8), ``io_chunk_bytes`` (default 8 MiB), ``direct_io``
            (``auto`` uses O_DIRECT where the filesystem takes it, otherwise buffered I/O with
            ``posix_fadvise(DONTNEED)``; ``on`` insists; ``off`` never tries) and ``checksum``
            (``crc32c`` per chunk, or ``none``).

    Raises:
        ConfigError: ``direct_io="on"`` and a directory refuses O_DIRECT.
        OSError: a spill file cannot be created.

    Example:
        >>> engine = RawEngine((spill_dir,), StoreConfig.from_env())  # doctest: +SKIP
        >>> await engine.write(1, torch.zeros(4097, dtype=torch.uint8))  # doctest: +SKIP
    """

    name = "raw"

    def __init__(self, directories: tuple[Path, ...], config: StoreConfig) -> None:
        super().__init__(directories, config)
        if not directories:
            raise ValueError("RawEngine needs at least one directory")
        self._probes = [self._detect_direct(d) for d in directories]
        fallback = [p for p in self._probes if not p.supported]
        if config.direct_io == "on" and fallback:
            raise ConfigError(
                f"direct_io/TIERSTORE_DIRECT_IO='on': {fallback[0].directory!r} refuses O_DIRECT "
                f"({fallback[0].reason}); use 'auto' to fall back to buffered I/O there, or "
                "point TIERSTORE_DISK_DIR at a filesystem that supports it"
            )
        if config.direct_io == "auto" and fallback:
            log.warning(
                "tierstore: O_DIRECT is refused in %s (%s); spilling there with buffered I/O "
                "and posix_fadvise(DONTNEED) instead",
                ", ".join(repr(p.directory) for p in fallback),
                fallback[0].reason,
            )
        self._chunk = config.io_chunk_bytes
        self._checksum = config.checksum == "crc32c"
        self._files: list[SpillFile] = []
        # Chunks stripe evenly, so each file's share of the capacity is what it reserves ahead.
        cap = config.disk_bytes
        share = None if cap is None else pad(-(-cap // len(directories)))
        try:
            for d, probe in zip(directories, self._probes, strict=True):
                self._files.append(SpillFile(d, probe.supported, share))
            self._io = ChunkIO(config.io_threads, self._chunk, self._checksum)
        except BaseException:
            self._close_files()
            raise
        # Buffered I/O takes any address; only O_DIRECT needs the pages (Note: [A tensor's lead]).
        self._leads = all(f.direct for f in self._files)
        self._blobs: dict[int, Blob | PackedBlob] = {}
        # Keys being written: a second write of one would be placed too and leak its space.
        self._writing: set[int] = set()
        self._pool = ThreadPoolExecutor(config.io_threads, thread_name_prefix="tierstore-io")
        self._striping = Striping(self._files, self._chunk, self._pool)
        self._packs = Packs(self._io, self._striping, self._pool, config.io_threads, self._chunk)
        self._closed = False

    def _detect_direct(self, directory: Path) -> DirectIOProbe:
        if self.config.direct_io == "off":
            return DirectIOProbe(str(directory), False, "direct_io/TIERSTORE_DIRECT_IO='off'")
        return probe_direct_io(directory)

    # -- what tests and ``info`` may look at ---------------------------------------------------

    @property
    def files(self) -> tuple[SpillFile, ...]:
        """The spill file of each directory, in order."""
        return tuple(self._files)

    def layout(self, key: int) -> Blob | PackedBlob:
        """Where the bytes of ``key`` lie.

        Raises:
            KeyError: nothing is stored under ``key``.
        """
        return self._blobs[key]

    def holds(self, key: int) -> bool:
        """Whether something is stored under ``key``."""
        return key in self._blobs

    @property
    def packs_written(self) -> int:
        """Packs written (Note: [Small blobs travel in packs])."""
        return self._packs.packs_written

    @property
    def grouped_reads(self) -> int:
        """Requests that read several small blobs at once."""
        return self._packs.grouped_reads

    async def drain(self) -> None:
        """Wait until no pack or grouped read is in flight."""
        await self._packs.drain()

    # -- the contract ------------------------------------------------------------------------

    def footprint(self, nbytes: int) -> int:
        """Bytes of disk a blob of ``nbytes`` may occupy: its pages, padded to whole pages.

        A big blob written straight from a tensor 64 bytes past a page spans one page more
        than its size (Note: [A tensor's lead]); the figure allows for it.
        """
        extra = PAGE if self._leads and nbytes > self._packs.max else 0
        return pad(nbytes) + extra

    def read_window(self, key: int, nbytes: int) -> tuple[int, int]:
        """``(lead, span)``: pass :meth:`read` a page-aligned ``out`` of ``span`` bytes to read
        ``key`` without a copy; its bytes then sit at ``out[lead : lead + nbytes]``.

        See Note: [A tensor's lead]. A key this engine does not hold, a small blob, or any blob
        where I/O is buffered (it takes any address) gives ``(0, nbytes)``: the plain read.
        """
        blob = self._blobs.get(key)
        if self._leads and isinstance(blob, Blob) and blob.size == nbytes:
            return blob.window()
        return 0, nbytes

    def reusable_bytes(self) -> int:
        """Free extents inside the spill files (space of deleted blobs, growth not yet used)."""
        return sum(f.extents.free_bytes for f in self._files)

    def placeable_bytes(self) -> int:
        """The longest free extent in any spill file: each directory's share of a blob is
        placed in one extent."""
        return max((f.extents.largest() for f in self._files), default=0)

    async def write(self, key: int, src: torch.Tensor, **description: object) -> None:
        """Store ``src`` (1-D contiguous uint8, CPU) under ``key``; see :class:`DiskEngine`.

        A small blob joins the open pack (Note: [Small blobs travel in packs]). The bytes are
        all the engine keeps: a ``dtype`` or ``shape`` in ``description`` is ignored.
        """
        if not self._joins_pack(key, src):
            await self._write_alone(key, src)
            return
        (outcome,) = await self.write_many([WriteRequest(key, src)])
        if outcome is not None:
            raise outcome

    async def read(self, key: int, out: torch.Tensor) -> None:
        """Fill ``out`` with the bytes of ``key``; see :class:`DiskEngine`.

        ``out`` holds exactly the blob's size, or the whole span :meth:`read_window` gives, in
        which case the bytes land at its lead and the rest of ``out`` is scratch.

        Raises:
            KeyError: nothing is stored under ``key``.
            CorruptTensorError: ``out`` has the wrong size, a checksum does not match, or the
                spill file was truncated.
        """
        if not self._joins_group(key, out):
            await self._read_alone(key, out)
            return
        (error,) = await self.read_many([(key, out)])  # read with its neighbours
        if error is not None:
            raise error

    async def write_many(self, requests: Sequence[WriteRequest]) -> list[BaseException | None]:
        """Store several blobs; small ones join packs without a coroutine each.

        See :meth:`DiskEngine.write_many`.
        """
        self._check_open()
        waiter = Waiter(0)
        waits: list[asyncio.Future[Any]] = [waiter.done]
        slots: list[PackItem | asyncio.Future[None]] = []
        packed: list[int] = []
        for r in requests:
            if self._joins_pack(r.key, r.src):
                self._writing.add(r.key)
                packed.append(r.key)
                waiter.pending += 1
                slots.append(self._packs.enqueue_write(r.src, waiter))
            else:
                fut = asyncio.ensure_future(self._write_alone(r.key, r.src))
                waits.append(fut)
                slots.append(fut)
        if not waiter.pending:
            waiter.done.set_result(None)
        try:
            await all_done(waits)
        finally:
            self._writing.difference_update(packed)
            # Also when cancelled: what was written stays stored under its key.
            outcomes: list[BaseException | None] = []
            for r, slot in zip(requests, slots, strict=True):
                if isinstance(slot, PackItem):
                    if slot.blob is not None:
                        self._blobs[r.key] = slot.blob
                        outcomes.append(None)
                    else:
                        outcomes.append(slot.error or asyncio.CancelledError())
                else:
                    cancelled = slot.cancelled()
                    outcomes.append(asyncio.CancelledError() if cancelled else slot.exception())
        return outcomes

    async def read_many(
        self, requests: Sequence[tuple[int, torch.Tensor]]
    ) -> list[BaseException | None]:
        """Fill several outputs; small blobs are read in groups without a coroutine each.

        See :meth:`DiskEngine.read_many`.
        """
        self._check_open()
        waiter = Waiter(0)
        waits: list[asyncio.Future[Any]] = [waiter.done]
        slots: list[ReadItem | asyncio.Future[None]] = []
        for key, out in requests:
            if self._joins_group(key, out):
                waiter.pending += 1
                blob = self._blobs[key]
                assert isinstance(blob, PackedBlob)
                slots.append(self._packs.enqueue_read(blob, out, waiter))
            else:  # big blobs, and requests _read_alone refuses with the right error
                fut = asyncio.ensure_future(self._read_alone(key, out))
                waits.append(fut)
                slots.append(fut)
        if not waiter.pending:
            waiter.done.set_result(None)
        await all_done(waits)
        # Nothing was cancelled: all_done raised then.
        return [slot.error if isinstance(slot, ReadItem) else slot.exception() for slot in slots]

    async def delete(self, key: int) -> None:
        """Free the extents of ``key`` for reuse (a missing key is ignored)."""
        blob = self._blobs.pop(key, None)
        if blob is not None:
            blob.free()

    async def delete_many(self, keys: Sequence[int]) -> list[BaseException | None]:
        """Free the extents of several keys (missing keys are ignored); no I/O, no task each."""
        for key in keys:
            blob = self._blobs.pop(key, None)
            if blob is not None:
                blob.free()
        return [None] * len(keys)

    async def close(self) -> None:
        """Wait for the I/O threads, close and remove the spill files (idempotent)."""
        if self._closed:
            return
        self._closed = True
        await self._packs.drain()
        await asyncio.get_running_loop().run_in_executor(None, self._pool.shutdown, True)
        self._blobs.clear()
        self._close_files()
        self._io.close()

    def forget_after_fork(self) -> None:
        """In a forked child: close the spill files' descriptors; the files stay the parent's."""
        for f in self._files:
            f.forget_in_child()

    def describe(self) -> dict[str, object]:
        """Direct I/O per directory, chunking, threads and checksum, for ``tierstore info``."""
        return {
            "format": self.name,
            "directories": [str(d) for d in self.directories],
            "direct_io": {p.directory: p.supported for p in self._probes},
            "direct_io_reason": {p.directory: p.reason for p in self._probes},
            "io_threads": self.config.io_threads,
            "io_chunk_bytes": self._chunk,
            "checksum": CHECKSUM_IMPLEMENTATION if self._checksum else "none",
            "packed_blob_bytes": self._packs.max,
        }

    # -- blobs written and read alone ------------------------------------------------------

    def _joins_pack(self, key: int, src: torch.Tensor) -> bool:
        return (
            key not in self._blobs
            and key not in self._writing
            and is_bytes(src)
            and self._packs.packable(src.numel())
        )

    def _joins_group(self, key: int, out: torch.Tensor) -> bool:
        blob = self._blobs.get(key)
        return isinstance(blob, PackedBlob) and is_bytes(out) and out.numel() == blob.size

    async def _write_alone(self, key: int, src: torch.Tensor) -> None:
        """Write ``src`` as a blob of its own, in chunks (Note: [A tensor's lead])."""
        self._check_open()
        if key in self._blobs or key in self._writing:
            raise KeyError(f"key {key} is already stored; delete it first")
        check_bytes(src, "src")
        self._writing.add(key)
        try:
            lead = src.data_ptr() % PAGE if self._leads else 0
            blob = await self._striping.place(src.numel(), lead if lead % LEAD_ALIGN == 0 else 0)
            try:
                await self._run(self._io.write_chunk, blob, src)
            except BaseException:
                blob.free()
                raise
            self._blobs[key] = blob
        finally:
            self._writing.discard(key)

    async def _read_alone(self, key: int, out: torch.Tensor) -> None:
        """Read a blob written alone, chunk by chunk; refuse a request :meth:`read` refuses."""
        self._check_open()
        blob = self._blobs[key]
        check_bytes(out, "out")
        if out.numel() != blob.size and out.numel() != self.read_window(key, blob.size)[1]:
            raise CorruptTensorError(
                f"key {key}: {blob.size} bytes were spilled but {out.numel()} were asked for"
            )
        assert isinstance(blob, Blob)  # a packed blob of the right size joins a group
        await self._run(self._io.read_chunk, blob, out)

    async def _run(self, fn: _ChunkFn, blob: Blob, t: torch.Tensor) -> None:
        """Run ``fn`` for every chunk of ``blob`` on the I/O threads; ``t`` is the memory the
        chunks move from or to."""
        address = t.data_ptr()
        # numpy shares the tensor's memory; an empty tensor gives an empty view.
        # Note: [A spill's source cannot be freed]
        view = t.numpy().data.cast("B")
        # Note: [A finished transfer holds no memory] and Note: [One wake-up a blob]
        calls = [(blob, i, view, address, t) for i in range(len(blob.chunks))]
        if not calls:
            return
        # Wait for every chunk even when one fails or the caller is cancelled: the extents may
        # be freed, and the tensor reused, only once no thread still touches them.
        errors = await outlive_cancel(on_threads(self._pool, fn, calls))
        first = next((exc for exc in errors if exc is not None), None)
        del errors
        if first is not None:
            try:
                raise first
            finally:
                del first  # nor the error: its traceback holds this frame

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the disk engine is closed")

    def _close_files(self) -> None:
        for f in self._files:
            f.close()
        self._files.clear()
