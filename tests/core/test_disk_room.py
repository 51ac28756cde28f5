"""Note: [Disk full until space returns], with a fake clock and a fake filesystem."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import pytest

from tierstore.core import _disk_room as disk_room
from tierstore.core._disk_room import DiskRoom, Verdict

MiB = 1 << 20


class Engine:
    """The three things the room asks an engine."""

    reusable = 0
    placeable: int | None = None  # None: all of the reusable space

    def footprint(self, nbytes: int) -> int:
        return -(-nbytes // 4096) * 4096

    def reusable_bytes(self) -> int:
        return self.reusable

    def placeable_bytes(self) -> int:
        return self.reusable if self.placeable is None else self.placeable


class World:
    """A clock and a filesystem whose free space a test sets."""

    def __init__(self) -> None:
        self.now = 100.0
        self.free = 50 * MiB
        self.reads = 0

    def clock(self) -> float:
        return self.now

    def read_free(self, dirs: object) -> int:
        self.reads += 1
        return self.free


@pytest.fixture
def world() -> World:
    return World()


def _room(world: World, capacity: int = 40 * MiB) -> DiskRoom:
    return DiskRoom(
        Engine(),  # type: ignore[arg-type]
        capacity,
        (Path("/nonexistent"),),
        clock=world.clock,
        read_free=world.read_free,
    )


def test_no_engine_means_no_disk_room(world: World) -> None:
    room = DiskRoom(None, 0, (), clock=world.clock, read_free=world.read_free)
    assert not room.recheck() and room.room(0) == 0
    assert room.advice() == ("", "raise TIERSTORE_HOST_BYTES, or release tensors")


def test_capacity_and_free_space_decide_the_verdict(world: World) -> None:
    room = _room(world)
    assert room.verdict(MiB, used=39 * MiB) is Verdict.FITS
    assert room.verdict(2 * MiB, used=39 * MiB) is Verdict.OVER_CAPACITY
    world.free = MiB // 2  # within the reading's TTL the store trusts it; then reads again
    assert room.verdict(MiB, used=0) is Verdict.FITS
    world.now += 1
    assert room.verdict(MiB, used=0) is Verdict.NO_SPACE
    assert room.need == MiB and not room.recheck()  # off until the space is back
    world.free = 2 * MiB
    world.now += 1  # the reading is cached for FREE_SPACE_TTL_SECONDS
    assert room.recheck() and room.need == 0


def test_free_space_is_read_once_per_ttl_less_what_was_planned_since(world: World) -> None:
    room = _room(world)
    assert room.free() == 50 * MiB and world.reads == 1
    room.reserve(10 * MiB)
    assert room.free() == 40 * MiB and world.reads == 1
    world.now += disk_room.FREE_SPACE_TTL_SECONDS * 2
    assert room.free() == 50 * MiB and world.reads == 2  # a fresh reading forgets the plans


def test_a_spill_that_seems_not_to_fit_reads_the_space_again(world: World) -> None:
    room = _room(world)
    room.free()
    world.free = MiB  # another process filled the disk since the reading
    room.reserve(49 * MiB)
    world.free = 10 * MiB
    assert room.verdict(5 * MiB, used=0) is Verdict.FITS and world.reads == 2


def test_reusable_extents_and_pending_deletes_count_as_free(world: World) -> None:
    room = _room(world)
    world.free = 0
    assert room.engine is not None
    room.engine.reusable = 3 * MiB  # type: ignore[attr-defined]
    room.deleting = MiB
    assert room.free() == 4 * MiB


def test_a_write_error_pauses_the_tier_then_it_retries(
    world: World, caplog: pytest.LogCaptureFixture
) -> None:
    room = _room(world)
    with caplog.at_level(logging.INFO, logger="tierstore"):
        room.write_failed("tensor #1", MiB, OSError(errno.EIO, "Input/output error"))
        assert not room.recheck() and room.room(0) == 0
        off, advice = room.advice()
        assert "paused after a write error: EIO: Input/output error" in off
        assert "TIERSTORE_DISK_BYTES" not in advice
        world.now += disk_room.RETRY_SECONDS
        assert room.recheck() and room.error is None and room.room(MiB) == 39 * MiB
    assert "retrying the disk tier" in caplog.text


def test_enospc_keeps_the_tier_off_until_the_space_returns(world: World) -> None:
    room = _room(world)
    world.free = 0
    room.write_failed("tensor #1", 2 * MiB, OSError(errno.ENOSPC, "No space left on device"))
    world.now += 10 * disk_room.RETRY_SECONDS
    assert not room.recheck()
    off, advice = room.advice()
    assert "full until 2.0 MiB are free" in off and "free disk space" in advice
    world.free = 2 * MiB
    world.now += 1
    assert room.recheck()


def test_after_enospc_only_placeable_space_in_the_files_counts(world: World) -> None:
    room = _room(world)
    engine = room.engine
    world.free = 0
    engine.reusable, engine.placeable = 8 * MiB, MiB  # type: ignore[union-attr]
    room.write_failed("tensor #1", 2 * MiB, OSError(errno.ENOSPC, "No space left on device"))
    world.now += 10 * disk_room.RETRY_SECONDS
    assert not room.recheck()  # 8 MiB free in pieces, none of 2 MiB
    engine.placeable = 2 * MiB  # type: ignore[union-attr]
    world.now += 1
    assert room.recheck()


def test_a_full_quota_backs_off_instead_of_failing_every_second(
    world: World, caplog: pytest.LogCaptureFixture
) -> None:
    """Note: [A full quota]: statvfs shows the filesystem free, so the ENOSPC rule ended the
    pause at once and every write failed, with a warning, once a second for the whole run."""
    room = _room(world)
    engine = room.engine
    assert engine is not None
    quota = OSError(errno.EDQUOT, "Disk quota exceeded")
    with caplog.at_level(logging.INFO, logger="tierstore"):
        room.write_failed("tensor #1", 2 * MiB, quota)
        off, advice = room.advice()
        assert "quota is full" in off and "TIERSTORE_DISK_DIR" in advice
        # Plenty of free space on the filesystem, and the pause doubles with each failure.
        pauses = []
        for n in range(1, 9):
            waited = 0.0
            while not room.recheck():
                world.now += 0.5
                waited += 0.5
            pauses.append(waited)
            room.write_failed(f"tensor #{n + 1}", 2 * MiB, quota)
        assert pauses == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0]
        # Room in its own files ends the pause early: reusing it needs no new quota.
        world.now += 1
        engine.reusable = 2 * MiB  # type: ignore[attr-defined]
        assert room.recheck()
        room.write_succeeded()
        room.write_failed("tensor #10", 2 * MiB, quota)  # a new run: 1 s, and a warning again
        engine.reusable = 0  # type: ignore[attr-defined]
        world.now += 1
        assert room.recheck()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2, [r.getMessage() for r in warnings]
    assert "for 1s before it tries again" in warnings[1].getMessage()


@pytest.mark.parametrize("code", [errno.EDQUOT, errno.ENOSPC, errno.EIO])
def test_the_tensors_of_one_failed_pack_are_one_failure(
    world: World, caplog: pytest.LogCaptureFixture, code: int
) -> None:
    """Note: [One failure, many tensors]: eight tensors of one pack failing together doubled
    the quota's pause seven times (60 s) and warned eight times."""
    room = _room(world)
    error = OSError(code, os.strerror(code))
    with caplog.at_level(logging.INFO, logger="tierstore"):
        for n in range(8):
            room.write_failed(f"tensor #{n + 1}", (n + 1) * 64 * 1024, error)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "tensor #1" in warnings[0].getMessage()
    if code != errno.EIO:
        assert room.need == 8 * 64 * 1024  # the largest that failed
    world.now += disk_room.RETRY_SECONDS
    if code == errno.ENOSPC:
        world.free = MiB
    assert room.recheck(), "one failure pauses the tier for one retry interval"
