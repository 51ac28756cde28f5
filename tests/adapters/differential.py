"""Training with and without offloading, compared bit for bit, on every path bytes can take.

A test proves only the paths its data takes. :class:`PathNet` is built so that the tensors
autograd saves in one step straddle every threshold of the data path:

- sizes: 16 KiB and just under 1 MiB (small blobs, written in packs), exactly 1 MiB, just over
  1 MiB (chunked: one chunk), one chunk and a bit, and tens of MiB in several chunks (the
  fused QKV output of the largest input is 24 MiB). The raw engine's chunks are 2 MiB, and
  1 MiB over the two striped directories, so that these sizes cross many chunk boundaries
  under both adapters: under ``checkpoint`` only the inputs are stored, the largest 8 MiB,
  which the default 8 MiB chunk writes whole but for its lead. ``disk-raw-default`` keeps
  that default, so the 24 MiB blob crosses the chunk boundaries users' tensors do;
- page positions: inputs whose storage starts 0, 64, 192 (an odd multiple of 64) and 4032 (a
  page minus 64) bytes past a page, so the raw engine writes them with each lead;
- storage offsets: views at 64, 192 and 4032 bytes into their storage;
- shapes sharing storage: the three ``unbind`` views of a fused QKV projection, a transpose,
  an ``expand`` and ``narrow``s;
- dtypes: float32, bfloat16, float16, and the int64 indices an embedding saves.

:data:`CONFIGS` forces every tier in turn, both engines, O_DIRECT on and off and two striped
directories. ``train`` runs the same steps for the plain model, under
:func:`tierstore.offload_activations` and under :func:`tierstore.checkpoint`.
"""

from __future__ import annotations

import mmap
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

import tierstore

MiB = 1 << 20
WIDTH = 256
"""Features per row: a float32 row is 1 KiB."""
ROWS = (16, 1023, 1024, 1025, 2049, 8192)
"""Rows of each input: 16 KiB, 1 MiB - 1 KiB, 1 MiB, 1 MiB + 1 KiB, 2 MiB + 1 KiB, 8 MiB (its
QKV projection is 24 MiB)."""
LEADS = (0, 64, 192, 4032)
"""Bytes past a page where the inputs' storages start, taken in turn."""
VIEW_OFFSETS = (16, 48, 1008)
"""Element offsets of the narrowed views: 64, 192 and 4032 bytes into a float32 storage."""

CONFIGS: dict[str, dict[str, object]] = {
    "device": {"device_bytes": "unlimited"},
    "host": {"host_bytes": "unlimited"},
    "tiny-host": {"host_bytes": "2MiB", "io_chunk_bytes": "2MiB"},
    "disk-raw-default": {"host_bytes": 0},
    "disk-raw-direct": {"host_bytes": 0, "direct_io": "on", "io_chunk_bytes": "2MiB"},
    "disk-raw-buffered": {"host_bytes": 0, "direct_io": "off", "io_chunk_bytes": "2MiB"},
    "disk-zarr": {"host_bytes": 0, "disk_format": "zarr"},
    "disk-striped": {"host_bytes": 0, "stripes": 2, "io_chunk_bytes": "1MiB"},
}
"""Store settings that force each path; ``stripes`` asks for that many spill directories."""


def placed(t: torch.Tensor, lead: int) -> torch.Tensor:
    """A copy of ``t`` whose storage starts ``lead`` bytes past a page (its own mmap)."""
    nbytes = t.numel() * t.element_size()
    buf = mmap.mmap(-1, lead + nbytes + 1, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    out = torch.frombuffer(buf, dtype=t.dtype, count=t.numel(), offset=lead).view(t.shape)
    out.copy_(t)
    return out


class PathNet(nn.Module):
    """Small weights, big saved activations; see the module docstring for what it saves."""

    def __init__(self, vocab: int = 512) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.up = nn.Linear(WIDTH, WIDTH)
        self.down = nn.Linear(WIDTH, WIDTH)
        self.bf16 = nn.Linear(WIDTH, WIDTH).to(torch.bfloat16)
        self.drop = nn.Dropout(0.1)

    def branch(self, x: torch.Tensor, ids: torch.Tensor, i: int) -> torch.Tensor:
        """One input's path; ``i`` picks its view offset and dtype."""
        x = x + self.embed(ids)  # saves the int64 indices
        q, k, v = self.qkv(x).view(x.shape[0], 3, WIDTH).unbind(1)  # three views, one storage
        h = self.drop(nn.functional.gelu(self.up(q * k)))  # q*k saves both views
        mix = q.t() @ v  # saves a transposed view and v
        h = h + (h @ mix) / x.shape[0]
        h = h * x[:, :1].expand(-1, WIDTH)  # saves an expanded view of x's storage
        flat = h.reshape(-1)
        off = VIEW_OFFSETS[i % len(VIEW_OFFSETS)]
        n = flat.numel() - 2 * off
        h = h + nn.functional.pad(flat.narrow(0, off, n).sin(), (off, off)).view_as(h)
        low = h.to(torch.float16 if i % 2 else torch.bfloat16)
        square = low * low  # saves a float16 or bfloat16 activation
        h = h + self.bf16(square.to(torch.bfloat16)).float().tanh()  # a bfloat16 linear
        return self.down(h)

    def forward(
        self,
        xs: list[torch.Tensor],
        ids: list[torch.Tensor],
        layer_call: Callable[..., torch.Tensor] | None = None,
    ) -> torch.Tensor:
        loss = torch.zeros(())
        for i, (x, t) in enumerate(zip(xs, ids, strict=True)):
            if layer_call is None:
                y = self.branch(x, t, i)
            else:
                # Views the caller does not keep: the checkpoint's recompute must read them
                # back from the store (Note: [Inputs live in the store]), leads and all.
                y = layer_call(self.branch, x.view_as(x), t.view_as(t), i)
            loss = loss + y.float().pow(2).mean()
        return loss


def batch(step: int, rows: tuple[int, ...] = ROWS) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The inputs of one step, each placed at its lead, and their token indices."""
    g = torch.Generator().manual_seed(1000 + step)
    xs, ids = [], []
    for i, n in enumerate(rows):
        x = placed(torch.randn(n, WIDTH, generator=g), LEADS[i % len(LEADS)])
        xs.append(x.requires_grad_())
        ids.append(torch.randint(0, 512, (n,), generator=g))
    return xs, ids


@dataclass
class Run:
    """What a run produced: the loss and every gradient of every step."""

    losses: list[torch.Tensor]
    grads: list[list[torch.Tensor]]


def train(
    mode: str, store: tierstore.TieredStore | None, steps: int = 2, rows: tuple[int, ...] = ROWS
) -> Run:
    """``steps`` SGD steps of a fresh :class:`PathNet`; mode ``none``, ``hooks`` or
    ``checkpoint`` (each branch checkpointed)."""
    torch.manual_seed(0)
    model = PathNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    run = Run([], [])
    for step in range(steps):
        xs, ids = batch(step, rows)
        torch.manual_seed(50 + step)  # the dropout masks
        if mode == "none":
            loss = model(xs, ids)
        elif mode == "hooks":
            with tierstore.offload_activations(store):
                loss = model(xs, ids)
        elif mode == "checkpoint":
            loss = model(xs, ids, lambda f, *a: tierstore.checkpoint(f, *a, store=store))
        else:
            raise ValueError(mode)
        if store is not None:
            # Let every write land, so that backward reads each tensor back from its tier.
            settle(store)
        loss.backward()
        run.losses.append(loss.detach().clone())
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        run.grads.append(grads + [x.grad.clone() for x in xs])
        opt.step()
        opt.zero_grad(set_to_none=True)
    return run


def tiny_llama(max_positions: int) -> nn.Module:
    """A random two-layer Llama (nothing downloaded), seeded, with attention dropout on: the
    Hugging Face model the differential tests train. Needs transformers."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        attention_dropout=0.1,
        attn_implementation="eager",
        use_cache=False,
    )
    model: nn.Module = transformers.LlamaForCausalLM(config)
    return model


def settle(store: tierstore.TieredStore, timeout: float = 60.0) -> None:
    """Wait until nothing is moving down the tiers."""
    deadline = time.monotonic() + timeout
    while store.stats().inflight_bytes:
        if time.monotonic() > deadline:
            raise AssertionError(f"writes still in flight after {timeout}s")
        time.sleep(0.002)


def differences(expected: Run, got: Run) -> list[str]:
    """Every loss and gradient that is not bit-identical, named; empty when all are."""
    found = []
    for step, (a, b) in enumerate(zip(expected.losses, got.losses, strict=True)):
        if not torch.equal(a, b):
            found.append(f"step {step}: loss {b.item()!r} != {a.item()!r}")
    for step, (ga, gb) in enumerate(zip(expected.grads, got.grads, strict=True)):
        assert len(ga) == len(gb)
        for i, (a, b) in enumerate(zip(ga, gb, strict=True)):
            if a.shape != b.shape or not torch.equal(a, b):
                worst = (a - b).abs().max().item() if a.shape == b.shape else float("nan")
                found.append(f"step {step}: gradient {i} differs (max |diff| {worst:.3g})")
    return found


def make_store(config: str, root: Path) -> tierstore.TieredStore:
    """A store with :data:`CONFIGS`' ``config`` on directories under ``root``."""
    settings = dict(CONFIGS[config])
    stripes = int(settings.pop("stripes", 1))  # type: ignore[call-overload]
    dirs = []
    for i in range(stripes):
        d = root / f"stripe{i}"
        d.mkdir(parents=True, exist_ok=True)
        dirs.append(str(d))
    settings = {"device_bytes": 0, "min_bytes": 0, **settings}
    return tierstore.TieredStore(disk_dir=dirs if stripes > 1 else dirs[0], **settings)
