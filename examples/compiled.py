"""Train a model whose blocks are torch.compile'd, with its activations in a TieredStore.

    python examples/compiled.py --steps 5
    python examples/compiled.py --steps 5 --no-offload     # the same steps without tierstore
    python examples/compiled.py --steps 5 --mode checkpoint --backend aot_eager

Each block is compiled in place (``block.compile()``, as one does for FSDP2 and for
per-layer compilation), and tierstore goes around the compiled code, as without compile:
- ``--mode hooks``: ``tierstore.offload_activations(store)`` around the forward. What each
  compiled graph saves for backward (AOTAutograd's choice: the compiler may recompute cheap
  ops rather than save them) goes into the store when the graph runs and comes back when the
  compiled backward needs it. The graphs do not change: no graph break, no recompilation.
- ``--mode checkpoint``: each compiled block runs through ``tierstore.checkpoint``, which
  keeps only the block's input, in the store, and runs the compiled block again in backward.
Every step prints its loss exactly (``repr``): the losses with offloading and with
``--no-offload`` are the same, bit for bit, with either backend (inductor rounds differently
from eager PyTorch; tierstore changes nothing).
"""

from __future__ import annotations

import argparse
import logging

import torch
from torch import nn

import tierstore


class Block(nn.Module):
    """A pre-norm MLP block.

    A class of one's own: ``compile()`` of an ``nn.Sequential`` compiles nothing, since its
    ``forward`` is PyTorch's own code, which Dynamo does not trace as a frame of its own.
    """

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.drop = nn.Dropout(0.1)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.drop(nn.functional.gelu(self.up(self.norm(x)))))


def build(dim: int, layers: int) -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(Block(dim) for _ in range(layers))


def forward(
    blocks: nn.ModuleList, x: torch.Tensor, store: tierstore.TieredStore | None = None
) -> torch.Tensor:
    """Each block added to its input; through ``tierstore.checkpoint`` when given a store."""
    for block in blocks:
        x = x + (block(x) if store is None else tierstore.checkpoint(block, x, store=store))
    return x


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--mode", choices=["hooks", "checkpoint"], default="hooks")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend")
    parser.add_argument("--host-bytes", default="16MiB", help="host tier; the rest spills")
    parser.add_argument("--disk-dir", help="parent of the spill directory (default: config)")
    parser.add_argument("--no-offload", action="store_true", help="train without tierstore")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")

    blocks = build(args.dim, args.layers)
    for block in blocks:
        block.compile(backend=args.backend)  # in place: the same module, its call compiled
    opt = torch.optim.AdamW(blocks.parameters(), lr=1e-3)
    overrides: dict[str, object] = {"host_bytes": args.host_bytes, "min_bytes": "64KiB"}
    if args.disk_dir:
        overrides["disk_dir"] = args.disk_dir
    store = None if args.no_offload else tierstore.TieredStore(**overrides)
    for step in range(args.steps):
        torch.manual_seed(step)  # the batch and the dropout masks; the same with or without
        x = torch.randn(args.batch, args.seq, args.dim)
        opt.zero_grad()
        if store is None:
            y = forward(blocks, x)
        elif args.mode == "hooks":
            with tierstore.offload_activations(store):  # around the compiled code
                y = forward(blocks, x)
        else:
            y = forward(blocks, x, store)
        loss = y.pow(2).mean()
        loss.backward()
        opt.step()
        print(f"step {step}: loss {loss.item()!r}")
    if store is not None:
        store.close()  # logs its one-line summary to the "tierstore" logger at INFO


if __name__ == "__main__":
    main()
