"""Training adapters: saved-tensor hooks and activation checkpointing backed by a TieredStore."""

from __future__ import annotations

from tierstore.adapters._checkpoint import checkpoint, checkpoint_sequential
from tierstore.adapters._hooks import offload_activations
from tierstore.adapters._no_offload import no_offload

__all__ = ["checkpoint", "checkpoint_sequential", "no_offload", "offload_activations"]
