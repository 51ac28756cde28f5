"""Hugging Face transformers: gradient checkpointing whose saved layer inputs live in a store.

transformers is imported by nothing here at module level: this module imports without it.
"""

from __future__ import annotations

import functools
import inspect
from typing import TYPE_CHECKING, Any

from tierstore.adapters import checkpoint

if TYPE_CHECKING:
    import torch

    from tierstore._sync import TieredStore

__all__ = ["enable_offloaded_checkpointing"]


def enable_offloaded_checkpointing(
    model: torch.nn.Module, store: TieredStore | None = None, *, every_n_layers: int = 1
) -> None:
    """Turn on gradient checkpointing of ``model`` with :func:`tierstore.checkpoint`.

    Each decoder layer then keeps nothing for backward but its inputs (hidden states, the
    attention mask, position embeddings), and those live in ``store``: on a GPU they leave the
    device, and past the host tier's capacity they spill to disk. The layers recompute in
    backward with the forward's RNG state, so gradients are bit-identical to no checkpointing,
    dropout included. Works with ``Trainer``: call this before ``trainer.train()`` and leave
    ``TrainingArguments.activation_checkpointing`` (alias ``gradient_checkpointing``) off: it
    would install torch's checkpoint over this one. ``model.activation_checkpointing_disable()``
    turns it off again.

    Args:
        model: a ``transformers.PreTrainedModel`` that supports gradient checkpointing.
        store: where layer inputs go; ``None`` means :func:`tierstore.default_store`, resolved
            at the first checkpointed forward.
        every_n_layers: checkpoint every n-th decoder layer only (default 1: all of them); the
            others keep their activations as usual. Needs a transformers version whose
            ``_set_gradient_checkpointing`` accepts it.

    Raises:
        ValueError: the model does not support gradient checkpointing, or uses the pre-4.35
            checkpointing format (a ``_set_gradient_checkpointing(module, value)`` override).

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> import tierstore, tierstore.integrations.transformers as tt
        >>> model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64,
        ...     num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, vocab_size=64))
        >>> tt.enable_offloaded_checkpointing(model, tierstore.TieredStore(min_bytes=0))
        >>> model.is_activation_checkpointing
        True
    """
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(
            f"{type(model).__name__} does not support gradient checkpointing "
            "(supports_gradient_checkpointing is False); wrap its layers with "
            "tierstore.checkpoint yourself"
        )
    setter: Any = getattr(model, "_set_gradient_checkpointing", None)
    if setter is None or "value" in inspect.signature(setter).parameters:
        raise ValueError(
            f"{type(model).__name__} uses the checkpointing format of transformers < 4.35, "
            "which cannot take a checkpoint function; update the model's code"
        )
    func = functools.partial(checkpoint, store=store)
    if every_n_layers == 1:
        setter(enable=True, gradient_checkpointing_func=func)
    else:
        if "every_n_layers" not in inspect.signature(setter).parameters:
            raise ValueError(
                f"every_n_layers={every_n_layers!r}: this transformers version checkpoints "
                "every layer or none"
            )
        setter(enable=True, gradient_checkpointing_func=func, every_n_layers=every_n_layers)
