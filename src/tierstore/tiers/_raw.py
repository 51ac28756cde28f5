"""The raw disk engine (the default): preallocated spill files, extents, O_DIRECT, striping.

Each spill directory holds one spill file, grown with ``posix_fallocate`` and carved into
page-aligned extents by a first-fit allocator. A blob is cut into chunks of
``io_chunk_bytes``; chunk ``i`` goes to directory ``(first + i) % len(directories)``, so a big
tensor keeps every disk busy. Chunks are written and read in parallel on a dedicated pool of
``io_threads`` threads with ``os.pwrite``/``os.preadv``; each chunk carries a CRC32C kept in
memory (the files die with the process, so nothing on disk needs to describe itself).
``docs/disk-engine.md`` explains the design and the measurements behind the defaults.

Note: [True size and padded size]
    O_DIRECT moves whole pages from page-aligned memory, so a chunk of ``length`` bytes
    occupies ``_pad(lead + length)`` bytes on disk (``lead``: Note: [A tensor's lead]). The
    blob record keeps the true length of every chunk; only the extent allocator sees the
    padded size, the checksum covers exactly the true bytes, and a read hands back exactly the
    true bytes. Padding written through a bounce buffer is zeros; padding written straight
    from a tensor's pages is whatever shared those pages with it (below). Neither is ever
    returned as data.

Note: [A tensor's lead]
    torch CPU tensors are 64-byte aligned, usually 64 bytes past a page, and this disk's
    O_DIRECT takes only memory aligned to 512 bytes. Copying every chunk into an aligned
    buffer first cost 14-30% of the write speed on the development machine (docs/
    benchmarks.md). So a big blob whose address is ``lead`` bytes past a page (a multiple of
    64) is laid out on disk as the pages its memory spans: its first chunk starts ``lead``
    bytes into its extent, every chunk boundary falls on a page of the tensor's memory, and
    each chunk is written straight from those pages, including the bytes before the tensor
    in its first page and after it in its last. Those bytes are read, never written, and
    every page touched holds some of the tensor, so it is mapped for as long as the caller
    keeps the tensor alive. The spill file is private to the process (0600 in a 0700
    directory) and removed when the engine closes.

    A read writes whole pages too. ``read_window`` tells the caller the lead and the page
    span; a caller that passes a page-aligned buffer of the whole span (the store's read
    pool) gets every chunk read straight into it and the bytes at ``lead``. A caller that
    passes exactly the blob's size gets exactly those bytes written: chunks whose pages lie
    inside ``out`` go straight in, the others through a bounce buffer.

Note: [Bounce buffers]
    A chunk that cannot move straight between the file and the caller's memory (an address
    that is not 64 bytes past a page, or a read whose pages reach outside ``out``) goes
    through one of ``io_threads`` page-aligned bounce buffers (mmap), allocated once when the
    engine opens. Copies and checksums run through ``ctypes`` calls, which release the GIL,
    so the I/O threads work in parallel.

Note: [Small blobs travel in packs]
    A request for a 64 KiB blob costs about as much Python, GIL hand-off and kernel time as
    one for 8 MiB. Blobs up to ``_PACK_MAX`` that arrive in one turn of the event loop are
    therefore assembled in one bounce buffer and written as one extent with one ``pwrite``
    (group commit: while ``io_threads`` packs are in flight the open one keeps growing); each
    blob keeps its own page-aligned piece and CRC, so it is read and freed on its own. Small
    reads that arrive together are sorted by offset and neighbours are read with one
    ``pread``. A caller's blobs share one :class:`_Waiter` rather than a future each: per-blob
    futures, with their callbacks and contexts, were a quarter of the objects the garbage
    collector had to walk for every spilled tensor. For the same reason a packed blob is
    recorded in one :class:`_Packed` object, not a :class:`_Blob` with its lists, chunk and
    extent. ``docs/disk-engine.md`` has the figures.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import ctypes
import errno
import logging
import mmap
import os
import queue
import secrets
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tierstore._libc import libc_function
from tierstore.errors import ConfigError, CorruptTensorError, TensorModifiedError
from tierstore.tiers._checksum import IMPLEMENTATION as CHECKSUM_IMPLEMENTATION
from tierstore.tiers._checksum import crc32c
from tierstore.tiers._engine import DiskEngine, WriteRequest
from tierstore.tiers._memcopy import memmove, memset, prefault

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from tierstore.config import StoreConfig

__all__ = ["SPILL_FILE", "DirectIOProbe", "RawEngine", "probe_direct_io"]

log = logging.getLogger("tierstore")

PAGE = 4096
"""Alignment of every file offset, extent length and O_DIRECT buffer."""

SPILL_FILE = "spill.raw"
"""Name of the spill file inside each private spill directory."""

_GROW_MIN = 64 << 20
_GROW_MAX = 1 << 30
# The file grows by doubling, from 64 MiB up to steps of 1 GiB: few fallocate calls for a big
# spill, little unused reservation for a small one. Near a full disk it grows by exactly what
# the blob needs before giving up with ENOSPC.

_O_DIRECT: int = getattr(os, "O_DIRECT", 0)

_PACK_MAX = 1 << 20
# Blobs up to this size travel in packs (Note: [Small blobs travel in packs]); bigger ones are
# cut into chunks that already keep the threads busy.
_LEAD_ALIGN = 64
# A blob is written straight from its pages only when its address is a multiple of this past
# a page (Note: [A tensor's lead]): its read-back copy then lands at the same place in a page,
# so it is never less aligned than torch's own CPU allocations.
_READ_GAP = 256 << 10
# Two small blobs whose extents are at most this far apart are read with one request: reading
# a gap this size costs less than a second request.


def _pad(nbytes: int) -> int:
    return -(-nbytes // PAGE) * PAGE


def _memory(address: int, nbytes: int) -> memoryview:
    """A view of ``nbytes`` of memory at ``address``; the caller keeps the memory alive.

    ctypes keeps one array type per length; the lengths here are whole pages up to one chunk
    (at most 2048 of them with the default 8 MiB chunks).
    """
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")


@dataclass(frozen=True, slots=True)
class DirectIOProbe:
    """Whether O_DIRECT works in one directory, as :func:`probe_direct_io` found."""

    directory: str
    """The directory probed."""
    supported: bool
    """An O_DIRECT open, ``posix_fallocate``, page write and page read all succeeded."""
    reason: str
    """Why not (the OS error), or ``"ok"``."""


def probe_direct_io(directory: Path) -> DirectIOProbe:
    """Do in ``directory``, on a scratch file, what the engine will do with O_DIRECT.

    The file is opened with O_DIRECT, grown with ``posix_fallocate`` as a spill file is, and
    a page is written and read back. Some filesystems (ramfs) refuse the open; others accept
    it and fail on the first transfer. Where the filesystem has no ``fallocate`` (ext2), glibc
    emulates it by writing a byte into each block, which O_DIRECT refuses (EINVAL): there the
    open and a page of I/O succeed, but the engine could never grow a spill file. A full disk
    (ENOSPC, EDQUOT) cannot tell, and does not count against O_DIRECT.

    Never raises: a directory where the scratch file cannot be made (read-only, a path too
    long) is reported as not supporting O_DIRECT, with the reason. The scratch file is removed.
    """
    if not _O_DIRECT:
        return DirectIOProbe(str(directory), False, "this platform has no O_DIRECT")
    path = os.path.join(directory, f".tierstore-probe-{os.getpid()}-{secrets.token_hex(4)}")
    buf = mmap.mmap(-1, PAGE)
    fd = -1
    step = "opening a file with O_DIRECT"
    made = True
    try:
        try:
            fd = os.open(
                path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _O_DIRECT, 0o600
            )
        except FileExistsError:
            made = False  # someone else's file: never remove it
            raise
        step = "growing it with posix_fallocate"
        os.posix_fallocate(fd, 0, 2 * PAGE)
        step = "writing and reading a page"
        view = memoryview(buf)
        try:
            os.pwrite(fd, view, 0)
            os.preadv(fd, [view], 0)
        finally:
            view.release()
    except OSError as e:
        if fd >= 0 and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return DirectIOProbe(str(directory), True, f"ok (no space to test {step})")
        return DirectIOProbe(str(directory), False, f"{step}: {e.strerror} (errno {e.errno})")
    finally:
        if fd >= 0:
            os.close(fd)
        if made:
            # ramfs makes the file before it refuses the flag; a read-only filesystem or a
            # path too long for the kernel never made it, and says so with its own errno.
            with contextlib.suppress(OSError):
                os.unlink(path)
        buf.close()
    return DirectIOProbe(str(directory), True, "ok")


class _Extents:
    """First-fit allocator of page-aligned extents inside one file.

    Free extents are kept sorted by offset and coalesced with their neighbours on free, so
    space a deleted blob leaves is found again by the next blob that fits.
    """

    def __init__(self) -> None:
        self._offsets: list[int] = []
        self._lengths: list[int] = []
        self._lock = threading.Lock()  # the loop thread and a growing I/O thread both use it
        self.size = 0
        """Bytes the file has been grown to."""
        self.free_bytes = 0

    def alloc(self, nbytes: int) -> int | None:
        with self._lock:
            return self._alloc(nbytes)

    def free(self, offset: int, nbytes: int) -> None:
        with self._lock:
            self._free(offset, nbytes)

    def _alloc(self, nbytes: int) -> int | None:
        for i, length in enumerate(self._lengths):
            if length >= nbytes:
                offset = self._offsets[i]
                if length == nbytes:
                    del self._offsets[i], self._lengths[i]
                else:
                    self._offsets[i] += nbytes
                    self._lengths[i] -= nbytes
                self.free_bytes -= nbytes
                return offset
        return None

    def _free(self, offset: int, nbytes: int) -> None:
        i = bisect.bisect_left(self._offsets, offset)
        if i > 0 and self._offsets[i - 1] + self._lengths[i - 1] == offset:
            i -= 1
            self._lengths[i] += nbytes
        else:
            self._offsets.insert(i, offset)
            self._lengths.insert(i, nbytes)
        end = self._offsets[i] + self._lengths[i]
        if i + 1 < len(self._offsets) and end == self._offsets[i + 1]:
            self._lengths[i] += self._lengths[i + 1]
            del self._offsets[i + 1], self._lengths[i + 1]
        self.free_bytes += nbytes


class _SpillFile:
    """One spill file: its descriptor, whether it is open with O_DIRECT, and its extents."""

    def __init__(self, directory: Path, direct: bool) -> None:
        self.path = directory / SPILL_FILE
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        self.fd = os.open(self.path, flags | (_O_DIRECT if direct else 0), 0o600)
        if not direct:
            # Reads are whole chunks already; readahead would only pull neighbouring extents
            # into the page cache, which spilling is meant to empty.
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_RANDOM)
        self.direct = direct
        self.extents = _Extents()
        self.grow_lock = threading.Lock()
        self.full = False
        """The last growth failed with ENOSPC/EDQUOT (Note: [A full directory is skipped])."""
        self.warned_full = False

    def free_space(self) -> int:
        """Bytes the filesystem of this file's directory has free for this user."""
        try:
            st = os.statvfs(self.path.parent)
        except OSError:
            return 0
        return st.f_bavail * st.f_frsize

    def grow_and_alloc(self, nbytes: int) -> int | None:
        """Grow the file if it still lacks ``nbytes`` free, then allocate them (on an I/O thread).

        Note: [One growth for many waiting writers]
            Many writers can find the file full at once (the store keeps hundreds of small
            writes in flight). Each one lands here, but under ``grow_lock`` only the first
            grows; the others find the new space and allocate from it. Without this check
            every writer doubled the file, and a benchmark filled an 80 GB disk.

        Raises:
            OSError: ENOSPC (or another errno) when the filesystem cannot give the space; the
                file is left at its old size.
        """
        with self.grow_lock:
            offset = self.extents.alloc(nbytes)
            if offset is not None:
                return offset
            old = self.extents.size
            step = min(max(old, _GROW_MIN), _GROW_MAX)
            for amount in dict.fromkeys((max(_pad(nbytes), step), _pad(nbytes))):
                try:
                    os.posix_fallocate(self.fd, old, amount)
                except OSError as e:
                    # A failed fallocate may leave blocks reserved past the old end.
                    with contextlib.suppress(OSError):
                        os.ftruncate(self.fd, old)
                    if e.errno != errno.ENOSPC or amount == _pad(nbytes):
                        raise OSError(
                            e.errno,
                            f"growing {self.path} by {amount} bytes: {e.strerror}",
                            str(self.path),
                        ) from e
                    continue
                self.extents.size = old + amount
                self.extents.free(old, amount)
                break
            # None only if the loop thread took the new space first; the caller tries again.
            return self.extents.alloc(nbytes)


@dataclass(frozen=True, slots=True)
class _Chunk:
    """One chunk of a blob and where it lives."""

    file: _SpillFile
    """The spill file (so the directory) holding it."""
    offset: int
    """Page-aligned offset in that file."""
    start: int
    """Offset of the chunk's first byte in the blob."""
    length: int
    """True length in bytes; the chunk occupies ``_pad(lead + length)`` on disk."""
    lead: int = 0
    """Bytes before the chunk's data in its extent (the blob's lead, first chunk only)."""


@dataclass(slots=True)
class _Blob:
    """Where one key's bytes live: its extents (one per directory used) and its chunks."""

    size: int
    extents: list[tuple[_SpillFile, int, int]]
    chunks: list[_Chunk]
    crcs: list[int]
    lead: int = 0
    """Bytes of the first page before the data (Note: [A tensor's lead])."""


class _Packed:
    """Where a small blob lives: its own page-aligned piece of a pack's extent, and its CRC.

    One object where a :class:`_Blob` takes six (the record, its lists, chunk and extent): a
    spill of thousands of small tensors keeps one alive per tensor, and the garbage
    collector's full collections walk every one of them (Note: [Small blobs travel in packs]).
    """

    __slots__ = ("crc", "file", "offset", "size")

    def __init__(self, file: _SpillFile, offset: int, size: int) -> None:
        self.file = file
        self.offset = offset
        """Page-aligned offset in ``file``; the blob occupies ``_pad(size)`` bytes there."""
        self.size = size
        self.crc = 0

    @property
    def chunks(self) -> list[_Chunk]:
        """The one chunk, as a :class:`_Blob` describes its chunks (made on demand)."""
        return [_Chunk(self.file, self.offset, 0, self.size)]

    @property
    def extents(self) -> list[tuple[_SpillFile, int, int]]:
        """The one extent, as a :class:`_Blob` describes its extents (made on demand)."""
        return [(self.file, self.offset, _pad(self.size))]


class _BounceBuffer:
    """A page-aligned buffer of one chunk, reused for every unaligned O_DIRECT transfer."""

    def __init__(self, nbytes: int) -> None:
        # Private, not the default shared mapping: shared anonymous memory is shmem, which
        # /proc/meminfo counts as page cache ("Cached"), and it would be inherited on fork.
        self._map = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._anchor = ctypes.c_char.from_buffer(self._map)
        self.address = ctypes.addressof(self._anchor)
        self.view = memoryview(self._map)

    def close(self) -> None:
        self.view.release()
        del self._anchor
        # A traceback still holding a slice keeps the map exported; the GC unmaps it later.
        with contextlib.suppress(BufferError):
            self._map.close()


_SYNC_FILE_RANGE = libc_function(
    "sync_file_range", [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint], ctypes.c_int
)
# SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER
_SYNC_WAIT_WRITE_WAIT = 1 | 2 | 4


def _drop_cached(fd: int, offset: int, nbytes: int, *, dirty: bool) -> None:
    """Keep buffered spill I/O out of the page cache: the point of spilling is to free RAM.

    ``POSIX_FADV_DONTNEED`` only drops clean pages, so freshly written ones are first written
    back with ``sync_file_range`` (on this range only, without a journal commit).
    """
    if dirty and _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, offset, nbytes, _SYNC_WAIT_WRITE_WAIT)
    os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        n = os.pwrite(fd, view[done:], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, f"pwrite wrote nothing at offset {offset + done}")
        done += n


def _pread_all(fd: int, view: memoryview, offset: int, path: Path) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n < len(view) - done and offset + done + n >= os.fstat(fd).st_size:
            raise CorruptTensorError(
                f"spill file {str(path)!r} is truncated: it ends at "
                f"{os.fstat(fd).st_size} bytes, inside a blob at {offset}+{len(view)}"
            )
        done += n


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
                f"TIERSTORE_DIRECT_IO='on': {fallback[0].directory!r} refuses O_DIRECT "
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
        self._files: list[_SpillFile] = []
        try:
            for d, probe in zip(directories, self._probes, strict=True):
                self._files.append(_SpillFile(d, probe.supported))
        except BaseException:
            self._close_files()
            raise
        self._chunk = config.io_chunk_bytes
        self._checksum = config.checksum == "crc32c"
        # Buffered I/O takes any address; only O_DIRECT needs the pages (Note: [A tensor's lead]).
        self._leads = all(f.direct for f in self._files)
        self._blobs: dict[int, _Blob | _Packed] = {}
        self._next_dir = 0
        self._pool = ThreadPoolExecutor(config.io_threads, thread_name_prefix="tierstore-io")
        self._bounce: queue.SimpleQueue[_BounceBuffer] = queue.SimpleQueue()
        self._bounce_all: list[_BounceBuffer] = []
        # One per thread: at most io_threads transfers run at once, so get() never waits. Packs
        # are assembled in them even without O_DIRECT; untouched pages cost no memory.
        for _ in range(config.io_threads):
            buf = _BounceBuffer(self._chunk)
            self._bounce_all.append(buf)
            self._bounce.put(buf)
        self._pack_max = min(_PACK_MAX, self._chunk)
        self._pack: list[_PackItem] = []
        self._pack_bytes = 0
        self._packs_writing = 0
        self._pack_soon = False
        self._reads: list[_ReadItem] = []
        self._reads_soon = False
        self._batch_tasks: set[asyncio.Task[None]] = set()
        self.packs_written = 0
        """Packs written (Note: [Small blobs travel in packs]); tests and ``info`` read it."""
        self.grouped_reads = 0
        """Requests that read several small blobs at once."""
        self._closed = False

    def _detect_direct(self, directory: Path) -> DirectIOProbe:
        if self.config.direct_io == "off":
            return DirectIOProbe(str(directory), False, "TIERSTORE_DIRECT_IO='off'")
        return probe_direct_io(directory)

    # -- public contract -------------------------------------------------------------------

    def footprint(self, nbytes: int) -> int:
        """Bytes of disk a blob of ``nbytes`` may occupy: its pages, padded to whole pages.

        A big blob written straight from a tensor 64 bytes past a page spans one page more
        than its size (Note: [A tensor's lead]); the figure allows for it.
        """
        extra = PAGE if self._leads and nbytes > self._pack_max else 0
        return _pad(nbytes) + extra

    def read_window(self, key: int, nbytes: int) -> tuple[int, int]:
        """``(lead, span)``: pass :meth:`read` a page-aligned ``out`` of ``span`` bytes to read
        ``key`` without a copy; its bytes then sit at ``out[lead : lead + nbytes]``.

        See Note: [A tensor's lead]. A key this engine does not hold, a small blob, or any blob
        where I/O is buffered (it takes any address) gives ``(0, nbytes)``: the plain read.
        """
        blob = self._blobs.get(key)
        if self._leads and isinstance(blob, _Blob) and blob.size == nbytes:
            return blob.lead, _pad(blob.lead + blob.size)
        return 0, nbytes

    def reusable_bytes(self) -> int:
        """Free extents inside the spill files (space of deleted blobs, growth not yet used)."""
        return sum(f.extents.free_bytes for f in self._files)

    async def write(
        self,
        key: int,
        src: torch.Tensor,
        *,
        dtype: torch.dtype | None = None,
        shape: tuple[int, ...] | None = None,
    ) -> None:
        """Store ``src`` (1-D contiguous uint8, CPU) under ``key``; see :class:`DiskEngine`."""
        self._check_open()
        if key in self._blobs:
            raise KeyError(f"key {key} is already stored; delete it first")
        _check_bytes(src, "src")
        if self._packable(src.numel()):
            (outcome,) = await self.write_many([WriteRequest(key, src)])  # joins a pack
            if outcome is not None:
                raise outcome
            return
        lead = src.data_ptr() % PAGE if self._leads else 0
        blob = await self._place(src.numel(), lead if lead % _LEAD_ALIGN == 0 else 0)
        try:
            view = _byte_view(src)
            await self._run(self._write_chunk, blob, view, src)
        except BaseException:
            self._free(blob)
            raise
        self._blobs[key] = blob

    async def read(self, key: int, out: torch.Tensor) -> None:
        """Fill ``out`` with the bytes of ``key``; see :class:`DiskEngine`.

        ``out`` holds exactly the blob's size, or the whole span :meth:`read_window` gives, in
        which case the bytes land at its lead and the rest of ``out`` is scratch.

        Raises:
            KeyError: nothing is stored under ``key``.
            CorruptTensorError: ``out`` has the wrong size, a checksum does not match, or the
                spill file was truncated.
        """
        self._check_open()
        blob = self._blobs[key]
        _check_bytes(out, "out")
        if out.numel() != blob.size and out.numel() != self.read_window(key, blob.size)[1]:
            raise CorruptTensorError(
                f"key {key}: {blob.size} bytes were spilled but {out.numel()} were asked for"
            )
        if isinstance(blob, _Packed):
            (error,) = await self.read_many([(key, out)])  # read with its neighbours
            if error is not None:
                raise error
            return
        await self._run(self._read_chunk, blob, _byte_view(out), out)

    async def write_many(self, requests: Sequence[WriteRequest]) -> list[BaseException | None]:
        """Store several blobs; small ones join packs without a coroutine each.

        See :meth:`DiskEngine.write_many`.
        """
        self._check_open()
        waiter = _Waiter(0)
        waits: list[asyncio.Future[Any]] = [waiter.done]
        slots: list[_PackItem | asyncio.Future[None]] = []
        for r in requests:
            if r.key not in self._blobs and _is_bytes(r.src) and self._packable(r.src.numel()):
                waiter.pending += 1
                slots.append(self._enqueue_pack(r.src, waiter))
            else:
                fut = asyncio.ensure_future(self.write(r.key, r.src))
                waits.append(fut)
                slots.append(fut)
        if not waiter.pending:
            waiter.done.set_result(None)
        try:
            await _all_done(waits)
        finally:
            # Also when cancelled: what was written stays stored under its key.
            outcomes: list[BaseException | None] = []
            for r, slot in zip(requests, slots, strict=True):
                if isinstance(slot, _PackItem):
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
        waiter = _Waiter(0)
        waits: list[asyncio.Future[Any]] = [waiter.done]
        slots: list[_ReadItem | asyncio.Future[None]] = []
        for key, out in requests:
            blob = self._blobs.get(key)
            if isinstance(blob, _Packed) and _is_bytes(out) and out.numel() == blob.size:
                waiter.pending += 1
                slots.append(self._enqueue_read(blob, out, waiter))
            else:  # big blobs, and requests read() refuses with the right error
                fut = asyncio.ensure_future(self.read(key, out))
                waits.append(fut)
                slots.append(fut)
        if not waiter.pending:
            waiter.done.set_result(None)
        await _all_done(waits)
        # Nothing was cancelled: _all_done raised then.
        return [slot.error if isinstance(slot, _ReadItem) else slot.exception() for slot in slots]

    async def delete(self, key: int) -> None:
        """Free the extents of ``key`` for reuse (a missing key is ignored)."""
        blob = self._blobs.pop(key, None)
        if blob is not None:
            self._free(blob)

    async def delete_many(self, keys: Sequence[int]) -> list[BaseException | None]:
        """Free the extents of several keys (missing keys are ignored); no I/O, no task each."""
        for key in keys:
            blob = self._blobs.pop(key, None)
            if blob is not None:
                self._free(blob)
        return [None] * len(keys)

    async def close(self) -> None:
        """Wait for the I/O threads, close and remove the spill files (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._start_pack()
        self._start_reads()
        while self._batch_tasks:
            await asyncio.wait(set(self._batch_tasks))
        await asyncio.get_running_loop().run_in_executor(None, self._pool.shutdown, True)
        self._blobs.clear()
        self._close_files()
        for buf in self._bounce_all:
            buf.close()
        self._bounce_all.clear()

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
            "packed_blob_bytes": self._pack_max,
        }

    # -- placement -------------------------------------------------------------------------

    async def _place(self, size: int, lead: int) -> _Blob:
        """Cut a blob into chunks, stripe them, and allocate one extent per directory used.

        The chunks cut the blob's page span (``lead`` bytes before it, Note: [A tensor's
        lead]) every ``io_chunk_bytes``, so each chunk's memory starts on a page.
        """
        n_dirs = len(self._files)
        lead = lead if size else 0
        span = lead + size
        # (start in the blob, true length, lead) of each chunk
        cuts = [
            (max(s - lead, 0), min(s + self._chunk, span) - max(s, lead), lead if s == 0 else 0)
            for s in range(0, span, self._chunk)
        ]
        on_disk = [_pad(chunk_lead + length) for _, length, chunk_lead in cuts]
        first = self._next_dir
        self._next_dir = (first + len(cuts)) % n_dirs
        rotation = [(first + k) % n_dirs for k in range(n_dirs)]
        while True:
            order = self._with_room(rotation, max(on_disk, default=0))
            try:
                return await self._place_on(order, size, lead, cuts, on_disk)
            except _DirectoryFull as full:
                rotation.remove(full.index)
                self._mark_full(full.index, full.error, bool(rotation))
                if not rotation:
                    raise full.error from None

    async def _place_on(
        self,
        order: list[int],
        size: int,
        lead: int,
        cuts: list[tuple[int, int, int]],
        on_disk: list[int],
    ) -> _Blob:
        """Stripe the chunks over the directories ``order`` names, chunk ``i`` in
        ``order[i % len(order)]``, and allocate one extent in each.

        Raises:
            _DirectoryFull: a directory's spill file could not grow for want of space.
        """
        per_dir: dict[int, list[int]] = {}
        for i in range(len(cuts)):
            per_dir.setdefault(order[i % len(order)], []).append(i)
        blob = _Blob(size, [], [], [0] * len(cuts), lead)
        offsets: dict[int, int] = {}
        try:
            for d, indices in per_dir.items():
                f = self._files[d]
                need = sum(on_disk[i] for i in indices)
                offset = f.extents.alloc(need)
                while offset is None:
                    # See Note: [One growth for many waiting writers].
                    try:
                        offset = await self._grow(f, need)
                    except OSError as e:
                        if e.errno in (errno.ENOSPC, errno.EDQUOT):
                            raise _DirectoryFull(d, e) from e
                        raise
                blob.extents.append((f, offset, need))
                at = offset
                for i in indices:
                    offsets[i] = at
                    at += on_disk[i]
        except BaseException:
            self._free(blob)
            raise
        blob.chunks = [
            _Chunk(self._files[order[i % len(order)]], offsets[i], start, length, chunk_lead)
            for i, (start, length, chunk_lead) in enumerate(cuts)
        ]
        return blob

    def _with_room(self, rotation: list[int], least: int) -> list[int]:
        """The directories of ``rotation`` worth trying for a blob, in order.

        Note: [A full directory is skipped]
            Striped directories fill up on their own: one disk can be full while another has
            room. A spill file that cannot grow for want of space (ENOSPC, EDQUOT) marks its
            directory full, with one warning, and the blob is placed again over the other
            directories, so it goes where there is room; only when every directory is full
            does the write fail with ENOSPC (the store then keeps the tensor in memory until
            the space returns). A full directory is tried again once its filesystem has room
            for a chunk, or its spill file has free extents for one; until then its chunks
            go to the others. The store's free-space check sums every directory, and a full
            one adds about nothing to that sum.
        """
        order = []
        for d in rotation:
            f = self._files[d]
            if f.full and (f.extents.free_bytes >= least or f.free_space() >= least):
                f.full = False
                log.info("tierstore: spill directory %s has room again", f.path.parent)
            if not f.full:
                order.append(d)
        # All full: try them all anyway (the space may be back); the error then says so.
        return order or list(rotation)

    def _mark_full(self, index: int, error: OSError, others: bool) -> None:
        f = self._files[index]
        f.full = True
        if others and not f.warned_full:
            f.warned_full = True
            log.warning(
                "tierstore: spill directory %s is full (%s); spilling to the other "
                "directories until it has room again (warned once)",
                f.path.parent,
                error.strerror or error,
            )

    async def _grow(self, f: _SpillFile, need: int) -> int | None:
        fut = asyncio.get_running_loop().run_in_executor(self._pool, f.grow_and_alloc, need)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            # The thread may still allocate; give the extent back when it does.
            fut.add_done_callback(lambda done: _free_granted(done, f, need))
            raise

    def _free(self, blob: _Blob | _Packed) -> None:
        if isinstance(blob, _Packed):
            blob.file.extents.free(blob.offset, _pad(blob.size))
            return
        for f, offset, nbytes in blob.extents:
            f.extents.free(offset, nbytes)
        blob.extents.clear()

    async def _run(self, fn: _ChunkFn, blob: _Blob, view: memoryview, t: torch.Tensor) -> None:
        """Run ``fn`` for every chunk of ``blob`` on the I/O threads; ``t`` is the memory
        (``view`` of it, at ``t.data_ptr()``) the chunks move from or to."""
        loop = asyncio.get_running_loop()
        address = t.data_ptr()
        futures = [
            loop.run_in_executor(self._pool, fn, blob, i, view, address, t)
            for i in range(len(blob.chunks))
        ]
        if not futures:
            return
        # Wait for every chunk even when one fails or the caller is cancelled: the extents may
        # be freed, and the tensor reused, only once no thread still touches them.
        gathered = asyncio.gather(*futures, return_exceptions=True)
        cancelled = False
        while True:
            try:
                results = await asyncio.shield(gathered)
                break
            except asyncio.CancelledError:
                cancelled = True
        if cancelled:
            raise asyncio.CancelledError
        for r in results:
            if isinstance(r, BaseException):
                raise r

    # -- small blobs: packs and grouped reads (Note: [Small blobs travel in packs]) ----------

    def _packable(self, nbytes: int) -> bool:
        return 0 < nbytes <= self._pack_max

    def _enqueue_pack(self, src: torch.Tensor, waiter: _Waiter) -> _PackItem:
        item = _PackItem(src, waiter, src.data_ptr())
        padded = _pad(src.numel())
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
        if self._packs_writing < self.config.io_threads:
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
        self._batch_tasks.add(task)
        task.add_done_callback(self._batch_tasks.discard)

    async def _flush_pack(self, items: list[_PackItem]) -> None:
        blobs: list[_Packed] = []
        try:
            blobs = await self._place_pack(items)
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(self._pool, self._write_pack, items, blobs)
        except BaseException as exc:
            for b in blobs:
                self._free(b)
            for it in items:
                it.error = exc
                it.waiter.finish_one()
        else:
            self.packs_written += 1
            for it, b in zip(items, blobs, strict=True):
                if it.error is not None:
                    self._free(b)  # its source changed: that blob alone is not written
                    it.waiter.finish_one()
                elif it.waiter.done.cancelled():
                    self._free(b)  # its writer was cancelled: nobody owns the blob
                else:
                    it.blob = b
                    it.waiter.finish_one()
        finally:
            self._packs_writing -= 1
            if self._pack and not self._pack_soon:
                self._pack_due()

    async def _place_pack(self, items: list[_PackItem]) -> list[_Packed]:
        """One extent for the whole pack, in the next directory with room (Note: [A full
        directory is skipped]); each blob owns a piece of it."""
        n_dirs = len(self._files)
        first = self._next_dir
        self._next_dir = (first + 1) % n_dirs
        total = sum(_pad(it.src.numel()) for it in items)
        rotation = [(first + k) % n_dirs for k in range(n_dirs)]
        while True:
            (d, *_) = self._with_room(rotation, total)
            try:
                blob = await self._place_on([d], total, 0, [(0, total, 0)], [total])
                break
            except _DirectoryFull as full:
                rotation.remove(full.index)
                self._mark_full(full.index, full.error, bool(rotation))
                if not rotation:
                    raise full.error from None
        (f, offset, _) = blob.extents[0]
        blobs = []
        for it in items:
            n = it.src.numel()
            blobs.append(_Packed(f, offset, n))
            offset += _pad(n)
        return blobs

    def _enqueue_read(self, blob: _Packed, out: torch.Tensor, waiter: _Waiter) -> _ReadItem:
        item = _ReadItem(blob, out, waiter)
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
            if (
                b.file is first.file
                and b.offset - (last.offset + _pad(last.size)) <= _READ_GAP
                and b.offset + _pad(b.size) - first.offset <= self._chunk
            ):
                group.append(i)
            else:
                groups.append(group)
                group = [i]
        groups.append(group)
        groups.sort(key=min)
        for g in groups:
            self._track(self._read_group([items[i] for i in g]))

    async def _read_group(self, items: list[_ReadItem]) -> None:
        loop = asyncio.get_running_loop()
        errors: list[BaseException | None]
        try:
            errors = list(await loop.run_in_executor(self._pool, self._read_span, items))
        except BaseException as exc:
            errors = [exc] * len(items)
        else:
            if len(items) > 1:
                self.grouped_reads += 1
        for it, err in zip(items, errors, strict=True):
            it.error = err
            it.waiter.finish_one()

    # -- blocking work on the I/O threads -------------------------------------------------

    def _write_pack(self, items: list[_PackItem], blobs: list[_Packed]) -> None:
        first = blobs[0]
        buf = self._bounce.get()
        try:
            for it, b in zip(items, blobs, strict=True):
                at = buf.address + b.offset - first.offset
                try:
                    _check_source(it.src, it.address)
                except TensorModifiedError as exc:
                    it.error = exc  # fails its own blob, not its neighbours in the pack
                    memset(at, 0, _pad(b.size))
                    continue
                memmove(at, it.address, b.size)
                memset(at + b.size, 0, _pad(b.size) - b.size)
                if self._checksum:
                    b.crc = crc32c(at, b.size)
            last = blobs[-1]
            total = last.offset + _pad(last.size) - first.offset
            _pwrite_all(first.file.fd, buf.view[:total], first.offset)
            if not first.file.direct:
                _drop_cached(first.file.fd, first.offset, total, dirty=True)
        finally:
            self._bounce.put(buf)

    def _read_span(self, items: list[_ReadItem]) -> list[CorruptTensorError | None]:
        """Read the span covering ``items`` once; check and copy out each blob on its own."""
        first = items[0].blob
        end = max(it.blob.offset + _pad(it.blob.size) for it in items)
        buf = self._bounce.get()
        try:
            span = end - first.offset
            _pread_all(first.file.fd, buf.view[:span], first.offset, first.file.path)
            if not first.file.direct:
                _drop_cached(first.file.fd, first.offset, span, dirty=False)
            errors: list[CorruptTensorError | None] = []
            for it in items:
                b = it.blob
                at = buf.address + b.offset - first.offset
                if self._checksum and (got := crc32c(at, b.size)) != b.crc:
                    errors.append(_crc_mismatch(b.chunks[0], 0, got, b.crc))
                    continue
                # See Note: [Prefaulting a read's destination].
                prefault(it.out.data_ptr(), b.size)
                memmove(it.out.data_ptr(), at, b.size)
                errors.append(None)
            return errors
        finally:
            self._bounce.put(buf)

    def _write_chunk(
        self, blob: _Blob, i: int, view: memoryview, address: int, owner: torch.Tensor
    ) -> None:
        _check_source(owner, address)
        c = blob.chunks[i]
        src = address + c.start
        padded = _pad(c.lead + c.length)
        if not c.file.direct:
            if self._checksum:
                blob.crcs[i] = crc32c(src, c.length)
            _pwrite_all(c.file.fd, view[c.start : c.start + c.length], c.offset + c.lead)
            # The whole padded extent: DONTNEED keeps partly covered pages.
            _drop_cached(c.file.fd, c.offset, padded, dirty=True)
            return
        if (src - c.lead) % PAGE == 0:
            # Straight from the tensor's pages, neighbours included (Note: [A tensor's lead]).
            if self._checksum:
                blob.crcs[i] = crc32c(src, c.length)
            _pwrite_all(c.file.fd, _memory(src - c.lead, padded), c.offset)
            return
        # See Note: [Bounce buffers] and Note: [True size and padded size].
        buf = self._bounce.get()
        try:
            memset(buf.address, 0, c.lead)
            memmove(buf.address + c.lead, src, c.length)
            memset(buf.address + c.lead + c.length, 0, padded - c.lead - c.length)
            if self._checksum:
                blob.crcs[i] = crc32c(buf.address + c.lead, c.length)
            _pwrite_all(c.file.fd, buf.view[:padded], c.offset)
        finally:
            self._bounce.put(buf)

    def _read_chunk(
        self, blob: _Blob, i: int, view: memoryview, address: int, out: torch.Tensor
    ) -> None:
        c = blob.chunks[i]
        # ``view`` is ``out``: the blob's size, or its whole page span (Note: [A tensor's lead]).
        at = c.start + (blob.lead if len(view) != blob.size else 0)
        dst = address + at
        padded = _pad(c.lead + c.length)
        if not c.file.direct:
            _pread_all(c.file.fd, view[at : at + c.length], c.offset + c.lead, c.file.path)
            _drop_cached(c.file.fd, c.offset, padded, dirty=False)
            self._verify(blob, i, dst)
            return
        first = at - c.lead  # the chunk's first page, as an offset in ``out``
        if (dst - c.lead) % PAGE == 0 and first >= 0 and first + padded <= len(view):
            _pread_all(c.file.fd, view[first : first + padded], c.offset, c.file.path)
            self._verify(blob, i, dst)
            return
        buf = self._bounce.get()
        try:
            _pread_all(c.file.fd, buf.view[:padded], c.offset, c.file.path)
            self._verify(blob, i, buf.address + c.lead)
            prefault(dst, c.length)
            memmove(dst, buf.address + c.lead, c.length)
        finally:
            self._bounce.put(buf)

    def _verify(self, blob: _Blob, i: int, address: int) -> None:
        if not self._checksum:
            return
        got = crc32c(address, blob.chunks[i].length)
        if got != blob.crcs[i]:
            raise _crc_mismatch(blob.chunks[i], i, got, blob.crcs[i])

    # -- helpers ---------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the disk engine is closed")

    def _close_files(self) -> None:
        for f in self._files:
            with contextlib.suppress(OSError):
                os.close(f.fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f.path)
        self._files.clear()


if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine, Sequence

    _ChunkFn = Callable[[_Blob, int, memoryview, int, torch.Tensor], None]


class _DirectoryFull(Exception):
    """The spill file of directory ``index`` could not grow: ``error`` is the ENOSPC/EDQUOT."""

    def __init__(self, index: int, error: OSError) -> None:
        super().__init__(index, error)
        self.index = index
        self.error = error


class _Waiter:
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
class _PackItem:
    """A small blob waiting for its pack: the bytes, and then its placed record or error."""

    src: torch.Tensor
    waiter: _Waiter
    address: int = 0
    """Where ``src``'s bytes were when the write was asked for."""
    blob: _Packed | None = None
    error: BaseException | None = None


@dataclass(slots=True)
class _ReadItem:
    """A small read waiting to be grouped with its neighbours, and then its error if any."""

    blob: _Packed
    out: torch.Tensor
    waiter: _Waiter
    error: BaseException | None = None


def _crc_mismatch(c: _Chunk, i: int, got: int, written: int) -> CorruptTensorError:
    return CorruptTensorError(
        f"spill file {str(c.file.path)!r}: chunk {i} ({c.length} bytes at offset "
        f"{c.offset + c.lead}) has CRC32C {got:#010x}, {written:#010x} was written"
    )


async def _all_done(futures: list[asyncio.Future[Any]]) -> None:
    """Wait until every future is done; a cancelled caller cancels those still pending.

    Cancelling a :class:`_Waiter` only detaches its caller: packs and read groups go on with
    the memory they hold, and a written blob nobody owns is freed (see ``_flush_pack``).
    """
    if not futures:
        return
    try:
        await asyncio.wait(futures)
    except asyncio.CancelledError:
        for fut in futures:
            fut.cancel()
        await asyncio.wait(futures)
        raise


def _free_granted(done: asyncio.Future[int | None], f: _SpillFile, nbytes: int) -> None:
    if not done.cancelled() and done.exception() is None:
        offset = done.result()
        if offset is not None:
            f.extents.free(offset, nbytes)


def _check_source(src: torch.Tensor, address: int) -> None:
    """Refuse to read memory a source no longer owns (Note: [Writes after put] in _core.py).

    A caller that resized the storage of a tensor being written (``resize_(0)`` frees it) would
    otherwise make the copy below read freed memory and crash the process. Checked on the I/O
    thread right before the memory is touched.

    Raises:
        TensorModifiedError: the storage moved, or no longer covers the source's bytes.
    """
    have = src.untyped_storage().nbytes()
    if src.data_ptr() != address or have < src.storage_offset() + src.numel():
        raise TensorModifiedError(
            f"its storage was resized to {have} bytes or moved while waiting to be written "
            f"(it needs {src.storage_offset() + src.numel()}), as resize_(0) does"
        )


def _check_bytes(t: torch.Tensor, name: str) -> None:
    if not _is_bytes(t):
        raise TypeError(
            f"{name} must be a 1-D contiguous uint8 CPU tensor, got {t.dtype} {tuple(t.shape)} "
            f"on {t.device}"
        )


def _is_bytes(t: torch.Tensor) -> bool:
    import torch

    return t.dtype == torch.uint8 and t.dim() == 1 and t.is_contiguous() and t.device.type == "cpu"


def _byte_view(t: torch.Tensor) -> memoryview:
    # numpy shares the tensor's memory; an empty tensor gives an empty view.
    return t.numpy().data.cast("B")
