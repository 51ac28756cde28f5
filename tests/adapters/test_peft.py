"""PEFT LoRA on a tiny random Llama (nothing downloaded): offloading changes no gradient bit.

The base model is frozen and only the LoRA adapters train, so the layers' inputs need no
gradient while the adapters inside them do, and LoRA's dropout draws random numbers that the
checkpoint's recompute must draw again. Layer inputs are 1.25 MiB and attention maps 12.5 MiB;
``host_bytes=0`` sends all that is stored to disk.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import pytest
import torch
from differential import settle, tiny_llama

import tierstore
from optional_modules import importorskip_transformers

if TYPE_CHECKING:
    from _adapters_util import StoreFactory

importorskip_transformers()
peft = pytest.importorskip("peft")

SEQ = 640
STEPS = 2


def lora_llama(mode: str, store: tierstore.TieredStore | None) -> torch.nn.Module:
    base = tiny_llama(max_positions=SEQ)
    if mode == "integration":
        from tierstore.integrations.transformers import enable_offloaded_checkpointing

        # Before get_peft_model, as with gradient_checkpointing_enable() in PEFT recipes.
        enable_offloaded_checkpointing(base, store)
    lora = peft.LoraConfig(
        r=8,
        lora_alpha=16,
        lora_dropout=0.1,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj"],
    )
    model = peft.get_peft_model(base, lora)
    model.train()
    return model


def train(mode: str, store: tierstore.TieredStore | None) -> list[torch.Tensor]:
    """Every LoRA gradient of every step; modes ``none``, ``hooks`` and ``integration``."""
    model = lora_llama(mode, store)
    trained = [p for p in model.parameters() if p.requires_grad]
    assert trained and all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    opt = torch.optim.AdamW(trained, lr=1e-2)
    grads: list[torch.Tensor] = []
    for step in range(STEPS):
        ids = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(step))
        torch.manual_seed(100 + step)  # LoRA's and attention's dropout masks
        if mode == "hooks":
            with tierstore.offload_activations(store):
                loss = model(input_ids=ids, labels=ids).loss
        else:
            loss = model(input_ids=ids, labels=ids).loss
        if store is not None:
            settle(store)  # every write lands: backward reads each tensor back from disk
        loss.backward()
        grads += [p.grad.clone() for p in trained if p.grad is not None]
        opt.step()
        opt.zero_grad(set_to_none=True)
    return grads


@functools.cache
def reference() -> list[torch.Tensor]:
    return train("none", None)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["hooks", "integration"])
def test_lora_gradients_are_bit_identical(store_factory: StoreFactory, mode: str) -> None:
    store = store_factory("disk")
    got = train(mode, store)
    expected = reference()
    assert len(got) == len(expected) == STEPS * 2 * 6 * 2  # steps, layers, modules, A and B
    for i, (a, b) in enumerate(zip(expected, got, strict=True)):
        assert torch.equal(a, b), f"LoRA gradient {i} differs: max |diff| {(a - b).abs().max()}"
    stats = store.stats()
    # hooks: the attention maps among the rest; integration: each layer's 1.25 MiB input.
    least = STEPS * 2 * (10 << 20 if mode == "hooks" else 5 << 18)
    assert stats.bytes_to_disk >= least and stats.bytes_from_disk >= least
