"""The transition table: every legal change works, illegal ones raise."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tierstore import IllegalTransitionError, TensorState
from tierstore._state import TERMINAL, TRANSITIONS, transition

S = TensorState


@dataclass
class Entry:
    key: int
    state: TensorState


LEGAL = sorted(((a, b) for a, bs in TRANSITIONS.items() for b in bs), key=str)


@pytest.mark.parametrize(("old", "new"), LEGAL)
def test_every_legal_transition(old: TensorState, new: TensorState) -> None:
    e = Entry(1, old)
    transition(e, new)
    assert e.state is new


ILLEGAL = [
    (S.DISK, S.HOST),  # promotion goes through FETCHING
    (S.DISK, S.DEVICE),
    (S.DEVICE, S.DISK),  # a write is always in flight first
    (S.HOST, S.DEVICE),
    (S.FETCHED, S.FETCHING),
    (S.RELEASED, S.DEVICE),
    (S.RELEASED, S.RELEASED),
    (S.FAILED, S.DISK),
    (S.FAILED, S.RELEASED),
    (S.MOVING_TO_HOST, S.DISK),
]


@pytest.mark.parametrize(("old", "new"), ILLEGAL)
def test_illegal_transitions_raise_and_leave_state(old: TensorState, new: TensorState) -> None:
    e = Entry(7, old)
    with pytest.raises(
        IllegalTransitionError, match=rf"tensor #7: illegal state change {old.name} -> {new.name}"
    ):
        transition(e, new)
    assert e.state is old


def test_table_covers_every_state_and_terminals_are_final() -> None:
    assert set(TRANSITIONS) == set(TensorState)
    for state in TERMINAL:
        assert TRANSITIONS[state] == frozenset()
    for state, targets in TRANSITIONS.items():
        if state not in TERMINAL:
            assert S.RELEASED in targets, f"{state} cannot be released"
