"""tierstore.no_offload: tensors saved inside stay where they are; everything else moves."""

from __future__ import annotations

import torch
from _adapters_util import StoreFactory, stats_once_released
from torch import nn

import tierstore
from tierstore.testing import settled, wait_for


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 256), nn.Tanh())


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_a_no_offload_region_keeps_its_tensors_and_gradients_are_exact(
    store_factory: StoreFactory,
) -> None:
    store = store_factory("disk")
    model = _model()
    x = torch.randn(2048, 256)  # 2 MiB activations
    model(x).sum().backward()
    expected = _grads(model)
    model.zero_grad()

    with tierstore.offload_activations(store):
        h = model[1](model[0](x))
        stored = store.stats().bytes_put
        with tierstore.no_offload():
            out = model[3](model[2](h))
        assert store.stats().bytes_put == stored  # nothing inside the region was stored
        with tierstore.no_offload(), tierstore.no_offload():  # regions nest
            out = out + 0 * model[3](h)
    # Spilled before backward, so that the tensors really come back from disk (on a loaded
    # machine the backward can otherwise take them while their writes are in flight).
    wait_for(lambda: settled(store))
    out.sum().backward()
    for a, b in zip(expected, _grads(model), strict=True):
        assert torch.equal(a, b)
    stats = stats_once_released(store)
    assert stats.bytes_to_disk >= 2 * 2**20 and stats.bytes_from_disk > 0
