"""Placing blobs over the spill directories: chunks striped round-robin, one extent per
directory used, full directories skipped."""

from __future__ import annotations

import asyncio
import errno
import logging
import time
from typing import TYPE_CHECKING

from tierstore.tiers._engine import DISK_FULL, QUOTA_RETRY_SECONDS
from tierstore.tiers.raw._layout import Blob, Chunk, cut
from tierstore.tiers.raw._syscalls import pad

if TYPE_CHECKING:
    from concurrent.futures import Executor

    from tierstore.tiers.raw._spill_file import SpillFile

__all__ = ["QUOTA_RETRY_SECONDS", "Striping"]

"""How long a directory whose spill file hit its user's quota is skipped before it is tried
again (Note: [A full directory is skipped])."""

log = logging.getLogger("tierstore")


class Striping:
    """Where each new blob goes: chunk ``i`` in directory ``(first + i) % n``, where ``first``
    rotates from blob to blob, so one big blob keeps every disk busy and small ones spread.

    Args:
        files: the spill file of each directory.
        chunk: bytes per chunk.
        pool: the I/O threads, which grow a spill file when it has no free extent left.
    """

    def __init__(self, files: list[SpillFile], chunk: int, pool: Executor) -> None:
        self.files = files
        self._chunk = chunk
        self._pool = pool
        self._next_dir = 0

    async def place(self, size: int, lead: int) -> Blob:
        """Cut a blob into chunks, stripe them, and allocate one extent per directory used.

        Raises:
            OSError: every directory is full (ENOSPC), or a spill file could not grow.
        """
        if size == 0:
            # Nothing to place: asking the directories would mark a full one as having room.
            return Blob(0, [], [], [], 0)
        n_dirs = len(self.files)
        cuts = cut(size, lead, self._chunk)
        on_disk = [pad(chunk_lead + length) for _, length, chunk_lead in cuts]
        first = self._next_dir
        self._next_dir = (first + len(cuts)) % n_dirs
        rotation = [(first + k) % n_dirs for k in range(n_dirs)]
        # What one directory takes of this blob: its chunks, in one extent.
        share = max(sum(on_disk[k::n_dirs]) for k in range(n_dirs)) if on_disk else 0
        return await self._place_somewhere(rotation, share, size, lead, cuts)

    async def place_pack(self, total: int) -> tuple[SpillFile, int]:
        """One extent of ``total`` bytes for a pack, in the next directory with room.

        Raises:
            OSError: every directory is full (ENOSPC), or a spill file could not grow.
        """
        n_dirs = len(self.files)
        first = self._next_dir
        self._next_dir = (first + 1) % n_dirs
        rotation = [(first + k) % n_dirs for k in range(n_dirs)]
        blob = await self._place_somewhere(rotation, total, total, 0, [(0, total, 0)], alone=True)
        (f, offset, _) = blob.extents[0]
        return f, offset

    async def _place_somewhere(
        self,
        rotation: list[int],
        least: int,
        size: int,
        lead: int,
        cuts: list[tuple[int, int, int]],
        *,
        alone: bool = False,
    ) -> Blob:
        """Place over the directories of ``rotation`` that have room (only the first of them
        when ``alone``), dropping each that turns out full (Note: [A full directory is
        skipped])."""
        while True:
            order = self._with_room(rotation, least)
            try:
                return await self._place_on(order[:1] if alone else order, size, lead, cuts)
            except _DirectoryFull as full:
                rotation.remove(full.index)
                if full.error.errno in DISK_FULL:
                    self._mark_full(full.index, full.error, bool(rotation))
                elif rotation:
                    self._warn_failing(full.index, full.error)
                if not rotation:
                    raise full.error from None

    async def _place_on(
        self, order: list[int], size: int, lead: int, cuts: list[tuple[int, int, int]]
    ) -> Blob:
        """Stripe the chunks over the directories ``order`` names, chunk ``i`` in
        ``order[i % len(order)]``, and allocate one extent in each.

        Raises:
            _DirectoryFull: a directory's spill file could not grow for want of space.
        """
        on_disk = [pad(chunk_lead + length) for _, length, chunk_lead in cuts]
        per_dir: dict[int, list[int]] = {}
        for i in range(len(cuts)):
            per_dir.setdefault(order[i % len(order)], []).append(i)
        blob = Blob(size, [], [], [0] * len(cuts), lead)
        offsets: dict[int, int] = {}
        try:
            for d, indices in per_dir.items():
                f = self.files[d]
                need = sum(on_disk[i] for i in indices)
                offset = f.extents.alloc(need)
                while offset is None:
                    # See Note: [One growth for many waiting writers].
                    try:
                        offset = await self._grow(f, need)
                    except OSError as e:
                        f.note_failure(e)
                        raise _DirectoryFull(d, e) from e
                blob.extents.append((f, offset, need))
                at = offset
                for i in indices:
                    offsets[i] = at
                    at += on_disk[i]
        except BaseException:
            blob.free()
            raise
        blob.chunks = [
            Chunk(self.files[order[i % len(order)]], offsets[i], start, length, chunk_lead)
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
            for its share of the blob (its chunks, which take one extent), or its spill file
            has a free extent that long; until then its chunks go to the others. (Tried again when
            the room for one chunk was back, or the free extents summed to one, a full directory
            failed two growths on every big blob.) The store's free-space check sums every
            directory, and a full one adds about nothing to that sum. After EDQUOT the filesystem's
            free space says nothing (``statvfs`` does not see a quota, and every placement retried
            the directory): it is tried again after ``QUOTA_RETRY_SECONDS``, or once its file has
            the room.
        """
        order = []
        now = time.monotonic()
        for d in rotation:
            f = self.files[d]
            if f.failing_at is not None:
                # Note: [A failing directory is skipped]
                if now - f.failing_at < QUOTA_RETRY_SECONDS:
                    continue
                f.failing_at = None
                log.info("tierstore: trying spill directory %s again", f.path.parent)
            if f.full and (
                f.extents.largest() >= least
                or (
                    f.free_space() >= least
                    if f.quota_full_at is None
                    else now - f.quota_full_at >= QUOTA_RETRY_SECONDS
                )
            ):
                f.full, f.quota_full_at = False, None
                log.info("tierstore: spill directory %s has room again", f.path.parent)
            if not f.full:
                order.append(d)
        # All full: try them all anyway (the space may be back); the error then says so.
        return order or list(rotation)

    def _warn_failing(self, index: int, error: OSError) -> None:
        """Note: [A failing directory is skipped]
        A directory whose spill file fails a write or a growth with an error a full disk
        does not explain (EIO from a dying drive, EROFS after the filesystem remounted
        read-only, ENOENT with the directory removed) is skipped for
        ``QUOTA_RETRY_SECONDS``, then tried again; its chunks go to the other directories
        meanwhile. The write that failed fails (its tensor stays in memory, and the store
        pauses the disk tier a second); placements after it no longer touch that directory
        (those under way when it failed may still try it once).
        Before, every big blob striped over it and failed, and the disk tier paused once
        a second for as long as the fault lasted while the other directories sat unused.
        With every directory failing, all are tried, and the write's error says why.
        """
        f = self.files[index]
        first, f.warned_failing = not f.warned_failing, True
        log.log(
            logging.WARNING if first else logging.INFO,
            "tierstore: spill directory %s failed (%s); spilling to the other directories, "
            "trying it again every %.0fs",
            f.path.parent,
            error.strerror or error,
            QUOTA_RETRY_SECONDS,
        )

    def _mark_full(self, index: int, error: OSError, others: bool) -> None:
        f = self.files[index]
        f.full = True
        f.quota_full_at = time.monotonic() if error.errno == errno.EDQUOT else None
        if others and not f.warned_full:
            f.warned_full = True
            log.warning(
                "tierstore: spill directory %s is full (%s); spilling to the other "
                "directories until it has room again (warned once)",
                f.path.parent,
                error.strerror or error,
            )

    async def _grow(self, f: SpillFile, need: int) -> int | None:
        fut = asyncio.get_running_loop().run_in_executor(self._pool, f.grow_and_alloc, need)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            # The thread may still allocate; give the extent back when it does.
            fut.add_done_callback(lambda done: _free_granted(done, f, need))
            raise


class _DirectoryFull(Exception):
    """The spill file of directory ``index`` could not grow: ``error`` says why (ENOSPC or
    EDQUOT for a full one)."""

    def __init__(self, index: int, error: OSError) -> None:
        super().__init__(index, error)
        self.index = index
        self.error = error


def _free_granted(done: asyncio.Future[int | None], f: SpillFile, nbytes: int) -> None:
    if not done.cancelled() and done.exception() is None:
        offset = done.result()
        if offset is not None:
            f.extents.free(offset, nbytes)
