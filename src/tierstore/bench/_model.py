"""The model ``tierstore-bench train`` trains, and how it measures a step's memory.

A decoder-only transformer small enough for a CPU, whose saved activations dominate its
memory as a long-context model's do; a peak-RSS sampler; and a count of the bytes autograd
saves in one forward, which is what offloading can move.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable

import torch
from torch import nn

__all__ = ["ATTENTION", "Block", "Decoder", "PeakRSS", "saved_activation_bytes"]

PAGE = os.sysconf("SC_PAGE_SIZE")

ATTENTION = ("explicit", "sdpa")
"""How a block attends. ``explicit`` builds the causal attention map with its own ops, as the
figures in docs/benchmarks.md were measured, and drops out of it: at a long sequence its
seq x seq maps dominate the step's memory, and no saved-tensor hook sees the biggest of them.
``sdpa`` calls ``scaled_dot_product_attention`` with ``is_causal``, a fused kernel that keeps
no map (flash attention on the CPU and on CUDA), as long-context models train; it drops out
of the residual branches only, since attention dropout sends torch back to the explicit
maps."""


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float, attention: str = "explicit") -> None:
        super().__init__()
        if attention not in ATTENTION:
            raise ValueError(f"attention={attention!r}: use one of {ATTENTION}")
        self.heads = heads
        self.attention = attention
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        q, k, v = (t.reshape(b, s, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        if self.attention == "sdpa":
            mixed = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
            causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
            mixed = self.drop(att.masked_fill(~causal, float("-inf")).softmax(-1)) @ v
        x = x + self.drop(self.proj(mixed.transpose(1, 2).reshape(b, s, d)))
        out: torch.Tensor = x + self.drop(self.fc2(nn.functional.gelu(self.fc1(self.ln2(x)))))
        return out


class Decoder(nn.Module):
    def __init__(
        self,
        vocab: int,
        dim: int,
        heads: int,
        layers: int,
        dropout: float,
        attention: str = "explicit",
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, dropout, attention) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(
        self, ids: torch.Tensor, wrap: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None
    ) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x) if wrap is None else wrap(block, x)
        logits: torch.Tensor = self.head(self.ln(x))
        return logits


class PeakRSS:
    """Samples this process's RSS on a thread; reads /proc/self/statm (cheap, no psutil)."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def now() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * PAGE

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.now())
            self._stop.wait(self.interval)

    def __enter__(self) -> PeakRSS:
        self.peak = self.now()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.now())


def saved_activation_bytes(model: Decoder, ids: torch.Tensor, min_bytes: int) -> int:
    """Bytes autograd saves in one forward: distinct storages of non-parameters >= min_bytes."""
    seen: dict[int, int] = {}
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params and storage.nbytes() >= min_bytes:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(ids[:, :-1], None).sum()
    del loss
    return sum(seen.values())
