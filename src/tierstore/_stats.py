"""Frozen snapshots of what a store holds and what it has done, and how they read in logs."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["REASON_NAMES", "StepStats", "StoreStats", "TierStats", "format_size", "format_skipped"]

_UNITS = (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10))

REASON_NAMES: Mapping[str, str] = {
    "parameter_or_buffer": "parameters",
    "below_min_bytes": "small",
    "unsupported": "unsupported",
    "no_room": "no room",
}
"""The short name of each reason an adapter skips a tensor for (the keys of
``StoreStats.skipped``), as log lines print them."""


def _unit_of(n: int) -> tuple[str, int]:
    for unit, shift in _UNITS:
        if n >= 1 << shift:
            return unit, shift
    return "B", 0


def _number(value: float) -> str:
    # One decimal while it says something ("3.1 GiB"), none once the number is two digits.
    return f"{value:.1f}" if round(value, 1) < 10 else f"{value:.0f}"


def format_size(n: int) -> str:
    """``n`` bytes in the largest binary unit that keeps the number at least 1.

    ``"3.1 GiB"``, ``"12 MiB"``, ``"512 B"``; sizes from 2**62 bytes up read ``"unlimited"``
    (what ``parse_size("unlimited")`` gives). The one formatter every message uses.
    """
    if n >= 1 << 62:
        return "unlimited"
    unit, shift = _unit_of(abs(n))
    if shift == 0:
        return f"{n} B"
    return f"{_number(n / (1 << shift))} {unit}"


def _parts(total: int, parts: list[tuple[str, int]]) -> str:
    """``"3.1 GiB (host 2.0, disk 1.1)"``: the parts in the total's unit (none of nothing)."""
    if not total:
        return format_size(total)
    shift = _unit_of(total)[1]
    inner = ", ".join(
        f"{name} {n}" if shift == 0 else f"{name} {_number(n / (1 << shift))}" for name, n in parts
    )
    return f"{format_size(total)} ({inner})" if inner else format_size(total)


def format_skipped(skipped: Mapping[str, int], skipped_bytes: Mapping[str, int]) -> str:
    """What adapters left in place, by reason, most bytes first.

    ``"288 tensors, 12 MiB: parameters 200 (10 MiB), small 88 (2.0 MiB)"``, or ``"nothing"``.
    """
    count = sum(skipped.values())
    if not count:
        return "nothing"
    reasons = sorted(skipped, key=lambda r: (-skipped_bytes.get(r, 0), r))
    each = ", ".join(
        f"{REASON_NAMES.get(r, r)} {skipped[r]} ({format_size(skipped_bytes.get(r, 0))})"
        for r in reasons
    )
    total = sum(skipped_bytes.values())
    return f"{count} tensor{'s' if count != 1 else ''}, {format_size(total)}: {each}"


@dataclass(frozen=True, slots=True)
class TierStats:
    """One tier at one moment."""

    entries: int
    """Entries whose bytes are in this tier now (in flight into it included)."""
    bytes: int
    """Bytes those entries occupy in this tier (on disk: the padded footprint)."""
    capacity: int
    """The tier's capacity in bytes."""
    total_entries: int
    """Entries ever placed in this tier (for the device tier, prefetched copies count too)."""
    total_bytes: int
    """Bytes ever placed in this tier (for the disk tier, whole padded pages)."""
    peak_bytes: int = 0
    """The most bytes this tier held at once since the store opened (counted as ``bytes``)."""


@dataclass(frozen=True, slots=True)
class StoreStats:
    """A store at one moment; every counter is cumulative since the store opened."""

    device: TierStats
    """Tensors resting on their own device (and fetched copies waiting for get)."""
    host: TierStats
    """The host tier."""
    disk: TierStats
    """The disk tier."""
    live_entries: int
    """Entries not yet released."""
    puts: int
    """Calls of put that stored a tensor."""
    gets: int
    """Calls of get that returned a tensor."""
    releases: int
    """Entries released."""
    bytes_put: int
    """Bytes handed to put."""
    bytes_to_host: int
    """Bytes copied from a device into the host tier."""
    bytes_to_disk: int
    """Bytes written to spill files."""
    bytes_from_disk: int
    """Bytes read back from spill files."""
    bytes_to_device: int
    """Bytes copied from the host tier back to a device."""
    seconds_to_host: float
    """Seconds spent in device-to-host copies."""
    seconds_to_disk: float
    """Seconds spent writing spill files (summed over concurrent writes)."""
    seconds_from_disk: float
    """Seconds spent reading spill files (summed over concurrent reads)."""
    seconds_to_device: float
    """Seconds spent in host-to-device copies."""
    get_wait_seconds: float
    """Seconds callers waited inside get."""
    put_wait_seconds: float
    """Seconds put waited for the save semaphore (backpressure)."""
    prefetch_hits: int
    """Gets whose tensor was already on its way back or never left."""
    prefetch_misses: int
    """Gets that had to start the copy themselves."""
    inflight_bytes: int
    """Bytes moving down right now (bounded by max_inflight_bytes)."""
    kept_no_room: int
    """Tensors that stayed where they were because no tier had room, each counted once
    however often the cascade found no room for it."""
    skipped: Mapping[str, int] = field(default_factory=dict)
    """Tensors an adapter did not offload, by reason."""
    skipped_bytes: Mapping[str, int] = field(default_factory=dict)
    """Bytes an adapter did not offload, by reason."""
    write_errors: int = 0
    """Spill writes that failed (the tensor stayed in a tier that holds it)."""
    read_errors: int = 0
    """Spill reads that failed."""
    disk_available: bool = True
    """False after a failed write until space returns."""
    bytes_offloaded: int = 0
    """Bytes of stored tensors that left the device tier (each entry counted once, when it
    first moved into the host tier; on the CPU that move is a relabel, no copy)."""
    off_device_bytes: int = 0
    """Bytes of stored tensors held off the device now: entries whose only copies are in the
    host tier or on disk, each counted once (its own bytes, not the disk's padded pages).
    On a CPU-only machine the host tier holds the CPU tensor itself, so this counts what the
    store moved out of the device tier, which on an accelerator would be device memory."""
    peak_off_device_bytes: int = 0
    """The most ``off_device_bytes`` held at once since the store opened."""

    def summary(self) -> str:
        """One line for logs: what was offloaded where, what it cost, and what was skipped,
        by reason, with its bytes."""
        return (
            f"tierstore: {self.puts} tensors ({format_size(self.bytes_put)}) stored; "
            f"host {self.host.total_entries} ({format_size(self.host.total_bytes)}), "
            f"disk {self.disk.total_entries} ({format_size(self.disk.total_bytes)}); "
            f"peak off-device {format_size(self.peak_off_device_bytes)}; "
            f"prefetch hits {self.prefetch_hits}/{self.prefetch_hits + self.prefetch_misses}; "
            f"get waited {self.get_wait_seconds:.3f}s, put waited {self.put_wait_seconds:.3f}s; "
            f"skipped {format_skipped(self.skipped, self.skipped_bytes)}; "
            f"kept for lack of room {self.kept_no_room}"
        )


@dataclass(frozen=True, slots=True)
class StepStats:
    """One training step: what the store did since the previous step ended, and its peaks.

    ``TieredStore.end_step()`` returns it and starts the next step; ``str()`` of it is one
    line for logs::

        tierstore: step 12 offloaded 3.1 GiB (host 2.0, disk 1.1), peak off-device 2.9 GiB,
        backward waited 0.04 s, skipped 12 MiB (parameters 10, small 2.0)

    Counts are the differences of the cumulative :class:`StoreStats` counters of the same
    name; peaks are the most held at once during the step (a step starts with what the
    previous one still held).
    """

    step: int
    """The step's number: what ``end_step(step)`` was given, else one more than the last."""
    puts: int = 0
    """Tensors stored."""
    bytes_put: int = 0
    """Bytes handed to put."""
    bytes_offloaded: int = 0
    """Bytes that left the device tier (see ``StoreStats.bytes_offloaded``)."""
    bytes_to_disk: int = 0
    """Bytes written to spill files."""
    bytes_from_disk: int = 0
    """Bytes read back from spill files."""
    get_wait_seconds: float = 0.0
    """Seconds get waited: in training, backward waiting for tensors to come back."""
    put_wait_seconds: float = 0.0
    """Seconds put waited for the disk (backpressure)."""
    prefetch_hits: int = 0
    """Gets whose tensor was already on its way back or never left."""
    prefetch_misses: int = 0
    """Gets that had to start the copy themselves."""
    kept_no_room: int = 0
    """Tensors that stayed where they were because no tier had room, each counted once."""
    skipped: Mapping[str, int] = field(default_factory=dict)
    """Tensors adapters left in place, by reason (only reasons seen in the step)."""
    skipped_bytes: Mapping[str, int] = field(default_factory=dict)
    """Their bytes, by reason."""
    peak_off_device_bytes: int = 0
    """The most bytes of stored tensors held off the device at once during the step (see
    ``StoreStats.off_device_bytes``): what the store saved the device at the step's peak."""
    peak_device_bytes: int = 0
    """The most bytes the device tier held at once during the step."""
    peak_host_bytes: int = 0
    """The most bytes the host tier held at once during the step."""
    peak_disk_bytes: int = 0
    """The most bytes (padded pages) the disk tier held at once during the step."""

    @property
    def bytes_kept_in_host(self) -> int:
        """Of the bytes offloaded, those not written to disk in the step (never negative: a
        tensor offloaded in an earlier step and spilled in this one counts as disk only)."""
        return max(0, self.bytes_offloaded - self.bytes_to_disk)

    def __str__(self) -> str:
        offloaded = _parts(
            self.bytes_offloaded,
            [("host", self.bytes_kept_in_host), ("disk", self.bytes_to_disk)],
        )
        by_bytes = sorted(self.skipped_bytes.items(), key=lambda kv: (-kv[1], kv[0]))
        skipped = (
            _parts(
                sum(self.skipped_bytes.values()),
                [(REASON_NAMES.get(r, r), n) for r, n in by_bytes],
            )
            if sum(self.skipped.values())
            else "nothing"
        )
        line = (
            f"tierstore: step {self.step} offloaded {offloaded}, "
            f"peak off-device {format_size(self.peak_off_device_bytes)}, "
            f"backward waited {self.get_wait_seconds:.2f} s, skipped {skipped}"
        )
        if self.kept_no_room:
            line += f", {self.kept_no_room} kept in place for lack of room"
        return line
