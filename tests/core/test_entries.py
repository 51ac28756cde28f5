"""The entry table: each tier's bytes follow every state change and copy, and the resting
entries are read oldest first without changing the table."""

from __future__ import annotations

import heapq
import random

import torch

from tierstore import TensorState, Tier
from tierstore.core._entries import Entry, EntryTable, in_order

S = TensorState


def test_in_order_yields_a_heap_sorted_without_changing_it() -> None:
    rng = random.Random(0)
    for n in (0, 1, 2, 7, 100):
        heap: list[int] = []
        for _ in range(n):
            heapq.heappush(heap, rng.randrange(50))
        before = list(heap)
        assert list(in_order(heap)) == sorted(heap)
        assert heap == before


def _entry(table: EntryTable, key: int, nbytes: int = 64) -> Entry:
    t = torch.zeros(nbytes, dtype=torch.uint8)
    e = Entry(key, t, movable=True)
    table.add(e, t)
    return e


def test_tiers_count_copies_and_resting_bytes_follow_the_state() -> None:
    table = EntryTable(lambda key, footprint: None)
    e = _entry(table, 1)
    assert table.used[Tier.DEVICE] == 64 and table.resting[Tier.DEVICE] == 64
    table.set_state(e, S.MOVING_TO_HOST)
    table.set_copy(e, "host", e.data)
    table.set_copy(e, "data", None)
    table.set_state(e, S.HOST)
    assert table.used == {Tier.DEVICE: 0, Tier.HOST: 64, Tier.DISK: 0}
    assert table.resting == {Tier.DEVICE: 0, Tier.HOST: 64}
    table.set_state(e, S.MOVING_TO_DISK)
    table.set_disk(e, 4096)
    table.set_copy(e, "host", None)
    table.set_state(e, S.DISK)
    table.set_state(e, S.FETCHING)
    assert table.window == 64 and table.used[Tier.DISK] == 4096
    assert table.total_entries == {Tier.DEVICE: 1, Tier.HOST: 1, Tier.DISK: 1}


def test_resting_entries_come_oldest_first_skipping_those_that_left() -> None:
    table = EntryTable(lambda key, footprint: None)
    entries = [_entry(table, k) for k in (1, 2, 3, 4)]
    table.set_state(entries[0], S.MOVING_TO_HOST)  # left the device tier
    table.remove(entries[2])  # released
    assert [e.key for e in table.resting_oldest_first(Tier.DEVICE)] == [2, 4]
    assert table.live_keys == [1, 2, 4]
    # An entry that comes back to a tier is read once, though its key was pushed twice.
    table.set_state(entries[0], S.DEVICE)
    assert [e.key for e in table.resting_oldest_first(Tier.DEVICE)] == [1, 2, 4]


def test_keys_of_entries_gone_do_not_pile_up_and_the_order_stays_right() -> None:
    """Keys left a heap only from its top, when the cascade read a tier over its capacity: a
    host tier that never filled kept one key per put for the store's life."""
    rng = random.Random(1)
    table = EntryTable(lambda key, footprint: None)
    live: dict[int, Entry] = {}
    for key in range(1, 20001):
        e = _entry(table, key)
        table.set_state(e, S.MOVING_TO_HOST)
        table.set_state(e, S.HOST)
        live[key] = e
        if rng.random() < 0.98:  # most are released soon, a few stay
            gone = live.pop(rng.choice(list(live)[-8:]))
            table.set_state(gone, S.RELEASED)
            table.remove(gone)
        if key % 997 == 0:  # a few go back and forth: their keys are pushed twice
            back = live[rng.choice(list(live))]
            table.set_state(back, S.FETCHING)
            table.set_state(back, S.HOST)
    for tier in (Tier.DEVICE, Tier.HOST):
        assert len(table._heaps[tier]) <= 2 * len(table.entries) + 65, tier
    assert [e.key for e in table.resting_oldest_first(Tier.HOST)] == sorted(live)
    assert list(table.resting_oldest_first(Tier.DEVICE)) == []
