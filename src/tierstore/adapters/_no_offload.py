"""``no_offload``: a region inside an offloading block whose saved tensors stay where they are."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch.autograd.graph import saved_tensors_hooks

from tierstore.adapters._storage import Kept

if TYPE_CHECKING:
    import torch

__all__ = ["no_offload"]


def _unpack(kept: Kept) -> torch.Tensor:
    return kept.tensor()  # raises if written in place since (Note: [Version check])


def no_offload() -> saved_tensors_hooks:
    """A block in which autograd keeps what it saves itself, as it does without hooks.

    Inside :func:`tierstore.offload_activations` (or torch's ``save_on_cpu``), tensors saved in
    this block are neither stored nor moved: torchtune's and TRL's ``NoOpManager``. Use it for
    the last layers of a model, whose activations backward needs first (moving them out and
    straight back costs time and saves nothing), or for a region you want kept on the device.
    Blocks nest; each call returns a new context manager.

    Example:
        >>> with tierstore.offload_activations(store):  # doctest: +SKIP
        ...     hidden = model.body(x)
        ...     with tierstore.no_offload():
        ...         logits = model.head(hidden)
    """
    # Note: [Kept as is, detached]
    return saved_tensors_hooks(Kept, _unpack)
