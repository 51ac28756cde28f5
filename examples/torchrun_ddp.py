"""Train a small decoder under DistributedDataParallel with its activations in a TieredStore.

Each rank opens its own store; each store makes its own private spill directory (under
``--disk-dir``, or ``TIERSTORE_DISK_DIR``), so ranks never share files. Run on CPU with gloo:

    torchrun --standalone --nproc_per_node 2 examples/torchrun_ddp.py --steps 3

With ``--out DIR`` every rank also writes the gradients of every step for each mode, so a test
can check that offloading changes no bit of them (tests/adapters/test_ddp.py does).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import tierstore


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        q, k, v = (t.reshape(b, s, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        att = self.drop(att.masked_fill(~causal, float("-inf")).softmax(-1))
        x = x + self.drop(self.proj((att @ v).transpose(1, 2).reshape(b, s, d)))
        return x + self.drop(self.mlp(self.ln2(x)))


class Decoder(nn.Module):
    def __init__(self, vocab: int = 128, dim: int = 64, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)
        self.checkpoint_store: tierstore.TieredStore | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            if self.checkpoint_store is not None:
                x = tierstore.checkpoint(block, x, store=self.checkpoint_store)
            else:
                x = block(x)
        return self.head(x)


def train(mode: str, store: tierstore.TieredStore, args: argparse.Namespace) -> list[torch.Tensor]:
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same initial weights on every rank
    model = Decoder()
    if mode == "checkpoint":
        model.checkpoint_store = store
    ddp = DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    grads: list[torch.Tensor] = []
    for step in range(args.steps):
        torch.manual_seed(1000 * rank + step)  # each rank its own batch and dropout masks
        ids = torch.randint(0, 128, (args.batch, args.seq + 1))
        opt.zero_grad()
        if mode == "hooks":
            with tierstore.offload_activations(store):
                logits = ddp(ids[:, :-1])
        else:
            logits = ddp(ids[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        if args.spill_before_backward and mode != "none":
            wait_until_written(store)
        loss.backward()  # DDP all-reduces the gradients here
        grads += [p.grad.detach().clone() for p in ddp.parameters() if p.grad is not None]
        opt.step()
    return grads


def wait_until_written(store: tierstore.TieredStore, timeout: float = 60.0) -> None:
    """Wait until every byte put so far is written to disk.

    Training never needs this: backward reads a tensor from wherever it is. A tiny model's
    backward can start before the store's threads spilled anything (on a loaded machine), and
    then nothing ever reaches disk; the test waits so that the disk path is always taken.

    Raises:
        RuntimeError: a spill write failed: the tensor stays in memory, and the store retries
            only at a later call, so waiting here would not see it written.
        TimeoutError: not everything was written within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while (s := store.stats()).bytes_to_disk < s.bytes_put:
        if s.write_errors:
            raise RuntimeError(f"{s.write_errors} spill writes failed: {s.summary()}")
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{s.bytes_put - s.bytes_to_disk} bytes not on disk after {timeout} s"
            )
        time.sleep(0.001)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument(
        "--modes",
        default="none,hooks,checkpoint",
        help="comma-separated: none, hooks (offload_activations), checkpoint",
    )
    parser.add_argument("--disk-dir", help="parent of the spill directories (default: config)")
    parser.add_argument("--out", type=Path, help="write per-rank gradients and stats here")
    parser.add_argument(
        "--spill-before-backward",
        action="store_true",
        help="wait before each backward until every saved tensor is on disk (for tests)",
    )
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    overrides: dict[str, object] = {"device_bytes": 0, "host_bytes": 0, "min_bytes": 0}
    if args.disk_dir:
        overrides["disk_dir"] = args.disk_dir
    report: dict[str, object] = {"rank": rank, "pid": os.getpid()}
    # One store per rank: its own loop thread, I/O threads and private spill directory.
    with tierstore.TieredStore(**overrides) as store:
        report["spill_dirs"] = [str(p) for p in store.spill_dirs]
        for mode in args.modes.split(","):
            before = store.stats().bytes_to_disk
            grads = train(mode, store, args)
            report[f"{mode}_bytes_to_disk"] = store.stats().bytes_to_disk - before
            report[f"{mode}_skipped"] = dict(store.stats().skipped)  # what stayed, and why
            if args.out is not None:
                args.out.mkdir(parents=True, exist_ok=True)
                torch.save(grads, args.out / f"grads-{mode}-rank{rank}.pt")
        report["summary"] = store.stats().summary()
    if args.out is not None:
        (args.out / f"report-rank{rank}.json").write_text(json.dumps(report))
    print(f"rank {rank}: {report['summary']}")
    # Every rank done before teardown: gloo otherwise sometimes aborts at exit ("terminate
    # called without an active exception").
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
