"""The room a put may take (Note: [Room for a put]), on the store's own tier counts."""

from __future__ import annotations

from types import SimpleNamespace

from tierstore._state import Tier
from tierstore.core._core import StoreCore

M = 1 << 20


def room(
    *,
    host_bytes: int,
    device_bytes: int = 0,
    device_resting: int = 0,
    host_used: int = 0,
    host_resting: int = 0,
    host_reserved: int = 0,
    spilling: int = 0,
    disk_left: int = 0,
) -> int:
    """``StoreCore._free_room`` over plain numbers: ``spilling`` bytes are being written to
    disk (their host copies in ``host_used``, their disk room taken), ``disk_left`` is what
    the disk tier may still take."""
    store = SimpleNamespace(
        config=SimpleNamespace(device_bytes=device_bytes, host_bytes=host_bytes),
        table=SimpleNamespace(
            resting={Tier.DEVICE: device_resting, Tier.HOST: host_resting},
            used={Tier.HOST: host_used, Tier.DISK: 0},
            host_reserved=host_reserved,
        ),
        semaphore=SimpleNamespace(inflight=spilling + host_reserved),
        disk=SimpleNamespace(room=lambda used: disk_left),
    )
    return StoreCore._free_room(store)  # type: ignore[arg-type]


def test_each_tier_gives_its_free_room() -> None:
    assert room(host_bytes=100 * M, host_used=30 * M, host_resting=30 * M, disk_left=50 * M) == (
        120 * M
    )


def test_a_spill_in_flight_leaves_the_host_tier() -> None:
    """40 MiB spilling (its disk room taken), 20 resting, 50 on the device waiting for a
    copy: once the spill lands the host holds 70 of 100, so 30 more fit there, and 10 on
    disk. A first version counted the spill in the host tier too and admitted 10."""
    got = room(
        host_bytes=100 * M,
        device_resting=50 * M,
        host_used=60 * M,
        host_resting=20 * M,
        spilling=40 * M,
        disk_left=10 * M,
    )
    assert got == 40 * M


def test_what_waits_past_a_tier_takes_the_room_below() -> None:
    """50 MiB resting and 50 fetched back (their home is the host tier), 50 on the device
    waiting for a copy: the host tier will hold 150 of 100, and the 30 left on disk do not
    cover the 50 over. Nothing fits."""
    got = room(
        host_bytes=100 * M,
        device_resting=50 * M,
        host_used=100 * M,
        host_resting=50 * M,
        disk_left=30 * M,
    )
    assert got == 0
    # A host tier of 0 with a put waiting for its spill: its 4 MiB take the disk's room.
    assert (
        room(host_bytes=0, host_used=8 * M, host_resting=4 * M, spilling=4 * M, disk_left=5 * M)
        == M
    )
