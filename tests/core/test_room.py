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
    device_entries: tuple[int, ...] = (),
    host_used: int = 0,
    host_entries: tuple[int, ...] = (),
    host_reserved: int = 0,
    spilling: int = 0,
    disk_left: int = 0,
) -> bool:
    """``StoreCore._has_room`` over plain numbers: ``device_entries`` and ``host_entries``
    are the sizes of the entries resting in each tier, oldest first; ``spilling`` bytes are
    being written to disk (their host copies in ``host_used``, their disk room taken);
    ``disk_left`` is what the disk tier may still take; a spill takes whole pages."""
    resting = {Tier.DEVICE: list(device_entries), Tier.HOST: list(host_entries)}
    store = SimpleNamespace(
        config=SimpleNamespace(device_bytes=device_bytes, host_bytes=host_bytes),
        table=SimpleNamespace(
            resting={tier: sum(sizes) for tier, sizes in resting.items()},
            used={Tier.HOST: host_used, Tier.DISK: 0},
            host_reserved=host_reserved,
            resting_oldest_first=lambda tier: (SimpleNamespace(nbytes=n) for n in resting[tier]),
        ),
        semaphore=SimpleNamespace(inflight=spilling + host_reserved),
        disk=SimpleNamespace(room=lambda used: disk_left, footprint=lambda n: -(-n // PAGE) * PAGE),
    )
    store._spills_after = lambda n: StoreCore._spills_after(store, n)  # type: ignore[arg-type]
    return StoreCore._has_room(store, nbytes)  # type: ignore[arg-type]


def room(**tiers: int) -> int:
    """The most bytes that fit, in whole pages."""
    fitting = [n for n in range(0, 400 * M, PAGE) if fits(n, **tiers)]
    return max(fitting)


def test_each_tier_gives_its_free_room() -> None:
    """A put fits in the host tier, or pushes older entries onto the disk to rest there;
    one too big to rest there spills itself, after every older entry."""
    tiers = {"host_bytes": 100 * M, "host_used": 30 * M, "host_entries": (30 * M,)}
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
    """40 MiB spilling (its disk room taken), twenty of 1 MiB resting, 50 on the device
    waiting for a copy: once the spill lands the host holds 70 of 100, so 30 more fit there,
    and 10 on disk. A first version counted the spill in the host tier too and admitted 10."""
    tiers = {
        "host_bytes": 100 * M,
        "device_entries": (50 * M,),
        "host_used": 60 * M,
        "host_entries": (M,) * 20,
        "spilling": 40 * M,
        "disk_left": 10 * M,
    }
    assert room(**tiers) == 40 * M
    # One entry of 20 MiB instead: the cascade writes it whole or not at all.
    assert room(**{**tiers, "host_entries": (20 * M,)}) == 30 * M


def test_what_waits_past_a_tier_takes_the_room_below() -> None:
    """50 MiB resting and 50 fetched back (their home is the host tier), 50 on the device
    waiting for a copy: the host tier will hold 150 of 100, and the 30 left on disk do not
    cover the 50 over. Nothing fits."""
    assert not fits(
        1,
        host_bytes=100 * M,
        device_entries=(50 * M,),
        host_used=100 * M,
        host_entries=(50 * M,),
        disk_left=30 * M,
    )
    # A host tier of 0 with a put waiting for its spill: its 4 MiB take the disk's room.
    waiting = {"host_bytes": 0, "host_used": 8 * M, "host_entries": (4 * M,), "spilling": 4 * M}
    assert room(**waiting, disk_left=5 * M) == M


def test_the_disk_is_counted_in_footprints() -> None:
    """A tensor of 1 MiB - 4 bytes takes a whole 1 MiB on disk: with 1 MiB - 2 bytes left it
    does not fit (counted in bytes, it was admitted and kept in host memory past a host
    tier of 0)."""
    assert not fits(M - 4, host_bytes=0, disk_left=M - 2)
    assert fits(M - 4, host_bytes=0, disk_left=M)


def test_the_cascade_moves_whole_entries() -> None:
    """A 64 KiB put beside a 4 MiB host entry, in a 4 MiB host tier over a 1 MiB disk: the
    cascade would write the 4 MiB entry, which the disk cannot take. Counted in bytes (64 KiB
    over, 1 MiB free) it was admitted, and the host tier held 4.06 MiB of 4."""
    tiers = {"host_bytes": 4 * M, "host_used": 4 * M, "disk_left": M}
    assert not fits(64 << 10, **tiers, host_entries=(4 * M,))
    assert fits(64 << 10, **tiers, host_entries=(M,) * 4)  # one 1 MiB entry goes down
    assert room(**tiers, host_entries=(M,) * 4) == M


def test_what_the_device_tier_pushes_down_is_counted() -> None:
    """A 2 MiB entry rests in a 2 MiB device tier over a 1 MiB host tier and a 4 MiB disk. A
    3.5 MiB put pushes it down and follows it: 5.5 MiB for the disk, which has 4. Counting
    only the host tier's entries and the new tensor, it was admitted and 3.5 MiB were kept in
    the 1 MiB host tier."""
    tiers = {"host_bytes": M, "device_bytes": 2 * M, "device_entries": (2 * M,), "disk_left": 4 * M}
    assert not fits(3 * M + M // 2, **tiers)
    assert fits(2 * M, **tiers)  # the 2 MiB entry goes to disk, the new one rests
    # Even 512 KiB push the 2 MiB entry down, through a host tier too small for it.
    assert not fits(M // 2, **{**tiers, "disk_left": 0})
    assert fits(M // 2, **{**tiers, "disk_left": 2 * M})


def test_copies_landing_and_fetched_copies_count_whole_and_first() -> None:
    """A 4 MiB copy on its way into a 4 MiB host tier (or a 4 MiB entry of that tier fetched
    back to its device, which returns there), a 2 MiB disk: a 64 KiB put would push the
    4 MiB entry, the oldest, down. Counted as the bytes over capacity, 64 KiB, it was
    admitted, and the host tier held 4.06 MiB of 4."""
    landing = {"host_bytes": 4 * M, "host_reserved": 4 * M, "disk_left": 2 * M}
    assert not fits(64 << 10, **landing)
    assert fits(64 << 10, **{**landing, "disk_left": 4 * M})
    fetched = {"host_bytes": 4 * M, "host_used": 4 * M, "disk_left": 2 * M}
    assert not fits(64 << 10, **fetched)
