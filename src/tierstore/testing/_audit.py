"""The store's counters recomputed from its entries, for tests that race it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tierstore._state import TensorState, Tier
from tierstore.core._entries import WINDOW

if TYPE_CHECKING:
    from tierstore.core import StoreCore

__all__ = ["audit_core"]

S = TensorState


def audit_core(core: StoreCore) -> dict[str, int]:
    """Recompute every counter of ``core`` from its live entries and compare.

    Returns:
        The recomputed bytes per tier, by tier name.

    Raises:
        AssertionError: a counter disagrees with the entries.
    """
    with core.lock:
        core.drain_dropped()
        table = core.table
        live = list(table.entries.values())
        used = dict.fromkeys(Tier, 0)
        # Released entries whose I/O is still finishing hold bytes too.
        for e in set(live) | table.in_transit:
            if e.data is not None:
                used[Tier.DEVICE] += e.nbytes
            if e.fetched is not None:
                used[Tier.DEVICE] += e.nbytes
            if e.host is not None:
                used[Tier.HOST] += e.nbytes
            used[Tier.DISK] += e.disk
        assert used == table.used, f"tier bytes {table.used} != entries {used}"
        resting_dev = sum(e.nbytes for e in live if e.state is S.DEVICE and e.movable)
        resting_host = sum(e.nbytes for e in live if e.state is S.HOST)
        assert table.resting == {Tier.DEVICE: resting_dev, Tier.HOST: resting_host}
        window = sum(e.nbytes for e in live if e.state in WINDOW)
        assert window == table.window, (window, table.window)
        assert table.live_keys == sorted(table.entries), "live key list out of order"
        # Note: [Off the device]: each entry once, when its only copies are home copies.
        off = sum(
            e.nbytes
            for e in set(live) | table.in_transit
            if e.data is None and e.fetched is None and (e.host is not None or e.disk)
        )
        assert off == table.off_device, f"off-device bytes {table.off_device} != entries {off}"
        return {t.value: n for t, n in used.items()}
