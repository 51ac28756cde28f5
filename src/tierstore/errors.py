"""Exceptions raised by tierstore.

Every error derives from :class:`TierStoreError`. Where an error refines a builtin
(a bad configuration value is a ``ValueError``), it inherits that builtin too, so callers
that already catch the builtin keep working.
"""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "CorruptTensorError",
    "IllegalTransitionError",
    "SpillIOError",
    "StoreClosedError",
    "StoreTimeoutError",
    "TensorModifiedError",
    "TensorReleasedError",
    "TierFullError",
    "TierStoreError",
    "UnsupportedTensorError",
    "WrongThreadError",
]


class TierStoreError(Exception):
    """Base class of every error tierstore raises."""


class ConfigError(TierStoreError, ValueError):
    """A configuration value was rejected; the message names the variable and the value."""


class TierFullError(TierStoreError, MemoryError):
    """No tier has room for the tensor. Nothing was stored and nothing was dropped."""


class CorruptTensorError(TierStoreError, IOError):
    """A spilled tensor's bytes no longer match their checksum or size."""


class SpillIOError(TierStoreError, IOError):
    """Reading a spilled tensor back failed; the message names the tensor and the cause.

    The tensor stays on disk and the next ``get`` reads it again. A failed write raises
    nothing: the tensor stays in memory, and the store counts the error in its stats.
    """


class TensorModifiedError(TierStoreError, RuntimeError):
    """A tensor was written in place, or its storage resized, after it was put.

    The store held the caller's own tensor, and its version counter (shared with its base and
    every view of its storage) moved or its storage shrank, so the store cannot vouch for the
    bytes that were put; the message names the tensor and what changed.
    """


class TensorReleasedError(TierStoreError, KeyError):
    """The handle's entry was released (or belongs to another store or process)."""

    def __str__(self) -> str:
        # KeyError quotes its argument; a sentence reads better.
        return str(self.args[0]) if self.args else ""


class StoreClosedError(TierStoreError, RuntimeError):
    """The store was closed; create a new one."""


class UnsupportedTensorError(TierStoreError, TypeError):
    """The store cannot hold this kind of tensor (sparse, nested, meta, a subclass, ...)."""


class IllegalTransitionError(TierStoreError, RuntimeError):
    """A tensor entry was asked to make a state change its transition table forbids (a bug)."""


class WrongThreadError(TierStoreError, RuntimeError):
    """A blocking call was made from the store's own event-loop thread, which would deadlock."""


class StoreTimeoutError(TierStoreError, TimeoutError):
    """A blocking call waited longer than the store's timeout (a stuck disk, usually)."""
