"""The blocking transfers, run on the engine's I/O threads: a blob's chunks, a pack of small
blobs, a span of packed neighbours.

Each chunk moves with one ``pwrite`` or ``pread``: with O_DIRECT straight between the file and
the caller's pages where the layout allows (Note: [A tensor's lead]), through a bounce buffer
otherwise; with buffered I/O from any address, then dropped from the page cache. Checksums are
computed and verified here, next to the bytes.

Note: [Bounce buffers]
    A chunk that cannot move straight between the file and the caller's memory (an address
    that is not 64 bytes past a page, a pack, or a read whose pages reach outside ``out``)
    goes through one of ``io_threads`` page-aligned bounce buffers, allocated once when the
    engine opens: at most ``io_threads`` transfers run at once, so a transfer never waits for
    one. Copies and checksums run through ``ctypes`` calls, which release the GIL, so the I/O
    threads work in parallel.
"""

from __future__ import annotations

import os
import queue
from typing import TYPE_CHECKING

from tierstore.errors import CorruptTensorError, TensorModifiedError
from tierstore.tiers._checksum import crc32c
from tierstore.tiers._memcopy import memmove, memset, prefault
from tierstore.tiers.raw._syscalls import (
    PAGE,
    BounceBuffer,
    drop_cached,
    memory,
    pad,
    pread_all,
    pwrite_all,
)

if TYPE_CHECKING:
    from collections.abc import Sequence
    from pathlib import Path

    import torch

    from tierstore.tiers.raw._layout import Blob, Chunk, PackedBlob

__all__ = ["ChunkIO", "check_source"]

_IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 16
"""The most pieces one ``preadv`` takes (1024 on Linux)."""


class ChunkIO:
    """Blocking chunk transfers with their checksums, and the bounce buffers they share.

    Args:
        threads: bounce buffers to make, one per I/O thread.
        chunk: bytes of one chunk (and of one bounce buffer).
        checksum: compute and verify CRC32C.
    """

    def __init__(self, threads: int, chunk: int, checksum: bool) -> None:
        self.checksum = checksum
        self._bounce: queue.SimpleQueue[BounceBuffer] = queue.SimpleQueue()
        self._buffers: list[BounceBuffer] = []
        # Packs are assembled in them even without O_DIRECT; untouched pages cost no memory.
        try:
            for _ in range(threads):
                buf = BounceBuffer(chunk)
                self._buffers.append(buf)
                self._bounce.put(buf)
        except BaseException:
            self.close()  # those mapped before the one that failed (RLIMIT_AS, overcommit)
            raise

    def close(self) -> None:
        """Unmap the bounce buffers (once no transfer runs)."""
        for buf in self._buffers:
            buf.close()
        self._buffers.clear()

    # -- a blob written alone, chunk by chunk ----------------------------------------------

    def write_chunk(
        self, blob: Blob, i: int, view: memoryview, address: int, owner: torch.Tensor
    ) -> None:
        """Write chunk ``i`` of ``blob`` from ``view`` (``owner``'s bytes, at ``address``)."""
        check_source(owner, address)
        c = blob.chunks[i]
        try:
            self._write_chunk(blob, i, view, address + c.start, c)
        except OSError as exc:
            c.file.note_failure(exc)  # Note: [A failing directory is skipped]
            raise

    def _write_chunk(self, blob: Blob, i: int, view: memoryview, src: int, c: Chunk) -> None:
        padded = pad(c.lead + c.length)
        if not c.file.direct:
            # Before the write: see Note: [Each thread checks write-back on its own descriptor].
            check = c.file.writeback_fd()
            if self.checksum:
                blob.crcs[i] = crc32c(src, c.length)
            pwrite_all(c.file.fd, view[c.start : c.start + c.length], c.offset + c.lead)
            # The whole padded extent: DONTNEED keeps partly covered pages.
            drop_cached(check, c.offset, padded, dirty=True)
            return
        if (src - c.lead) % PAGE == 0:
            # Straight from the tensor's pages, neighbours included (Note: [A tensor's lead]).
            if self.checksum:
                blob.crcs[i] = crc32c(src, c.length)
            pwrite_all(c.file.fd, memory(src - c.lead, padded), c.offset)
            return
        # See Note: [Bounce buffers] and Note: [True size and padded size].
        buf = self._bounce.get()
        try:
            memset(buf.address, 0, c.lead)
            memmove(buf.address + c.lead, src, c.length)
            memset(buf.address + c.lead + c.length, 0, padded - c.lead - c.length)
            if self.checksum:
                blob.crcs[i] = crc32c(buf.address + c.lead, c.length)
            pwrite_all(c.file.fd, buf.view[:padded], c.offset)
        finally:
            self._bounce.put(buf)

    def read_chunk(
        self, blob: Blob, i: int, view: memoryview, address: int, out: torch.Tensor
    ) -> None:
        """Read chunk ``i`` of ``blob`` into ``view`` (``out``'s bytes, at ``address``)."""
        c = blob.chunks[i]
        # ``view`` is ``out``: the blob's size, or its whole page span (Note: [A tensor's lead]).
        at = c.start + (blob.lead if len(view) != blob.size else 0)
        dst = address + at
        padded = pad(c.lead + c.length)
        if not c.file.direct:
            pread_all(c.file.fd, view[at : at + c.length], c.offset + c.lead, c.file.path)
            drop_cached(c.file.fd, c.offset, padded, dirty=False)
            self.verify(blob, i, dst)
            return
        first = at - c.lead  # the chunk's first page, as an offset in ``out``
        if (dst - c.lead) % PAGE == 0 and first >= 0 and first + padded <= len(view):
            pread_all(c.file.fd, view[first : first + padded], c.offset, c.file.path)
            self.verify(blob, i, dst)
            return
        buf = self._bounce.get()
        try:
            pread_all(c.file.fd, buf.view[:padded], c.offset, c.file.path)
            self.verify(blob, i, buf.address + c.lead)
            prefault(dst, c.length)
            memmove(dst, buf.address + c.lead, c.length)
        finally:
            self._bounce.put(buf)

    def verify(self, blob: Blob, i: int, address: int) -> None:
        """Check chunk ``i``'s bytes at ``address`` against its CRC.

        Raises:
            CorruptTensorError: they differ.
        """
        if not self.checksum:
            return
        c = blob.chunks[i]
        got = crc32c(address, c.length)
        if got != blob.crcs[i]:
            raise _mismatch(c.file.path, i, c.length, c.offset + c.lead, got, blob.crcs[i])

    # -- small blobs (Note: [Small blobs travel in packs]) --------------------------------

    def write_pack(
        self, sources: Sequence[tuple[torch.Tensor, int]], blobs: Sequence[PackedBlob]
    ) -> list[TensorModifiedError | None]:
        """Write each ``(tensor, address)`` into its blob's piece, all with one ``pwrite``.

        Returns:
            Per blob, None or the error of a source that changed before it was copied: that
            blob's piece is written as zeros, and its neighbours in the pack are not harmed.
        """
        first = blobs[0]
        changed: list[TensorModifiedError | None] = []
        buf = self._bounce.get()
        try:
            for (src, address), b in zip(sources, blobs, strict=True):
                at = buf.address + b.offset - first.offset
                try:
                    check_source(src, address)
                except TensorModifiedError as exc:
                    changed.append(exc)
                    memset(at, 0, pad(b.size))
                    continue
                changed.append(None)
                memmove(at, address, b.size)
                memset(at + b.size, 0, pad(b.size) - b.size)
                if self.checksum:
                    b.crc = crc32c(at, b.size)
            last = blobs[-1]
            total = last.offset + pad(last.size) - first.offset
            try:
                check = None if first.file.direct else first.file.writeback_fd()
                pwrite_all(first.file.fd, buf.view[:total], first.offset)
                if check is not None:
                    drop_cached(check, first.offset, total, dirty=True)
            except OSError as exc:
                first.file.note_failure(exc)  # Note: [A failing directory is skipped]
                raise
        finally:
            self._bounce.put(buf)
        return changed

    def read_span(
        self, blobs: Sequence[PackedBlob], outs: Sequence[torch.Tensor]
    ) -> list[CorruptTensorError | None]:
        """Read the span covering ``blobs`` (in file order) with one request; check each blob
        on its own.

        Note: [Packed reads land in place]
            A blob whose destination starts on a page (a read-pool buffer, which every packed
            read of 32 KiB and more gets) has its whole pages read straight into it: the one
            ``preadv`` scatters the span over the destinations, and only the gaps between
            blobs, each blob's last partial page and the blobs of other destinations go to
            the bounce buffer, at the same place in it as a plain ``pread`` would put them.
            That saves copying the bytes out of the bounce buffer. A short read, or more
            pieces than the kernel takes in one call, reads the span into the bounce buffer
            instead and copies every blob out.
        """
        first = blobs[0]
        end = max(b.offset + pad(b.size) for b in blobs)
        buf = self._bounce.get()
        try:
            span = end - first.offset
            heads = self._scatter_read(blobs, outs, buf, span)
            if heads is None:
                pread_all(first.file.fd, buf.view[:span], first.offset, first.file.path)
                heads = [0] * len(blobs)
            if not first.file.direct:
                drop_cached(first.file.fd, first.offset, span, dirty=False)
            errors: list[CorruptTensorError | None] = []
            for b, out, head in zip(blobs, outs, heads, strict=True):
                at = buf.address + b.offset - first.offset
                dst = out.data_ptr()
                if head and b.size > head:  # its last partial page
                    memmove(dst + head, at + head, b.size - head)
                # Checked where the whole blob is now: in place, or still in the bounce buffer.
                whole = dst if head else at
                if self.checksum and (got := crc32c(whole, b.size)) != b.crc:
                    errors.append(_mismatch(b.file.path, 0, b.size, b.offset, got, b.crc))
                    continue
                if not head:
                    # See Note: [Prefaulting a read's destination].
                    prefault(dst, b.size)
                    memmove(dst, at, b.size)
                errors.append(None)
            return errors
        finally:
            self._bounce.put(buf)

    def _scatter_read(
        self,
        blobs: Sequence[PackedBlob],
        outs: Sequence[torch.Tensor],
        buf: BounceBuffer,
        span: int,
    ) -> list[int] | None:
        """Read the span with one ``preadv``, whole pages straight into page-aligned outs
        (Note: [Packed reads land in place]).

        Returns:
            Per blob, the bytes read into its out (0: all of it is in the bounce buffer), or
            ``None`` where nothing could go in place, the pieces are too many for one call
            or the read came back short; the caller then reads the span plainly.
        """
        first = blobs[0]
        heads = [
            b.size // PAGE * PAGE if out.data_ptr() % PAGE == 0 else 0
            for b, out in zip(blobs, outs, strict=True)
        ]
        if not any(heads):
            return None
        pieces: list[memoryview] = []
        at = first.offset  # the file offset the next piece starts at
        for b, out, head in zip(blobs, outs, heads, strict=True):
            if head:
                if b.offset > at:
                    pieces.append(buf.view[at - first.offset : b.offset - first.offset])
                pieces.append(memory(out.data_ptr(), head))
                at = b.offset + head
            end = b.offset + pad(b.size)
            if end > at:
                pieces.append(buf.view[at - first.offset : end - first.offset])
                at = end
        if len(pieces) > _IOV_MAX:
            return None
        for out, head in zip(outs, heads, strict=True):
            if head:
                # See Note: [Prefaulting a read's destination].
                prefault(out.data_ptr(), head)
        if os.preadv(first.file.fd, pieces, first.offset) != span:
            return None
        return heads


def check_source(src: torch.Tensor, address: int) -> None:
    """Refuse to read memory a source no longer owns (Note: [Writes after put]).

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


def _mismatch(
    path: Path, i: int, length: int, offset: int, got: int, written: int
) -> CorruptTensorError:
    return CorruptTensorError(
        f"spill file {str(path)!r}: chunk {i} ({length} bytes at offset "
        f"{offset}) has CRC32C {got:#010x}, {written:#010x} was written"
    )
