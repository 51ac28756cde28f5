"""The cascade: which resting entries move down a tier, planned without touching anything.

Note: [The cascade]
    Newest entries stay in the fastest tier. While the movable bytes resting on the device
    pass ``device_bytes``, the oldest device entry moves to the host tier: on the CPU a
    relabel (the host tier holds the tensor itself), on an accelerator a copy into the pinned
    pool. While the bytes resting in the host tier, and reserved there by copies on their way,
    pass ``host_bytes``, the oldest host entry is written to disk, if the disk tier has room
    (its capacity and the filesystems' real free space) and is not paused after a failure.
    Every copy and spill takes its bytes from the save semaphore (Note: [The save
    semaphore]); a move the semaphore cannot take stops that tier's walk. Backward consumes
    newest first, so what it needs next is what is closest.

    The planners below are pure functions of the tier loads, the capacities and the entries
    oldest first: the store carries out a plan under its lock, so planning needs no loop and
    no engine, and tests call them with plain numbers.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from tierstore.core._disk_room import Verdict
from tierstore.core._save_semaphore import has_room

if TYPE_CHECKING:
    from collections.abc import Iterable

__all__ = [
    "Candidate",
    "DevicePlan",
    "DiskSide",
    "Limits",
    "Move",
    "SpillPlan",
    "Step",
    "plan_device",
    "plan_spills",
]


class Candidate(Protocol):
    """What the planners read of an entry."""

    @property
    def nbytes(self) -> int: ...
    @property
    def on_cpu(self) -> bool: ...


E = TypeVar("E", bound=Candidate)


class DiskSide(Protocol):
    """What the spill planner asks of the disk tier (the store's ``DiskRoom``)."""

    def footprint(self, nbytes: int) -> int: ...
    def verdict(self, footprint: int, used: int) -> Verdict: ...
    def reserve(self, footprint: int) -> None: ...


@dataclass(frozen=True, slots=True)
class Limits:
    """The capacities the cascade keeps."""

    device_bytes: int
    """Movable bytes that may rest on their device."""
    host_bytes: int
    """Bytes the host tier holds, copies on their way into it included."""
    max_inflight_bytes: int
    """The save semaphore's size."""


class Move(enum.Enum):
    """What carrying out a step does."""

    RELABEL = "relabel"
    """A CPU entry becomes a host entry: same tensor, no I/O."""
    COPY = "copy"
    """An accelerator entry is copied into host memory."""
    SPILL = "spill"
    """A host entry is written to disk."""


@dataclass(frozen=True, slots=True)
class Step(Generic[E]):
    """One entry to move."""

    entry: E
    move: Move
    footprint: int = 0
    """Disk bytes a spill takes."""


@dataclass(frozen=True, slots=True)
class DevicePlan(Generic[E]):
    """Moves out of the device tier, oldest first."""

    steps: tuple[Step[E], ...]
    blocked: bool
    """The save semaphore stopped the walk: put waits."""


@dataclass(frozen=True, slots=True)
class SpillPlan(Generic[E]):
    """Spills out of the host tier, oldest first."""

    steps: tuple[Step[E], ...]
    blocked: bool
    """The save semaphore stopped the walk: put waits."""
    kept: E | None = None
    """The oldest host entry the disk could not take (``why`` says why); it stays in memory."""
    why: Verdict = Verdict.FITS


def plan_device(limits: Limits, resting: int, inflight: int, oldest: Iterable[E]) -> DevicePlan[E]:
    """Which device entries move to the host tier (Note: [The cascade]).

    Args:
        limits: the capacities.
        resting: movable bytes resting on the device.
        inflight: bytes the save semaphore holds.
        oldest: the movable entries resting on the device, oldest first; read lazily, only as
            far as the plan goes.
    """
    steps: list[Step[E]] = []
    blocked = False
    for e in oldest:
        if resting <= limits.device_bytes:
            break
        if e.on_cpu:
            steps.append(Step(e, Move.RELABEL))
        else:
            if not has_room(inflight, e.nbytes, limits.max_inflight_bytes):
                blocked = True
                break
            inflight += e.nbytes
            steps.append(Step(e, Move.COPY))
        resting -= e.nbytes
    return DevicePlan(tuple(steps), blocked)


def plan_spills(
    limits: Limits,
    host_load: int,
    inflight: int,
    disk_used: int,
    oldest: Iterable[E],
    disk: DiskSide,
) -> SpillPlan[E]:
    """Which host entries are written to disk (Note: [The cascade]).

    Args:
        limits: the capacities.
        host_load: bytes resting in the host tier plus those reserved by copies on their way.
        inflight: bytes the save semaphore holds.
        disk_used: bytes the disk tier holds.
        oldest: the entries resting in the host tier, oldest first; read lazily.
        disk: the disk tier's room; each spill planned is reserved there as it is planned.
    """
    steps: list[Step[E]] = []
    for e in oldest:
        if host_load <= limits.host_bytes:
            break
        footprint = disk.footprint(e.nbytes)
        verdict = disk.verdict(footprint, disk_used)
        if verdict is not Verdict.FITS:
            return SpillPlan(tuple(steps), False, e, verdict)
        if not has_room(inflight, e.nbytes, limits.max_inflight_bytes):
            return SpillPlan(tuple(steps), True)
        disk.reserve(footprint)
        steps.append(Step(e, Move.SPILL, footprint))
        inflight += e.nbytes
        disk_used += footprint
        host_load -= e.nbytes
    return SpillPlan(tuple(steps), False)
