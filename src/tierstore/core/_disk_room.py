"""How much the disk tier can take now: its capacity, the filesystems' free space, and the
pause after a failed write.

Note: [Disk full until space returns]
    A write error pauses the disk tier for ``RETRY_SECONDS``, so a failing disk is not
    hammered. After ENOSPC/EDQUOT, or when the free-space check before a spill finds too
    little room, the tier also stays off until the filesystem really has that room again
    (free space, plus the engine's reusable extents, plus deletes still pending). After the
    engine's own write ran out of space, only the biggest piece it can place a blob in
    counts of its reusable extents (``DiskEngine.placeable_bytes``): free pieces scattered
    through a spill file, none big enough for the blob, would otherwise end the pause at once
    and every retry would fail again. While it is off, the store counts no disk room, so
    ``put`` raises ``TierFullError`` instead of growing the host tier without bound.

Note: [A full quota]
    EDQUOT is ENOSPC's twin with one difference: ``statvfs`` does not see a user's quota, so
    the filesystem looks free and the pause above would end at once, every write failing
    with a warning each second for the rest of the run. After EDQUOT, only room in the
    store's own files ends the pause early (reusing it needs no new quota); otherwise the tier
    tries one write after a pause that doubles with each quota failure in a row, from
    ``RETRY_SECONDS`` to ``QUOTA_RETRY_MAX_SECONDS``, in case other files were deleted. A
    write that succeeds ends the run of failures; only its first is a warning.
"""

from __future__ import annotations

import enum
import errno
import logging
import os
import time
from typing import TYPE_CHECKING

from tierstore._stats import format_size

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from tierstore.tiers import DiskEngine

__all__ = [
    "FREE_SPACE_TTL_SECONDS",
    "QUOTA_RETRY_MAX_SECONDS",
    "RETRY_SECONDS",
    "DiskRoom",
    "Verdict",
    "free_bytes",
]

log = logging.getLogger("tierstore")

RETRY_SECONDS = 1.0
"""How long a failed disk stays unavailable before the store checks for space again."""
QUOTA_RETRY_MAX_SECONDS = 60.0
"""The longest pause between trial writes while the user's disk quota stays full (Note: [A
full quota])."""
FREE_SPACE_TTL_SECONDS = 0.05
"""The filesystems' free space is read at most this often: two system calls per spill would
cost as much as packing a small tensor. Spills planned since the reading are subtracted from
it, and a spill that seems not to fit reads it again."""


def free_bytes(dirs: Iterable[os.PathLike[str]]) -> int:
    """Bytes free for this user on the filesystems of ``dirs``, each filesystem once."""
    seen: set[int] = set()
    free = 0
    for d in dirs:
        try:
            st = os.statvfs(d)
            dev = os.stat(d).st_dev
        except OSError:
            continue
        if dev in seen:
            continue
        seen.add(dev)
        free += st.f_bavail * st.f_frsize
    return free


class Verdict(enum.Enum):
    """Whether a spill of some footprint may go to disk now."""

    FITS = "fits"
    OVER_CAPACITY = "over capacity"
    """``TIERSTORE_DISK_BYTES`` would be passed."""
    NO_SPACE = "no space"
    """The filesystems do not have the room (other files, other processes)."""


class DiskRoom:
    """The disk tier's room, and its pause after a failure (under the store's lock).

    Args:
        engine: the disk engine (its footprints and reusable space), or None: no disk tier.
        capacity: ``disk_bytes``, capped at the free space when the store opened.
        dirs: the parent directories whose filesystems hold the spill files.
        clock: seconds, monotonic (a test passes its own).
        read_free: reads the free bytes of ``dirs`` (default :func:`free_bytes`).
    """

    def __init__(
        self,
        engine: DiskEngine | None,
        capacity: int,
        dirs: tuple[os.PathLike[str], ...],
        *,
        clock: Callable[[], float] = time.monotonic,
        read_free: Callable[[Iterable[os.PathLike[str]]], int] | None = None,
    ) -> None:
        self.engine = engine
        self.capacity = capacity
        self._dirs = dirs
        self._clock = clock
        self._read_free = read_free
        self.deleting = 0
        """Spill bytes of released entries whose delete has not run yet: free for planning."""
        self._fs_free = 0
        self._fs_read_at: float | None = None
        self._fs_planned = 0
        self.failed_at: float | None = None
        """When the last write failed, while the tier pauses after it."""
        self.need = 0
        """After ENOSPC (or a spill that found too little free space): the bytes that must be
        free again before the tier is used (Note: [Disk full until space returns])."""
        self.error: str | None = None
        """The last write error other than ENOSPC/EDQUOT, while the tier pauses after it."""
        # After the engine itself ran out of space, only space a blob can be placed in counts
        # toward ``need`` (DiskEngine.placeable_bytes), not scattered free pieces of its files.
        self._engine_was_full = False
        self._quota_failures = 0
        """EDQUOT failures in a row, since the last write that succeeded (Note: [A full
        quota])."""

    def recheck(self) -> bool:
        """End a pause whose time is up and whose space is back; then whether spills may go
        to disk now (Note: [Disk full until space returns])."""
        if self.engine is None:
            return False
        if self.failed_at is None and not self.need:
            return True
        failed_at = self.failed_at
        if failed_at is not None and self._clock() - failed_at < RETRY_SECONDS:
            return False
        if self._quota_failures:
            assert failed_at is not None
            # Note: [A full quota]: the filesystem's free space says nothing here.
            pause = min(RETRY_SECONDS * 2 ** (self._quota_failures - 1), QUOTA_RETRY_MAX_SECONDS)
            own = self.engine.placeable_bytes() + self.deleting
            if own < self.need and self._clock() - failed_at < pause:
                return False
        elif self.need and self.free(placeable=self._engine_was_full) < self.need:
            return False
        self.failed_at = None
        self.need = 0
        self.error = None
        self._engine_was_full = False
        if failed_at is not None:
            log.info("tierstore: retrying the disk tier after an earlier failure")
        return True

    @property
    def paused(self) -> bool:
        """Whether the tier waits out a failure or for free space (what :meth:`recheck`
        tests before it may end the wait)."""
        return self.engine is not None and (self.failed_at is not None or self.need > 0)

    def room(self, used: int) -> int:
        """Bytes the tier may still take, ``used`` being taken (0 while paused)."""
        return max(0, self.capacity - used) if self.recheck() else 0

    def footprint(self, nbytes: int) -> int:
        """Bytes of disk a spill of ``nbytes`` occupies."""
        assert self.engine is not None
        return self.engine.footprint(nbytes)

    def verdict(self, footprint: int, used: int) -> Verdict:
        """May a spill of ``footprint`` go now, with ``used`` bytes on disk? When the
        filesystems lack the room, the tier stays off until they have it."""
        if used + footprint > self.capacity:
            return Verdict.OVER_CAPACITY
        # Other processes share the disk: a spill that seems not to fit reads the space again.
        if self.free() < footprint and self.free(fresh=True) < footprint:
            # No error happened, so no pause: the tier is back as soon as the space is.
            self.need = footprint
            return Verdict.NO_SPACE
        return Verdict.FITS

    def reserve(self, footprint: int) -> None:
        """A spill of ``footprint`` is planned: the free space read before it is that much
        less."""
        self._fs_planned += footprint

    def free(self, *, fresh: bool = False, placeable: bool = False) -> int:
        """Free bytes for spilling: the filesystems' free space, less spills planned since it
        was read, plus the engine's reusable space (with ``placeable``, only its biggest
        placeable piece) and deletes still pending."""
        now = self._clock()
        if fresh or self._fs_read_at is None or now - self._fs_read_at > FREE_SPACE_TTL_SECONDS:
            self._fs_free = (self._read_free or free_bytes)(self._dirs)
            self._fs_read_at = now
            self._fs_planned = 0
        engine = self.engine
        held = (
            0
            if engine is None
            else (engine.placeable_bytes() if placeable else engine.reusable_bytes())
        )
        return self._fs_free - self._fs_planned + held + self.deleting

    def write_succeeded(self) -> None:
        """A spill reached the disk: a run of quota failures is over."""
        self._quota_failures = 0

    def write_failed(self, what: str, footprint: int, exc: BaseException) -> None:
        """Pause the tier after a failed write of ``what`` (``footprint`` bytes), and say so.

        Note: [One failure, many tensors]
            The tensors of a pack fail together, and so do writes already in flight when the
            first failed: each calls this. Only a failure while the tier was not paused starts
            a pause, counts toward the quota's doubling and warns; the others are logged at
            INFO and only raise the room the pause waits for. Counted per tensor, one failed
            pack of eight 64 KiB tensors doubled the quota's pause seven times (60 s instead
            of 1 s) and logged eight warnings.
        """
        paused = self.failed_at is not None  # this write was in flight when the tier paused
        self.failed_at = self._clock()
        code = exc.errno if isinstance(exc, OSError) else None
        why = errno.errorcode.get(code, "") if code else ""
        level = logging.INFO if paused else logging.WARNING
        if code == errno.EDQUOT:
            self.need = max(footprint, self.need if paused else 1)
            self._engine_was_full = True
            if not paused or not self._quota_failures:  # a quota's first failure counts
                self._quota_failures += 1
            if self._quota_failures > 1:
                level = logging.INFO  # the run's first failure warned
            pause = min(RETRY_SECONDS * 2 ** (self._quota_failures - 1), QUOTA_RETRY_MAX_SECONDS)
            until = (
                f"until its own files have that much room, or for {pause:.0f}s before it "
                f"tries again (doubling up to {QUOTA_RETRY_MAX_SECONDS:.0f}s while the quota "
                "stays full)"
            )
        elif code == errno.ENOSPC:
            self.need = max(footprint, self.need if paused else 1)
            self._engine_was_full = True
            until = "until that much space is free again"
        else:
            detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            self.error = f"{why}: {detail}" if why else detail
            until = f"for {RETRY_SECONDS:.0f}s"
        log.log(
            level,
            "tierstore: writing %s to disk failed (%s%s); it stays in memory and the disk tier "
            "pauses %s",
            what,
            f"{why}: " if why else "",
            exc,
            until,
        )

    def advice(self) -> tuple[str, str]:
        """Why the disk tier takes nothing now (or ``""``), and what to do about a full store.

        A disk that fails its writes is not fixed by a bigger ``TIERSTORE_DISK_BYTES``; the
        advice says what failed instead.
        """
        if self.recheck():
            return "", "raise TIERSTORE_HOST_BYTES or TIERSTORE_DISK_BYTES, or release tensors"
        if self.engine is None:
            return "", "raise TIERSTORE_HOST_BYTES, or release tensors"
        if self.error is not None:
            return (
                f" (disk tier unavailable: paused after a write error: {self.error})",
                "fix what the write error names (see the warning logged with it), raise "
                "TIERSTORE_HOST_BYTES, or release tensors",
            )
        where = os.pathsep.join(map(str, self._dirs))
        if self._quota_failures:
            return (
                f" (disk tier unavailable: your disk quota is full under {where})",
                "free space within your quota or spill elsewhere (TIERSTORE_DISK_DIR), raise "
                "TIERSTORE_HOST_BYTES, or release tensors",
            )
        return (
            f" (disk tier unavailable: full until {format_size(self.need)} are free under {where})",
            "free disk space, raise TIERSTORE_HOST_BYTES, or release tensors",
        )
