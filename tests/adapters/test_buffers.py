"""Buffers stay in place without a global module hook (Note: [Buffers are found on the stack])."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import pytest
import torch
from _adapters_util import skip_unless_compile_traces_without_hooks
from torch import nn

import tierstore

if TYPE_CHECKING:
    from _adapters_util import StoreFactory

KiB = 1 << 10


class Scaled(nn.Module):
    """Multiplies by a 256 KiB buffer: ``mul`` saves the buffer for backward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(256, 256)
        self.register_buffer("scale", torch.rand(256, 256))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


class Outer(nn.Module):
    """Uses its child's buffer in its own forward, where the child is not being called."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = Scaled()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * self.inner.scale


def _global_module_hooks() -> list[str]:
    """The kinds of global ``nn.Module`` hook that are installed (each is a dict in
    ``torch.nn.modules.module``; which kinds exist depends on torch's version)."""
    module = torch.nn.modules.module
    kinds = [n for n in dir(module) if n.startswith("_global_") and n.endswith("hooks")]
    return [n for n in kinds if getattr(module, n)]


def test_buffers_stay_and_no_global_hook_is_installed(store_factory: StoreFactory) -> None:
    store = store_factory("disk", min_bytes=4 * KiB)
    model = Outer()
    x = torch.randn(256, 256, requires_grad=True)
    with tierstore.offload_activations(store):
        assert not _global_module_hooks()
        loss = model(x).sum()
    stats = store.stats()
    # Saved: x and weight.t() by addmm, the buffer by each mul (the other factors are not
    # needed: the buffer needs no gradient).
    assert stats.skipped_bytes["parameter_or_buffer"] == 3 * 256 * KiB
    assert stats.bytes_put == 256 * KiB  # x
    loss.backward()
    assert x.grad is not None


def test_finding_buffers_keeps_no_tensor_of_a_forward_alive(store_factory: StoreFactory) -> None:
    """Reading a frame's locals (Python < 3.13) leaves a snapshot on the frame; the walk reads
    only module-call frames, so a forward's own tensors die when the forward drops them."""
    store = store_factory("host", min_bytes=4 * KiB)
    died: list[bool] = []

    class Dropping(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            noise = torch.rand(256, 256)  # no grad_fn, no requires_grad: saving it walks
            y = x * noise
            gone = weakref.ref(noise)
            del noise  # the store holds its copy; nothing else holds the tensor
            died.append(gone() is None)
            return y

    x = torch.randn(256, 256, requires_grad=True)
    with tierstore.offload_activations(store):
        loss = Dropping()(x).sum()
    assert died == [True]
    assert store.stats().bytes_put >= 256 * KiB
    loss.backward()
    assert x.grad is not None


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_buffers_of_a_compiled_module_stay(store_factory: StoreFactory) -> None:
    skip_unless_compile_traces_without_hooks()
    store = store_factory("disk", min_bytes=4 * KiB)
    torch.manual_seed(0)
    model = Scaled()
    model.compile(backend="aot_eager")
    x = torch.randn(256, 256, requires_grad=True)
    with tierstore.offload_activations(store):
        loss = model(x).sum()
    stats = store.stats()
    # The compiled graph saves x, the weight and the buffer (graph inputs, all three).
    assert stats.skipped_bytes["parameter_or_buffer"] == 2 * 256 * KiB
    assert stats.bytes_put == 256 * KiB  # x
    loss.backward()
    assert x.grad is not None


def test_a_buffer_of_exactly_min_bytes_stays(store_factory: StoreFactory) -> None:
    """A tensor of ``min_bytes`` is big enough to store, so one that could be a buffer starts
    the walk that finds the buffers: a buffer of exactly ``min_bytes`` stays in place too."""
    store = store_factory("disk", min_bytes=256 * KiB)  # the buffer's size
    model = Outer()
    x = torch.randn(256, 256, requires_grad=True)
    with tierstore.offload_activations(store):
        loss = model(x).sum()
    stats = store.stats()
    assert stats.skipped_bytes["parameter_or_buffer"] == 3 * 256 * KiB
    assert stats.bytes_put == 256 * KiB  # x
    loss.backward()
    assert x.grad is not None
