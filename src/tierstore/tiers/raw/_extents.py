"""The first-fit allocator of page-aligned extents inside one spill file."""

from __future__ import annotations

import bisect
import threading

__all__ = ["Extents"]


class Extents:
    """First-fit allocator of page-aligned extents inside one file.

    Free extents are kept sorted by offset and coalesced with their neighbours on free, so
    space a deleted blob leaves is found again by the next blob that fits. Thread-safe: the
    loop thread and a growing I/O thread both use it.
    """

    def __init__(self) -> None:
        self._offsets: list[int] = []
        self._lengths: list[int] = []
        self._lock = threading.Lock()
        self.size = 0
        """Bytes the file has been grown to."""
        self.free_bytes = 0
        """Bytes inside ``size`` that no extent holds."""

    def alloc(self, nbytes: int) -> int | None:
        """The offset of a free extent of ``nbytes``, now taken, or None if none is that big."""
        with self._lock:
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

    def largest(self) -> int:
        """The longest free extent: the biggest blob :meth:`alloc` can place now."""
        with self._lock:
            return max(self._lengths, default=0)

    def free(self, offset: int, nbytes: int) -> None:
        """Give back ``nbytes`` at ``offset``, merged with the free extents around it."""
        with self._lock:
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

    def grown(self, nbytes: int) -> None:
        """The file grew by ``nbytes`` past :attr:`size`: they are free."""
        old = self.size
        self.size = old + nbytes
        self.free(old, nbytes)
