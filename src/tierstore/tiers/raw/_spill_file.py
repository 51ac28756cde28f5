"""One spill file per spill directory: created private, grown on demand, carved into extents."""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
from typing import TYPE_CHECKING

from tierstore._inherited import close_copies, identity_of
from tierstore.tiers._engine import DISK_FULL, free_space
from tierstore.tiers.raw._extents import Extents
from tierstore.tiers.raw._syscalls import O_DIRECT, pad

if TYPE_CHECKING:
    from pathlib import Path

__all__ = ["GROW_MAX", "GROW_MIN", "SPILL_FILE", "SpillFile"]

SPILL_FILE = "spill.raw"
"""Name of the spill file inside each private spill directory."""

GROW_MIN = 64 << 20
GROW_MAX = 1 << 30
# The file grows by doubling, from 64 MiB up to steps of 1 GiB: few fallocate calls for a big
# spill, little unused reservation for a small one. It reserves ahead only up to its share of
# the disk tier's capacity, and past that, or near a full disk, grows by exactly what the blob
# needs before giving up with ENOSPC.


class SpillFile:
    """One spill file: its descriptor, whether it is open with O_DIRECT, and its extents.

    Args:
        directory: the private spill directory it is made in (``SPILL_FILE``, mode 0600,
            ``O_EXCL|O_NOFOLLOW``: a planted file or link is refused).
        direct: open it with O_DIRECT.
        reserve_limit: the size up to which growth may reserve more than a blob needs (this
            file's share of ``disk_bytes``), or None for no limit. A store capped at 2 MiB
            reserved a 64 MiB file without it, space other processes on the disk could not use.

    Raises:
        OSError: the file cannot be created.
    """

    def __init__(self, directory: Path, direct: bool, reserve_limit: int | None = None) -> None:
        self.path = directory / SPILL_FILE
        self.reserve_limit = reserve_limit
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        self.fd = os.open(self.path, flags | (O_DIRECT if direct else 0), 0o600)
        self._identity = identity_of(self.fd)
        if not direct:
            # Reads are whole chunks already; readahead would only pull neighbouring extents
            # into the page cache, which spilling is meant to empty.
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_RANDOM)
        self.direct = direct
        self.extents = Extents()
        self.grow_lock = threading.Lock()
        self.full = False
        """The last growth failed with ENOSPC/EDQUOT (Note: [A full directory is skipped])."""
        self.quota_full_at: float | None = None
        """When it failed with EDQUOT, which the filesystem's free space does not show."""
        self.warned_full = False
        self.warned_failing = False
        self.failing_at: float | None = None
        """When a write or a growth here last failed with an error other than a full disk
        (EIO, EROFS, ENOENT): the directory is skipped for a while (Note: [A failing
        directory is skipped])."""
        self._check_fds: dict[int, int] = {}
        """Each I/O thread's own descriptor, by thread: only that thread adds its entry (one
        dict store, atomic), and only ``close_descriptor`` reads them all, once the threads
        have stopped. No lock: a fork does not wait (Note: [Descriptors across fork])."""

    def note_failure(self, error: OSError) -> None:
        """Remember a failed write or growth that a full disk does not explain."""
        if error.errno not in DISK_FULL:
            self.failing_at = time.monotonic()

    def free_space(self) -> int:
        """Bytes the filesystem of this file's directory has free for this user."""
        return free_space(self.path.parent)

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
            step = min(max(old, GROW_MIN), GROW_MAX)
            if self.reserve_limit is not None:
                step = min(step, max(self.reserve_limit - old, 0))
            for amount in dict.fromkeys((max(pad(nbytes), step), pad(nbytes))):
                try:
                    os.posix_fallocate(self.fd, old, amount)
                except OSError as e:
                    # A failed fallocate may leave blocks reserved past the old end.
                    with contextlib.suppress(OSError):
                        os.ftruncate(self.fd, old)
                    if e.errno not in DISK_FULL or amount == pad(nbytes):
                        raise OSError(
                            e.errno,
                            f"growing {self.path} by {amount} bytes: {e.strerror}",
                            str(self.path),
                        ) from e
                    continue
                self.extents.grown(amount)
                break
            # None only if the loop thread took the new space first; the caller tries again.
            return self.extents.alloc(nbytes)

    def writeback_fd(self) -> int:
        """This thread's own descriptor of the file, to check a buffered write's write-back on.

        Note: [Each thread checks write-back on its own descriptor]
            Linux reports a write-back error once per open file description, not per byte
            range: each description keeps its own cursor into the file's error sequence, and
            ``sync_file_range`` reports whatever failed since that cursor, then advances it.
            With one descriptor shared by the I/O threads, the first thread to check took
            another thread's error: the write whose pages had failed passed its own check, and
            the store dropped its host copy and trusted bytes the disk never took. Each I/O
            thread therefore checks through a descriptor of its own, taken before it writes,
            and sees every error since its last check: a failed write-back fails every
            buffered write checked after it, on any thread, which keeps their tensors in
            memory, and none is trusted. Taken after the write, a descriptor opened then
            starts past an error another thread has already seen, and misses it.

        Raises:
            OSError: the file cannot be opened again, or its path now names another file.
        """
        me = threading.get_ident()
        fd = self._check_fds.get(me)
        if fd is None:
            try:
                # A new description of the open file, even once its path is gone (the spill
                # directory removed under a running store): the path failed every write.
                fd = os.open(f"/proc/self/fd/{self.fd}", os.O_RDWR | os.O_CLOEXEC)
            except OSError:  # no /proc, or one this process may not open
                fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
            if identity_of(fd) != self._identity:
                os.close(fd)
                raise OSError(errno.ESTALE, f"{self.path} is no longer the spill file")
            self._check_fds[me] = fd
        return fd

    def close_descriptor(self) -> None:
        """Close the file's descriptors, leaving the file (errors ignored); a second call
        closes nothing (a number closed twice may name another file by then)."""
        fds = [fd for fd in (self.fd, *self._check_fds.values()) if fd >= 0]
        self.fd, self._check_fds = -1, {}
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)

    def forget_in_child(self) -> None:
        """In a forked child: close the descriptors of this file it inherited, each only if
        it still refers to the file (Note: [Descriptors across fork]; the registry's pass
        over the child's descriptors closed those not recorded here)."""
        known = [fd for fd in (self.fd, *self._check_fds.values()) if fd >= 0]
        self.fd, self._check_fds = -1, {}
        close_copies(self._identity, known)

    def close(self) -> None:
        """Close and remove the file (errors ignored: it is the process's own scratch)."""
        self.close_descriptor()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
