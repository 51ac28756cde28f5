"""Note: [The cascade], planned without a loop, an engine or a store: plain numbers in, steps
out."""

from __future__ import annotations

from dataclasses import dataclass, field

from tierstore.core._cascade import Limits, Move, plan_device, plan_spills
from tierstore.core._disk_room import Verdict

MiB = 1 << 20


@dataclass(frozen=True)
class E:
    """An entry as the planners see it."""

    key: int
    nbytes: int
    on_cpu: bool = True


@dataclass
class Disk:
    """A disk tier with ``free`` bytes on its filesystem and pages of 4 KiB."""

    capacity: int
    free: int
    reserved: list[int] = field(default_factory=list)

    def footprint(self, nbytes: int) -> int:
        return -(-nbytes // 4096) * 4096

    def verdict(self, footprint: int, used: int) -> Verdict:
        if used + footprint > self.capacity:
            return Verdict.OVER_CAPACITY
        if self.free - sum(self.reserved) < footprint:
            return Verdict.NO_SPACE
        return Verdict.FITS

    def reserve(self, footprint: int) -> None:
        self.reserved.append(footprint)


def _keys(plan: object) -> list[tuple[int, Move]]:
    return [(s.entry.key, s.move) for s in plan.steps]  # type: ignore[attr-defined]


def test_the_oldest_device_entries_move_until_the_device_fits() -> None:
    limits = Limits(device_bytes=2 * MiB, host_bytes=10 * MiB, max_inflight_bytes=64 * MiB)
    entries = [E(k, MiB) for k in range(1, 6)]
    plan = plan_device(limits, resting=5 * MiB, inflight=0, oldest=iter(entries))
    assert _keys(plan) == [(1, Move.RELABEL), (2, Move.RELABEL), (3, Move.RELABEL)]
    assert not plan.blocked


def test_the_planner_reads_only_as_far_as_it_goes() -> None:
    limits = Limits(device_bytes=0, host_bytes=0, max_inflight_bytes=64 * MiB)
    looked: list[int] = []

    def oldest() -> object:
        for k in range(1, 1000):
            looked.append(k)
            yield E(k, MiB)

    plan = plan_device(limits, resting=2 * MiB, inflight=0, oldest=oldest())  # type: ignore[arg-type]
    assert [s.entry.key for s in plan.steps] == [1, 2]
    assert looked == [1, 2, 3]


def test_accelerator_entries_are_copied_within_the_save_semaphore() -> None:
    # Note: [The save semaphore]: 3 MiB may move at once; the first move always may.
    limits = Limits(device_bytes=0, host_bytes=10 * MiB, max_inflight_bytes=3 * MiB)
    entries = [E(k, 2 * MiB, on_cpu=False) for k in range(1, 4)]
    plan = plan_device(limits, resting=6 * MiB, inflight=0, oldest=entries)
    assert _keys(plan) == [(1, Move.COPY)] and plan.blocked
    big = [E(1, 8 * MiB, on_cpu=False)]
    plan = plan_device(limits, resting=8 * MiB, inflight=0, oldest=big)
    assert _keys(plan) == [(1, Move.COPY)] and not plan.blocked  # bigger than the limit
    plan = plan_device(limits, resting=8 * MiB, inflight=MiB, oldest=big)
    assert _keys(plan) == [] and plan.blocked


def test_cpu_relabels_take_nothing_from_the_semaphore() -> None:
    limits = Limits(device_bytes=0, host_bytes=10 * MiB, max_inflight_bytes=MiB)
    plan = plan_device(limits, resting=4 * MiB, inflight=MiB, oldest=[E(1, 2 * MiB), E(2, 2 * MiB)])
    assert _keys(plan) == [(1, Move.RELABEL), (2, Move.RELABEL)] and not plan.blocked


def test_host_entries_spill_oldest_first_until_the_host_fits() -> None:
    limits = Limits(device_bytes=0, host_bytes=2 * MiB + 2, max_inflight_bytes=64 * MiB)
    disk = Disk(capacity=100 * MiB, free=100 * MiB)
    entries = [E(k, MiB + 1) for k in range(1, 5)]
    plan = plan_spills(limits, 4 * MiB + 4, 0, 0, entries, disk)
    assert _keys(plan) == [(1, Move.SPILL), (2, Move.SPILL)]
    assert [s.footprint for s in plan.steps] == [MiB + 4096] * 2 == disk.reserved
    assert plan.kept is None and not plan.blocked


def test_a_full_disk_keeps_the_oldest_host_entry_and_says_why() -> None:
    limits = Limits(device_bytes=0, host_bytes=0, max_inflight_bytes=64 * MiB)
    entries = [E(k, MiB) for k in range(1, 5)]
    over = plan_spills(limits, 4 * MiB, 0, 0, entries, Disk(capacity=2 * MiB, free=10 * MiB))
    assert _keys(over) == [(1, Move.SPILL), (2, Move.SPILL)]
    assert over.kept == entries[2] and over.why is Verdict.OVER_CAPACITY
    tight = plan_spills(limits, 4 * MiB, 0, 0, entries, Disk(capacity=10 * MiB, free=MiB))
    assert _keys(tight) == [(1, Move.SPILL)]
    assert tight.kept == entries[1] and tight.why is Verdict.NO_SPACE


def test_spills_stop_at_the_save_semaphore_without_reserving_disk() -> None:
    limits = Limits(device_bytes=0, host_bytes=0, max_inflight_bytes=2 * MiB)
    disk = Disk(capacity=100 * MiB, free=100 * MiB)
    plan = plan_spills(limits, 4 * MiB, MiB, 0, [E(k, MiB) for k in range(1, 5)], disk)
    assert _keys(plan) == [(1, Move.SPILL)] and plan.blocked and plan.kept is None
    assert disk.reserved == [MiB]


def test_nothing_moves_when_every_tier_has_room() -> None:
    limits = Limits(device_bytes=4 * MiB, host_bytes=4 * MiB, max_inflight_bytes=MiB)
    entries = [E(1, MiB)]
    assert plan_device(limits, 4 * MiB, 0, entries).steps == ()
    assert plan_spills(limits, 4 * MiB, 0, 0, entries, Disk(0, 0)).steps == ()
