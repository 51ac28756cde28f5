"""Train a small decoder under FSDP2 (fully_shard) with its activations in a TieredStore.

    torchrun --standalone --nproc_per_node 2 examples/fsdp2_torchrun.py --steps 5
    torchrun --standalone --nproc_per_node 2 examples/fsdp2_torchrun.py --steps 5 --no-offload
    torchrun --standalone --nproc_per_node 2 examples/fsdp2_torchrun.py --mode checkpoint

Runs on CPU with gloo (on GPUs, use nccl and move the model to each rank's device). Each
block is its own FSDP2 unit and the root holds the rest, as FSDP2 recommends; each rank opens
its own store, with its own private spill directory. Without ``--host-bytes``, each rank's
host tier is its share of the machine: a quarter of memory divided by ``LOCAL_WORLD_SIZE``,
which torchrun sets.

- ``--mode hooks``: ``tierstore.offload_activations(store)`` around the forward. FSDP2 gathers
  each block's parameters before it runs and frees them after; the parameters are never
  stored, the activations are.
- ``--mode checkpoint``: each sharded block runs through ``tierstore.checkpoint``; in
  backward FSDP2 gathers its parameters again, and the block is recomputed from its input,
  which comes back from the store.
Rank 0 prints every step's loss on every rank exactly (``repr``), so a run can be compared
with ``--no-offload``: the losses are the same, bit for bit.
"""

from __future__ import annotations

import argparse
import logging
import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import tierstore


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        q, k, v = (t.reshape(b, s, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        att = self.drop(att.masked_fill(~causal, float("-inf")).softmax(-1))
        x = x + self.drop(self.proj((att @ v).transpose(1, 2).reshape(b, s, d)))
        return x + self.drop(self.down(nn.functional.gelu(self.up(self.ln2(x)))))


class Decoder(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)
        self.store: tierstore.TieredStore | None = None  # set: blocks go through checkpoint

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x) if self.store is None else tierstore.checkpoint(block, x, store=self.store)
        # Logits of shape (batch * seq, vocab): a 3-D linear returns a view, and FSDP2 warns
        # when a sharded module returns one.
        return self.head(x.flatten(0, 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--mode", choices=["hooks", "checkpoint"], default="hooks")
    parser.add_argument("--host-bytes", help="each rank's host tier (default: its share)")
    parser.add_argument("--disk-dir", help="parent of the spill directories (default: config)")
    parser.add_argument("--no-offload", action="store_true", help="train without tierstore")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial weights on every rank, before sharding
    vocab = 128
    model = Decoder(vocab, args.dim, args.layers, heads=4)
    # fully_shard's default mesh is on the accelerator when there is one; this example shards
    # on the CPU wherever it runs.
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    overrides: dict[str, object] = {"min_bytes": "64KiB"}
    if args.host_bytes is not None:
        overrides["host_bytes"] = args.host_bytes
    if args.disk_dir:
        overrides["disk_dir"] = args.disk_dir
    store = None if args.no_offload else tierstore.TieredStore(**overrides)
    if store is not None and args.mode == "checkpoint":
        model.store = store
    for step in range(args.steps):
        torch.manual_seed(1000 * rank + step)  # each rank its own batch and dropout masks
        ids = torch.randint(0, vocab, (args.batch, args.seq + 1))
        opt.zero_grad()
        if store is not None and args.mode == "hooks":
            with tierstore.offload_activations(store):
                logits = model(ids[:, :-1])
        else:
            logits = model(ids[:, :-1])
        loss = nn.functional.cross_entropy(logits, ids[:, 1:].flatten())
        loss.backward()  # FSDP2 reduce-scatters the gradients here
        opt.step()
        every = [torch.zeros(()) for _ in range(world)]
        dist.all_gather(every, loss.detach())  # copies: each rank's loss, exactly
        if rank == 0:
            print(f"step {step}: loss {' '.join(repr(x.item()) for x in every)}", flush=True)
    if store is not None:
        if rank == 0:
            print(f"each rank's host tier: {store.config.host_bytes} bytes", flush=True)
        store.close()  # logs its one-line summary to the "tierstore" logger at INFO
    # Every rank done before any tears gloo down: a rank leaving while another's gloo threads
    # still talk to it now and then aborts a process at exit ("terminate called without an
    # active exception"), with or without tierstore.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
