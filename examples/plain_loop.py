"""A plain PyTorch training loop with its activations in a TieredStore.

    python examples/plain_loop.py --steps 20 --host-bytes 16MiB
    python examples/plain_loop.py --steps 20 --no-offload      # the same steps without it

Two ways, pick one per model:
- ``tierstore.offload_activations(store)``: every tensor autograd saves goes into the store
  (no recompute; the forward's activations move down the tiers and come back for backward);
- ``tierstore.checkpoint(block, x, store=store)``: each block keeps only its input, in the store,
  and recomputes the rest in backward.
A host tier smaller than the activations makes the rest spill to disk. The store's one-line
summary at the end says what went where. Every step prints its loss exactly (``repr``), so a
run with offloading can be compared with ``--no-offload``: the losses are the same, bit for bit.
"""

from __future__ import annotations

import argparse
import logging

import torch
from torch import nn

import tierstore


def build(dim: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    blocks = [
        nn.Sequential(
            nn.LayerNorm(dim),
            nn.Linear(dim, 4 * dim),
            nn.GELU(),
            nn.Dropout(0.1),
            nn.Linear(4 * dim, dim),
        )
        for _ in range(layers)
    ]
    return nn.ModuleList(blocks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--mode", choices=["hooks", "checkpoint"], default="hooks")
    parser.add_argument("--host-bytes", default="16MiB", help="host tier; the rest spills")
    parser.add_argument("--disk-dir", help="parent of the spill directory (default: config)")
    parser.add_argument("--no-offload", action="store_true", help="train without tierstore")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")

    model = build(args.dim, args.layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    overrides: dict[str, object] = {"host_bytes": args.host_bytes, "min_bytes": "64KiB"}
    if args.disk_dir:
        overrides["disk_dir"] = args.disk_dir
    store = None if args.no_offload else tierstore.TieredStore(**overrides)
    for step in range(args.steps):
        torch.manual_seed(step)  # the batch and the dropout masks; the same with or without
        x = torch.randn(args.batch, args.seq, args.dim)
        opt.zero_grad()
        if store is None:
            for block in model:
                x = x + block(x)
        elif args.mode == "hooks":
            with tierstore.offload_activations(store):
                for block in model:
                    x = x + block(x)
        else:
            for block in model:
                x = x + tierstore.checkpoint(block, x, store=store)
        loss = x.pow(2).mean()
        loss.backward()
        opt.step()
        line = f"step {step}: loss {loss.item()!r}"
        if store is not None and step % 10 == 0:
            s = store.stats()
            line += (
                f"; {s.puts} tensors stored so far, "
                f"{s.disk.total_bytes / 2**20:.1f} MiB spilled to disk"
            )
        print(line)
    if store is not None:
        store.close()  # logs its one-line summary to the "tierstore" logger at INFO


if __name__ == "__main__":
    main()
