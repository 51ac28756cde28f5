"""Where a blob's bytes lie on disk: its chunks and extents, and the records that keep them.

Note: [True size and padded size]
    O_DIRECT moves whole pages from page-aligned memory, so a chunk of ``length`` bytes
    occupies ``pad(lead + length)`` bytes on disk (``lead``: Note: [A tensor's lead]). The
    blob record keeps the true length of every chunk; only the extent allocator sees the
    padded size, the checksum covers exactly the true bytes, and a read hands back exactly the
    true bytes. Padding written through a bounce buffer is zeros; padding written straight
    from a tensor's pages is whatever shared those pages with it (below). Neither is ever
    returned as data.

Note: [A tensor's lead]
    torch CPU tensors are 64-byte aligned, usually 64 bytes past a page, and O_DIRECT on many
    disks takes only memory aligned to 512 bytes. Copying every chunk into an aligned buffer
    first costs a good part of the write speed (docs/disk-engine.md, "A tensor's lead"). So a
    big blob whose address is ``lead`` bytes past a page (a multiple of 64) is laid out on
    disk as the pages its memory spans: its first chunk starts ``lead`` bytes into its extent,
    every chunk boundary falls on a page of the tensor's memory, and each chunk is written
    straight from those pages, including the bytes before the tensor in its first page and
    after it in its last. Those bytes are read, never written, and every page touched holds
    some of the tensor, so it is mapped for as long as the caller keeps the tensor alive. The
    spill file is private to the process (0600 in a 0700 directory) and removed when the
    engine closes.

    A read writes whole pages too. ``read_window`` tells the caller the lead and the page
    span; a caller that passes a page-aligned buffer of the whole span (the store's read
    pool) gets every chunk read straight into it and the bytes at ``lead``. A caller that
    passes exactly the blob's size gets exactly those bytes written: chunks whose pages lie
    inside ``out`` go straight in, the others through a bounce buffer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tierstore.tiers.raw._syscalls import pad

if TYPE_CHECKING:
    from pathlib import Path

    from tierstore.tiers.raw._spill_file import SpillFile

__all__ = ["LEAD_ALIGN", "Blob", "Chunk", "PackedBlob", "cut"]

LEAD_ALIGN = 64
# A blob is written straight from its pages only when its address is a multiple of this past
# a page (Note: [A tensor's lead]): its read-back copy then lands at the same place in a page,
# so it is never less aligned than torch's own CPU allocations.


def cut(size: int, lead: int, chunk: int) -> list[tuple[int, int, int]]:
    """The chunks of a blob of ``size`` bytes that starts ``lead`` bytes into its first page:
    ``(start in the blob, true length, lead)`` each.

    Chunks cut the blob's page span every ``chunk`` bytes, so each chunk's memory starts on a
    page; only the first has a lead.
    """
    span = lead + size
    return [
        (max(s - lead, 0), min(s + chunk, span) - max(s, lead), lead if s == 0 else 0)
        for s in range(0, span, chunk)
    ]


@dataclass(frozen=True, slots=True)
class Chunk:
    """One chunk of a blob and where it lives."""

    file: SpillFile
    """The spill file (so the directory) holding it."""
    offset: int
    """Page-aligned offset in that file."""
    start: int
    """Offset of the chunk's first byte in the blob."""
    length: int
    """True length in bytes; the chunk occupies ``pad(lead + length)`` on disk."""
    lead: int = 0
    """Bytes before the chunk's data in its extent (the blob's lead, first chunk only)."""


@dataclass(slots=True)
class Blob:
    """Where a blob written alone lives: its extents (one per directory used) and its chunks."""

    size: int
    """True size in bytes."""
    extents: list[tuple[SpillFile, int, int]]
    """``(file, offset, padded length)`` of each extent it holds."""
    chunks: list[Chunk]
    crcs: list[int]
    """The CRC32C of each chunk's true bytes (0 without checksums)."""
    lead: int = 0
    """Bytes of the first page before the data (Note: [A tensor's lead])."""

    def window(self) -> tuple[int, int]:
        """``(lead, span)`` of a read straight into whole pages (Note: [A tensor's lead])."""
        return self.lead, pad(self.lead + self.size)

    def free(self) -> None:
        """Give every extent back to its file's allocator."""
        for f, offset, nbytes in self.extents:
            f.extents.free(offset, nbytes)
        self.extents.clear()

    def pieces(self) -> list[tuple[Path, int, int]]:
        """``(file, offset, length)`` of the true bytes of each chunk, in order."""
        return [(c.file.path, c.offset + c.lead, c.length) for c in self.chunks]


class PackedBlob:
    """Where a small blob lives: its own page-aligned piece of a pack's extent, and its CRC.

    One object where a :class:`Blob` takes six (the record, its lists, chunk and extent): a
    spill of thousands of small tensors keeps one alive per tensor, and the garbage
    collector's full collections walk every one of them (Note: [Small blobs travel in packs]).
    """

    __slots__ = ("crc", "file", "offset", "size")

    def __init__(self, file: SpillFile, offset: int, size: int) -> None:
        self.file = file
        self.offset = offset
        """Page-aligned offset in ``file``; the blob occupies ``pad(size)`` bytes there."""
        self.size = size
        self.crc = 0

    def free(self) -> None:
        """Give the piece back to its file's allocator."""
        self.file.extents.free(self.offset, pad(self.size))

    def pieces(self) -> list[tuple[Path, int, int]]:
        """``(file, offset, length)`` of its bytes."""
        return [(self.file.path, self.offset, self.size)]
