"""Whether a put fits (Note: [Room for a put]), on the store's own tier counts."""

from __future__ import annotations

from types import SimpleNamespace

from tierstore._state import Tier
from tierstore.core._core import StoreCore

M = 1 << 20
PAGE = 4096


def fits(
    nbytes: int,
    *,
    host_bytes: int,
    device_bytes: int = 0,
    device_resting: int = 0,
    host_used: int = 0,
    host_resting: int = 0,
    host_reserved: int = 0,
    spilling: int = 0,
    disk_left: int = 0,
) -> bool:
    """``StoreCore._has_room`` over plain numbers: ``spilling`` bytes are being written to
    disk (their host copies in ``host_used``, their disk room taken), ``disk_left`` is what
    the disk tier may still take; a spill takes whole pages."""
    store = SimpleNamespace(
        config=SimpleNamespace(device_bytes=device_bytes, host_bytes=host_bytes),
        table=SimpleNamespace(
            resting={Tier.DEVICE: device_resting, Tier.HOST: host_resting},
            used={Tier.HOST: host_used, Tier.DISK: 0},
            host_reserved=host_reserved,
        ),
        semaphore=SimpleNamespace(inflight=spilling + host_reserved),
        disk=SimpleNamespace(room=lambda used: disk_left, footprint=lambda n: -(-n // PAGE) * PAGE),
    )
    return StoreCore._has_room(store, nbytes)  # type: ignore[arg-type]


def room(**tiers: int) -> int:
    """The most bytes that fit, in whole pages."""
    fitting = [n for n in range(0, 400 * M, PAGE) if fits(n, **tiers)]
    return max(fitting)


def test_each_tier_gives_its_free_room() -> None:
    """A put fits in the host tier, or pushes older entries onto the disk to rest there;
    one too big to rest there spills itself, after every older entry."""
    tiers = {"host_bytes": 100 * M, "host_used": 30 * M, "host_resting": 30 * M}
    assert room(**tiers, disk_left=50 * M) == 100 * M  # the 30 older ones go down
    assert room(**tiers) == 70 * M
    assert room(**tiers, disk_left=200 * M) == 170 * M  # 30 + itself on disk


def test_a_tensor_too_big_for_the_host_tier_needs_its_whole_footprint_on_disk() -> None:
    """4.5 MiB into a 1 MiB host tier beside a 4 MiB disk tier: it cannot rest in the host
    tier, and the disk cannot take it. Counting the disk's room for the 3.5 MiB the host
    could not hold admitted it, and it was kept in host memory, 4.5 MiB of 1."""
    assert not fits(4 * M + M // 2, host_bytes=M, disk_left=4 * M)
    assert fits(4 * M, host_bytes=M, disk_left=4 * M)


def test_a_spill_in_flight_leaves_the_host_tier() -> None:
    """40 MiB spilling (its disk room taken), 20 resting, 50 on the device waiting for a
    copy: once the spill lands the host holds 70 of 100, so 30 more fit there, and 10 on
    disk. A first version counted the spill in the host tier too and admitted 10."""
    tiers = {
        "host_bytes": 100 * M,
        "device_resting": 50 * M,
        "host_used": 60 * M,
        "host_resting": 20 * M,
        "spilling": 40 * M,
        "disk_left": 10 * M,
    }
    assert room(**tiers) == 40 * M


def test_what_waits_past_a_tier_takes_the_room_below() -> None:
    """50 MiB resting and 50 fetched back (their home is the host tier), 50 on the device
    waiting for a copy: the host tier will hold 150 of 100, and the 30 left on disk do not
    cover the 50 over. Nothing fits."""
    assert not fits(
        1,
        host_bytes=100 * M,
        device_resting=50 * M,
        host_used=100 * M,
        host_resting=50 * M,
        disk_left=30 * M,
    )
    # A host tier of 0 with a put waiting for its spill: its 4 MiB take the disk's room.
    waiting = {"host_bytes": 0, "host_used": 8 * M, "host_resting": 4 * M, "spilling": 4 * M}
    assert room(**waiting, disk_left=5 * M) == M


def test_the_disk_is_counted_in_footprints() -> None:
    """A tensor of 1 MiB - 4 bytes takes a whole 1 MiB on disk: with 1 MiB - 2 bytes left it
    does not fit (counted in bytes, it was admitted and kept in host memory past a host
    tier of 0)."""
    assert not fits(M - 4, host_bytes=0, disk_left=M - 2)
    assert fits(M - 4, host_bytes=0, disk_left=M)
