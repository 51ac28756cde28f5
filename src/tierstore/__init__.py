"""tierstore: an asynchronous tiered tensor store for PyTorch training.

Activations saved for backward move off the accelerator into host memory and, when host
memory runs short, onto local disk; they come back just in time for backward, newest first.

Example:
    >>> import torch, tierstore
    >>> with tierstore.TieredStore(host_bytes="64MiB", min_bytes=0) as store:
    ...     h = store.put(torch.arange(10))
    ...     store.get(h).sum().item()
    45
"""

from __future__ import annotations

from tierstore._handle import TensorHandle
from tierstore._state import TensorState, Tier
from tierstore._stats import StepStats, StoreStats, TierStats
from tierstore._store import AsyncTieredStore
from tierstore._sync import TieredStore, default_store
from tierstore.adapters import checkpoint, checkpoint_sequential, no_offload, offload_activations
from tierstore.config import StoreConfig
from tierstore.errors import (
    ConfigError,
    CorruptTensorError,
    IllegalTransitionError,
    SpillIOError,
    StoreClosedError,
    StoreTimeoutError,
    TensorModifiedError,
    TensorReleasedError,
    TierFullError,
    TierStoreError,
    UnsupportedTensorError,
    WrongThreadError,
)

__version__ = "0.1.0"

__all__ = [
    "AsyncTieredStore",
    "ConfigError",
    "CorruptTensorError",
    "IllegalTransitionError",
    "SpillIOError",
    "StepStats",
    "StoreClosedError",
    "StoreConfig",
    "StoreStats",
    "StoreTimeoutError",
    "TensorHandle",
    "TensorModifiedError",
    "TensorReleasedError",
    "TensorState",
    "Tier",
    "TierFullError",
    "TierStats",
    "TierStoreError",
    "TieredStore",
    "UnsupportedTensorError",
    "WrongThreadError",
    "checkpoint",
    "checkpoint_sequential",
    "default_store",
    "integrations",
    "no_offload",
    "offload_activations",
]


def __getattr__(name: str) -> object:
    # ``tierstore.integrations`` is imported on first use: its modules import optional
    # packages (transformers) only when called, but there is no reason to load them eagerly.
    if name == "integrations":
        import importlib

        return importlib.import_module("tierstore.integrations")
    raise AttributeError(f"module 'tierstore' has no attribute {name!r}")
