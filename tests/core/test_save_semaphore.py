"""Note: [The save semaphore]: its rule, and the puts waiting on it."""

from __future__ import annotations

import pytest

from tierstore import StoreClosedError
from tierstore.core._save_semaphore import SaveSemaphore, has_room


def test_an_empty_semaphore_takes_any_move_and_a_busy_one_only_what_fits() -> None:
    assert has_room(0, 10, limit=4)
    assert has_room(2, 2, limit=4)
    assert not has_room(2, 3, limit=4)


def test_puts_wait_while_it_is_full_and_go_on_when_the_cascade_moves() -> None:
    sem = SaveSemaphore(limit=4)
    assert sem.waiter() is None
    sem.settle(full=True)
    first, second = sem.waiter(), sem.waiter()
    assert first is not None and second is not None and not first.done()
    sem.settle(full=True)
    assert not first.done()
    sem.settle(full=False)
    assert first.result(0) is None and second.result(0) is None


def test_closing_fails_the_waiting_puts() -> None:
    sem = SaveSemaphore(limit=4)
    sem.settle(full=True)
    waiter = sem.waiter()
    assert waiter is not None
    sem.close()
    with pytest.raises(StoreClosedError):
        waiter.result(0)
