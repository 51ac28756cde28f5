"""Training adapters: saved-tensor hooks and activation checkpointing backed by a TieredStore."""

from __future__ import annotations

from tierstore.adapters._checkpoint import checkpoint, checkpoint_sequential
from tierstore.adapters._hooks import offload_activations

__all__ = ["checkpoint", "checkpoint_sequential", "offload_activations"]
