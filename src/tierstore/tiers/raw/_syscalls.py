"""System calls and raw memory: whole-transfer ``pwrite``/``pread`` loops, page-cache
dropping, and the page-aligned bounce buffers that O_DIRECT needs."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
from typing import TYPE_CHECKING

from tierstore._libc import libc_function
from tierstore.errors import CorruptTensorError

if TYPE_CHECKING:
    from pathlib import Path

__all__ = [
    "O_DIRECT",
    "PAGE",
    "BounceBuffer",
    "drop_cached",
    "memory",
    "pad",
    "pread_all",
    "pwrite_all",
    "write_out",
]

PAGE = 4096
"""Alignment of every file offset, extent length and O_DIRECT buffer."""

O_DIRECT: int = getattr(os, "O_DIRECT", 0)
"""The open flag, or 0 where the platform has none."""


def pad(nbytes: int) -> int:
    """``nbytes`` rounded up to whole pages."""
    return -(-nbytes // PAGE) * PAGE


def memory(address: int, nbytes: int) -> memoryview:
    """A view of ``nbytes`` of memory at ``address``; the caller keeps the memory alive.

    ctypes keeps one array type per length; the lengths here are whole pages up to one chunk
    (at most 2048 of them with the default 8 MiB chunks).
    """
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")


class BounceBuffer:
    """A page-aligned buffer of one chunk, reused for every transfer that cannot go straight
    between the file and the caller's memory (Note: [Bounce buffers])."""

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


def drop_cached(fd: int, offset: int, nbytes: int, *, dirty: bool) -> None:
    """Keep buffered spill I/O out of the page cache: the point of spilling is to free RAM.

    ``POSIX_FADV_DONTNEED`` only drops clean pages, so freshly written ones are first written
    back with ``sync_file_range`` (on this range only, without a journal commit).

    Raises:
        OSError: the write-back failed (EIO, ENOSPC on a thin device...). A buffered write
            reports a disk error only here; the pages would then be dropped unwritten, and
            the store would trust bytes the disk never took.
    """
    if dirty:
        write_out(fd, offset, nbytes)
    os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)


def write_out(fd: int, offset: int, nbytes: int) -> None:
    """Write the dirty pages of ``nbytes`` at ``offset`` (0: to the end of the file) to the
    disk and wait for them, data only: no journal commit, no flush of the disk's cache. The
    pages stay cached, clean. Where libc has no ``sync_file_range``, ``fdatasync``.

    Raises:
        OSError: the write-back failed.
    """
    if _SYNC_FILE_RANGE is None:
        os.fdatasync(fd)
        return
    if _SYNC_FILE_RANGE(fd, offset, nbytes, _SYNC_WAIT_WRITE_WAIT) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"writing back {nbytes} bytes at {offset}: {os.strerror(err)}")


def pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    """Write all of ``view`` at ``offset``, retrying short writes.

    Raises:
        OSError: the write failed, or wrote nothing (EIO).
    """
    done = 0
    while done < len(view):
        n = os.pwrite(fd, view[done:], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, f"pwrite wrote nothing at offset {offset + done}")
        done += n


def pread_all(fd: int, view: memoryview, offset: int, path: Path) -> None:
    """Fill all of ``view`` from ``offset``, retrying short reads.

    Raises:
        CorruptTensorError: the file ends inside the range (``path`` names it).
        OSError: the read failed.
    """
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n < len(view) - done and offset + done + n >= os.fstat(fd).st_size:
            raise CorruptTensorError(
                f"spill file {str(path)!r} is truncated: it ends at "
                f"{os.fstat(fd).st_size} bytes, inside a blob at {offset}+{len(view)}"
            )
        done += n
