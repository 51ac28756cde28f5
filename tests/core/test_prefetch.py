"""The LIFO prefetch walk without a store: newest first below the cursor, within the window,
resuming where it stopped (Note: [Resumable prefetch walk])."""

from __future__ import annotations

from collections.abc import Callable

from tierstore.core._prefetch import PENDING, SCAN_LIMIT, STEP, PrefetchWalk, newest_first_within


def _sizes(on_disk: dict[int, int]) -> Callable[[int], int | None]:
    return on_disk.get


def test_nothing_is_fetched_before_the_first_get() -> None:
    assert PrefetchWalk().plan([1, 2, 3], _sizes({1: 10}), budget=100) == []


def test_the_entries_below_the_cursor_come_newest_first_within_the_window() -> None:
    walk = PrefetchWalk()
    walk.cursor = 8
    keys = list(range(1, 11))
    on_disk = {k: 10 for k in keys if k != 6}  # 6 is resting in memory
    assert walk.plan(keys, _sizes(on_disk), budget=35) == [7, 5, 4]


def test_the_walk_resumes_where_it_stopped_and_stays_linear() -> None:
    n = 2000
    keys = list(range(1, n + 1))
    on_disk = dict.fromkeys(keys, 1)
    walk = PrefetchWalk()
    fetched: list[int] = []
    for cursor in reversed(keys):  # a backward sweep: one get per entry, newest first
        walk.cursor = cursor
        chosen = walk.plan(keys, _sizes(on_disk), budget=3 * n)
        for key in chosen:
            del on_disk[key]  # now fetching: no longer needs a fetch
        fetched += chosen
    assert sorted(fetched) == keys[:-1]
    assert walk.steps <= 3 * n


def test_one_walk_starts_at_most_a_step_of_fetches() -> None:
    keys = list(range(1, 3 * STEP))
    walk = PrefetchWalk()
    walk.cursor = keys[-1]
    chosen = walk.plan(keys, _sizes(dict.fromkeys(keys, 1)), budget=10**9)
    assert len(chosen) == STEP and chosen[0] == keys[-2]


def test_a_walk_looks_at_most_at_the_scan_limit() -> None:
    keys = list(range(1, SCAN_LIMIT + 100))
    walk = PrefetchWalk()
    walk.cursor = keys[-1]
    assert walk.plan(keys, _sizes({}), budget=10) == []
    assert walk.steps == SCAN_LIMIT


def test_a_cursor_that_moves_up_starts_a_new_walk_from_there() -> None:
    keys = list(range(1, 21))
    on_disk = dict.fromkeys(keys, 1)
    walk = PrefetchWalk()
    walk.cursor = 10
    assert walk.plan(keys, _sizes(on_disk), budget=3) == [9, 8, 7]
    walk.cursor = 20  # a second backward pass
    assert walk.plan(keys, _sizes(on_disk), budget=2) == [19, 18]


def test_an_empty_window_plans_nothing() -> None:
    walk = PrefetchWalk()
    walk.cursor = 5
    assert walk.plan([1, 2, 3, 4, 5], _sizes({1: 1}), budget=0) == []
    assert walk.steps == 0


def test_chosen_handles_come_newest_first_until_one_does_not_fit() -> None:
    asked = [(3, 10), (7, 10), (5, 30), (7, 10), (1, 5)]  # 7 asked twice
    assert newest_first_within(asked, budget=25) == [7]
    assert newest_first_within(asked, budget=54) == [7, 5, 3]


def test_a_chosen_handle_bigger_than_the_window_comes_alone_once_the_window_is_empty() -> None:
    """As the walk does (Note: [A tensor bigger than the window]): ``store.prefetch`` of a
    tensor bigger than the window never fetched it."""
    asked = [(4, 100), (2, 10)]
    assert newest_first_within(asked, budget=50) == []
    assert newest_first_within(asked, budget=50, window_empty=True) == [4]
    assert newest_first_within([(2, 10), (4, 100)], budget=0, window_empty=True) == []


def test_an_entry_bigger_than_the_window_is_fetched_alone_once_the_window_is_empty() -> None:
    """Note: [A tensor bigger than the window]."""
    keys = [1, 2, 3, 4, 5]
    on_disk = {1: 10, 2: 10, 3: 10, 4: 128}
    walk = PrefetchWalk()
    walk.cursor = 5
    assert walk.plan(keys, _sizes(on_disk), budget=32) == []  # something is in the window
    assert walk.plan(keys, _sizes(on_disk), budget=32, window_empty=True) == [4]
    del on_disk[4]  # now fetching: the rest waits for room, as before
    assert walk.plan(keys, _sizes(on_disk), budget=0, window_empty=False) == []
    assert walk.plan(keys, _sizes(on_disk), budget=32) == [3, 2, 1]
    # An entry that fits is never joined by a bigger one, and no window means no prefetch.
    walk = PrefetchWalk()
    walk.cursor = 5
    assert walk.plan(keys, _sizes({4: 10, 3: 128}), budget=32, window_empty=True) == [4]
    walk = PrefetchWalk()
    walk.cursor = 5
    assert walk.plan(keys, _sizes({4: 128}), budget=0, window_empty=True) == []


def test_an_entry_still_on_its_way_down_is_fetched_once_it_lands() -> None:
    """Note: [An entry on its way down]: the walk passed entry 9 (its spill in flight) and
    resumed below the older ones it fetched, so 9, the entry backward needed next, was never
    brought back ahead."""
    keys = list(range(1, 11))
    sizes: dict[int, int] = dict.fromkeys(range(1, 9), 10)
    sizes[9] = PENDING
    walk = PrefetchWalk()
    walk.cursor = 10
    assert walk.plan(keys, _sizes(sizes), budget=1000) == [8, 7, 6, 5, 4, 3, 2, 1]
    assert not walk.exhausted  # 9 is still to come
    for key in range(1, 9):
        del sizes[key]  # fetching
    sizes[9] = 10  # its spill ended: on disk now
    assert walk.plan(keys, _sizes(sizes), budget=1000) == [9]
    assert walk.plan(keys, _sizes({}), budget=1000) == []
    assert walk.exhausted


def test_an_entry_on_its_way_down_keeps_the_walk_linear() -> None:
    """A first version resumed every walk at the entry still moving down: while its spill
    ran, each get of a newer entry (in host memory, nothing to fetch) rescanned the whole
    window fetched below it (273,103 entries looked at for 400 gets of a 32 MiB window of
    48 KiB tensors, against 1,182)."""
    keys = list(range(1, 2001))
    sizes: dict[int, int] = dict.fromkeys(range(1, 1000), 48)  # on disk
    sizes[1600] = PENDING  # the newest spill, still in flight
    # 1000-1599 fetched already (the window, nearly full); 1601-2000 rest in host memory.
    walk = PrefetchWalk()
    for cursor in range(2000, 1600, -1):
        walk.cursor = cursor
        assert walk.plan(keys, _sizes(sizes), budget=10) == []  # less than one entry left
    first_walk = 1 + 400 + 600  # down to the first entry that does not fit
    assert walk.steps <= first_walk + 3 * 400, walk.steps
    sizes[1600] = 48  # it landed
    walk.cursor = 1601
    # Newest first: the entry that landed, then where the walk had stopped.
    assert walk.plan(keys, _sizes(sizes), budget=100) == [1600, 999]


def test_a_new_sweep_is_not_at_its_end_before_it_walks() -> None:
    """The first walk of a new backward pass, with no room in the window, kept the last
    sweep's end: ``exhausted`` said the new sweep was over before it had looked at anything,
    and the read pool could hand back the buffers it was about to use."""
    keys = [1, 2, 3, 4, 5, 6]
    walk = PrefetchWalk()
    walk.cursor = 3
    assert walk.plan(keys, _sizes({1: 10, 2: 10}), budget=100) == [2, 1]
    assert walk.exhausted
    walk.cursor = 6  # the next step's backward begins
    assert walk.plan(keys, _sizes({4: 10, 5: 10}), budget=0) == []
    assert not walk.exhausted
    assert walk.plan(keys, _sizes({4: 10, 5: 10}), budget=100) == [5, 4]


def test_a_cursor_moving_up_with_no_room_keeps_the_walk_in_place() -> None:
    """Gets that move the cursor up a little while the window is full (entries still on
    their device, got out of order) leave the walk where it stopped: a first fix of the
    sweep's end reset it there, and every later get walked again through every fetched
    entry (20,600 entries looked at here instead of 700)."""
    keys = list(range(1, 3001))
    fetched: set[int] = set()

    def size(key: int) -> int | None:
        return None if key in fetched else 1

    walk = PrefetchWalk()
    walk.cursor = 3000
    fetched.update(walk.plan(keys, size, budget=200))
    for cursor in range(2999, 2000, -2):
        walk.cursor = cursor + 5
        assert walk.plan(keys, size, budget=0) == []
        walk.cursor = cursor
        fetched.update(walk.plan(keys, size, budget=1))
    assert walk.steps < 1000


def test_an_entry_on_its_way_down_that_the_cursor_reached_is_not_fetched_ahead() -> None:
    """Note: [An entry on its way down]: of the entries the walk passed on their way down,
    those the cursor has reached are dropped, the cursor's own included: its get came first
    and reads it itself, so fetching it ahead would read it twice."""
    keys = list(range(1, 11))
    sizes: dict[int, int] = dict.fromkeys(range(1, 9), 10)
    sizes[9] = PENDING
    walk = PrefetchWalk()
    walk.cursor = 10
    assert walk.plan(keys, _sizes(sizes), budget=1000) == [8, 7, 6, 5, 4, 3, 2, 1]
    for key in range(1, 9):
        del sizes[key]  # fetching
    sizes[9] = 10  # its spill ended: on disk now
    walk.cursor = 9  # and backward asked for it first
    assert walk.plan(keys, _sizes(sizes), budget=1000) == []
    assert walk.exhausted
