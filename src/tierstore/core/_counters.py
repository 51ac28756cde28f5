"""What a store has done, counted as it happens, and the snapshot ``stats()`` returns."""

from __future__ import annotations

import collections
import contextlib
import time
from typing import TYPE_CHECKING, Literal

from tierstore._state import Tier
from tierstore._stats import StoreStats, TierStats

if TYPE_CHECKING:
    from collections.abc import Iterator

    from tierstore.core._entries import EntryTable
    from tierstore.core._lock import StoreLock

__all__ = ["Counters", "tier_stats"]


class Counters:
    """Cumulative counters; changed under the store's lock only."""

    def __init__(self) -> None:
        self.puts = self.gets = self.releases = self.bytes_put = 0
        self.bytes_to_host = self.bytes_to_disk = self.bytes_from_disk = self.bytes_to_device = 0
        self.seconds_to_host = self.seconds_to_disk = 0.0
        self.seconds_from_disk = self.seconds_to_device = 0.0
        self.get_wait_seconds = self.put_wait_seconds = 0.0
        self.prefetch_hits = self.prefetch_misses = self.kept_no_room = 0
        self.write_errors = self.read_errors = 0
        self.skipped: collections.Counter[str] = collections.Counter()
        self.skipped_bytes: collections.Counter[str] = collections.Counter()

    @contextlib.contextmanager
    def waiting(self, kind: Literal["get", "put"], lock: StoreLock) -> Iterator[None]:
        """Count the time the block takes as a ``get`` or ``put`` waiting (taking ``lock``
        to count it), also when the block raises."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            seconds = time.perf_counter() - t0
            with lock:
                if kind == "get":
                    self.get_wait_seconds += seconds
                else:
                    self.put_wait_seconds += seconds

    def snapshot(
        self,
        tiers: dict[Tier, TierStats],
        *,
        live_entries: int,
        inflight_bytes: int,
        disk_available: bool,
        table: EntryTable,
    ) -> StoreStats:
        """These counters with the tiers' snapshots, the figures of the moment, and what
        ``table`` counts of moves off the device."""
        return StoreStats(
            device=tiers[Tier.DEVICE],
            host=tiers[Tier.HOST],
            disk=tiers[Tier.DISK],
            live_entries=live_entries,
            puts=self.puts,
            gets=self.gets,
            releases=self.releases,
            bytes_put=self.bytes_put,
            bytes_to_host=self.bytes_to_host,
            bytes_to_disk=self.bytes_to_disk,
            bytes_from_disk=self.bytes_from_disk,
            bytes_to_device=self.bytes_to_device,
            seconds_to_host=self.seconds_to_host,
            seconds_to_disk=self.seconds_to_disk,
            seconds_from_disk=self.seconds_from_disk,
            seconds_to_device=self.seconds_to_device,
            get_wait_seconds=self.get_wait_seconds,
            put_wait_seconds=self.put_wait_seconds,
            prefetch_hits=self.prefetch_hits,
            prefetch_misses=self.prefetch_misses,
            inflight_bytes=inflight_bytes,
            kept_no_room=self.kept_no_room,
            skipped=dict(self.skipped),
            skipped_bytes=dict(self.skipped_bytes),
            write_errors=self.write_errors,
            read_errors=self.read_errors,
            disk_available=disk_available,
            bytes_offloaded=table.offloaded,
            off_device_bytes=table.off_device,
            peak_off_device_bytes=table.peak_off_device,
        )


def tier_stats(table: EntryTable, capacities: dict[Tier, int]) -> dict[Tier, TierStats]:
    """A snapshot of each tier: what it holds now, its capacity, and what it ever held."""
    return {
        t: TierStats(
            entries=table.count[t],
            bytes=table.used[t],
            capacity=capacities[t],
            total_entries=table.total_entries[t],
            total_bytes=table.total_bytes[t],
            peak_bytes=table.peak[t],
        )
        for t in Tier
    }
