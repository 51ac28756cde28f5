"""The per-tensor state machine: one enum, one transition table, one function that changes state.

Note: [One state, one table]
    Every change of an entry's state goes through :func:`transition`, which checks it against
    ``TRANSITIONS``. Resting states say where the bytes live; transit states say what is moving;
    RELEASED and FAILED are terminal. A transit state may be followed by RELEASED: the task doing
    the move sees that when it finishes and frees what it produced, so a release never waits for
    I/O and never races it. An illegal transition is a bug and raises IllegalTransitionError.
"""

from __future__ import annotations

import enum
from typing import Protocol

from tierstore.errors import IllegalTransitionError

__all__ = ["TRANSITIONS", "TensorState", "Tier", "transition"]


class Tier(enum.Enum):
    """Where a tensor's bytes are: its own device, host memory, or a spill file."""

    DEVICE = "device"
    HOST = "host"
    DISK = "disk"

    # Members are singletons compared by identity, so identity hashing agrees with equality;
    # Enum's own __hash__ is Python code, and the store hashes tiers and states on every call.
    __hash__ = object.__hash__


class TensorState(enum.Enum):
    """The state of one stored tensor."""

    DEVICE = "device"
    """Resting on its own device (a CPU tensor on the CPU, a CUDA tensor on its GPU)."""
    HOST = "host"
    """Resting in the host tier."""
    DISK = "disk"
    """Resting in a spill file."""
    MOVING_TO_HOST = "moving_to_host"
    """A copy from the device into the host tier is in flight; the device bytes stay valid."""
    MOVING_TO_DISK = "moving_to_disk"
    """A write into a spill file is in flight; the source bytes stay valid until it ends."""
    FETCHING = "fetching"
    """A copy back toward the device (a disk read or a host-to-device copy) is in flight."""
    FETCHED = "fetched"
    """Resting in the host or disk tier, with a prefetched copy on the device ready for get."""
    RELEASED = "released"
    """Terminal: released by its owner; every copy is freed."""
    FAILED = "failed"
    """Terminal: the only copy was lost or found corrupt; get raises."""

    __hash__ = object.__hash__  # see Tier


S = TensorState

TRANSITIONS: dict[TensorState, frozenset[TensorState]] = {
    # A resting or moving source written after put fails its entry (Note: [Writes after put]).
    S.DEVICE: frozenset({S.MOVING_TO_HOST, S.MOVING_TO_DISK, S.RELEASED, S.FAILED}),
    S.HOST: frozenset({S.MOVING_TO_DISK, S.FETCHING, S.RELEASED, S.FAILED}),
    S.DISK: frozenset({S.FETCHING, S.RELEASED}),
    # A failed copy leaves the source where it was.
    S.MOVING_TO_HOST: frozenset({S.HOST, S.DEVICE, S.RELEASED, S.FAILED}),
    S.MOVING_TO_DISK: frozenset({S.DISK, S.DEVICE, S.HOST, S.RELEASED, S.FAILED}),
    # A failed fetch returns to the home tier, or fails the entry when the home copy is corrupt.
    S.FETCHING: frozenset({S.FETCHED, S.HOST, S.DISK, S.FAILED, S.RELEASED}),
    # Consuming or evicting the fetched copy returns the entry to its home tier.
    S.FETCHED: frozenset({S.HOST, S.DISK, S.RELEASED}),
    S.RELEASED: frozenset(),
    S.FAILED: frozenset(),
}

RESTING: frozenset[TensorState] = frozenset({S.DEVICE, S.HOST, S.DISK, S.FETCHED})
TRANSIT: frozenset[TensorState] = frozenset({S.MOVING_TO_HOST, S.MOVING_TO_DISK, S.FETCHING})
TERMINAL: frozenset[TensorState] = frozenset({S.RELEASED, S.FAILED})


class _HasState(Protocol):
    key: int
    state: TensorState


def transition(entry: _HasState, new: TensorState) -> None:
    """Move ``entry`` to state ``new``.

    Raises:
        IllegalTransitionError: ``TRANSITIONS`` does not allow it (a bug in tierstore).
    """
    old = entry.state
    if new not in TRANSITIONS[old]:
        raise IllegalTransitionError(
            f"tensor #{entry.key}: illegal state change {old.name} -> {new.name}; "
            f"allowed from {old.name}: {sorted(s.name for s in TRANSITIONS[old]) or 'none'}"
        )
    entry.state = new
