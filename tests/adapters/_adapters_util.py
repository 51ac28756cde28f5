"""Helpers of the adapter tests: stores with one tier forced, a tiny decoder with dropout."""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import tierstore
from tierstore.testing import wait_for

TIERS = ("device", "host", "disk")

StoreFactory = Callable[..., tierstore.TieredStore]
"""The ``store_factory`` fixture: ``factory(tier="disk", **overrides)`` makes a store that is
closed after the test."""


def make_store(tier: str, disk_dir: Path, **overrides: object) -> tierstore.TieredStore:
    """A store whose every entry lands in ``tier`` (min_bytes=0: everything is eligible)."""
    capacities: dict[str, object] = {
        "device": {"device_bytes": "unlimited"},
        "host": {"device_bytes": 0, "host_bytes": "unlimited"},
        "disk": {"device_bytes": 0, "host_bytes": 0},
    }[tier]  # type: ignore[assignment]
    settings: dict[str, object] = {"min_bytes": 0, "disk_dir": str(disk_dir)}
    settings.update(capacities)  # type: ignore[arg-type]
    settings.update(overrides)
    return tierstore.TieredStore(**settings)


def stats_once_released(store: tierstore.TieredStore) -> tierstore.StoreStats:
    """Stats once releases queued by dropped handles have been applied (the caller asserts
    what it expects: this waits at most 5 s for no live entries, and fails on nothing)."""
    with contextlib.suppress(AssertionError):
        wait_for(lambda: store.stats().live_entries == 0, timeout=5.0)
    return store.stats()


class Block(nn.Module):
    """Pre-norm decoder block: fused QKV (three views of one storage), causal mask buffer."""

    def __init__(self, dim: int, heads: int, seq: int, p: float) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(p)
        self.register_buffer("mask", torch.ones(seq, seq, dtype=torch.bool).tril())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        q, k, v = (t.reshape(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        att = att.masked_fill(~self.mask[:s, :s], float("-inf")).softmax(-1)
        y = (self.drop(att) @ v).transpose(1, 2).reshape(b, s, d)
        x = x + self.drop(self.proj(y))
        return x + self.drop(self.fc2(nn.functional.gelu(self.fc1(self.ln2(x)))))


class TinyDecoder(nn.Module):
    """A decoder-only transformer small enough for many steps on two cores."""

    def __init__(
        self,
        vocab: int = 97,
        dim: int = 32,
        heads: int = 4,
        layers: int = 2,
        seq: int = 16,
        p: float = 0.1,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads, seq, p) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(
        self, ids: torch.Tensor, layer_call: Callable[..., torch.Tensor] | None = None
    ) -> torch.Tensor:
        x = self.embed(ids) + self.pos[: ids.shape[1]]
        for block in self.blocks:
            x = block(x) if layer_call is None else layer_call(block, x)
        return self.head(self.ln(x))

    def loss(
        self, ids: torch.Tensor, layer_call: Callable[..., torch.Tensor] | None = None
    ) -> torch.Tensor:
        logits = self(ids[:, :-1], layer_call)
        return nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())


def model_and_batch(
    seed: int = 0, batch: int = 4, **kwargs: int | float
) -> tuple[TinyDecoder, torch.Tensor]:
    torch.manual_seed(seed)
    model = TinyDecoder(**kwargs)  # type: ignore[arg-type]
    seq = int(kwargs.get("seq", 16))
    ids = torch.randint(0, model.head.out_features, (batch, seq + 1))
    return model, ids


def grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def assert_equal_tensors(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b) and a
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert x.dtype == y.dtype and x.shape == y.shape, i
        assert torch.equal(x, y), f"tensor {i} differs: max |diff| {(x - y).abs().max().item()}"


@functools.cache
def _compile_traces_saved_tensor_hooks() -> bool:
    """Whether this torch's AOTAutograd calls saved-tensor hooks while it traces a graph.

    torch 2.4's does: the hooks see its FakeTensor and FunctionalTensor stand-ins, a hook that
    Dynamo must not trace cannot be traced by FX either, and torch's own checkpoint fails
    around a compiled block ("using FX to symbolically trace a dynamo-optimized function").
    tierstore leaves the stand-ins alone (``traced_stand_in``, tested in test_hooks.py), but
    compiled blocks inside its blocks need a torch that traces without the hooks.
    """
    seen: list[type] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen.append(type(t))
        return t

    def f(x: torch.Tensor) -> torch.Tensor:
        return x.sin().cos()

    compiled = torch.compile(f, backend="aot_eager")
    x = torch.randn(4, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        compiled(x).sum().backward()
    torch._dynamo.reset()
    return any(cls is not torch.Tensor and cls is not nn.Parameter for cls in seen)


def skip_unless_compile_traces_without_hooks() -> None:
    """Skip a test of compiled code on a torch whose compiler traces with the hooks installed.

    Probed on first use, not at import: the probe loads Dynamo, and the adapters take another
    path once it is loaded (Note: [Hooks run eagerly under torch.compile]).
    """
    if _compile_traces_saved_tensor_hooks():
        pytest.skip(f"torch {torch.__version__} traces compiled graphs with saved-tensor hooks")


def fully_shard_is_public() -> bool:
    """FSDP2's ``fully_shard`` is public in ``torch.distributed.fsdp`` since torch 2.6."""
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        return False
    return True
