"""Frozen snapshots of what a store holds and what it has done."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["StoreStats", "TierStats"]


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
    """Tensors that stayed where they were because no tier had room."""
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

    def summary(self) -> str:
        """One line for logs: what was offloaded where, and what it cost."""
        gib = 1 << 30
        return (
            f"tierstore: {self.puts} tensors ({self.bytes_put / gib:.2f} GiB) stored; "
            f"host {self.host.total_entries} ({self.host.total_bytes / gib:.2f} GiB), "
            f"disk {self.disk.total_entries} ({self.disk.total_bytes / gib:.2f} GiB); "
            f"prefetch hits {self.prefetch_hits}/{self.prefetch_hits + self.prefetch_misses}; "
            f"get waited {self.get_wait_seconds:.3f}s, put waited {self.put_wait_seconds:.3f}s; "
            f"skipped {sum(self.skipped.values())}, kept for lack of room {self.kept_no_room}"
        )
