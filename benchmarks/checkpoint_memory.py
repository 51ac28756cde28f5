"""Where a checkpointed training step peaks: RSS at each block, torch's checkpoint vs tierstore's.

Run: PYTHONPATH=src python benchmarks/checkpoint_memory.py [--layers 8 --seq 256 --batch 16]

Trains ``tierstore-bench train``'s decoder with every block checkpointed, once with
``torch.utils.checkpoint`` and once with ``tierstore.checkpoint`` on the disk tier, each in a
process of its own started with ``MALLOC_MMAP_THRESHOLD_=1048576`` (as the bench's children,
so freed tensors leave the RSS at once). For the last of ``--steps`` steps it prints the RSS
when each block's forward starts (``f1`` ...), when each block's input gradient is ready in
backward (``b8`` ... ``b1``: that block's backward is done) and the step's peak, sampled every
millisecond. Both modes' gradients are compared; the script fails if they differ.

What it shows: the forward holds every block input under torch's checkpoint and none under
tierstore's, but the step peaks late in backward, in the first block's recompute, when every
parameter's gradient has been allocated and torch's checkpoint too holds only that block's
input.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import tierstore
from tierstore.bench._model import ATTENTION, Decoder, PeakRSS

MiB = 1 << 20


def _worker(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(2)
    torch.manual_seed(0)
    model = Decoder(args.vocab, args.dim, args.heads, args.layers, 0.0, args.attention)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq + 1))
    store = None
    if args.worker == "ts_ckpt":
        store = tierstore.TieredStore(
            device_bytes=0,
            host_bytes=0,
            disk_dir=args.disk_dir,
            prefetch_bytes=args.prefetch_bytes,
        )
    marks: list[tuple[str, int]] = []

    def mark(name: str) -> None:
        marks.append((name, PeakRSS.now()))

    def wrap(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        index = sum(name.startswith("f") for name, _ in marks) + 1
        mark(f"f{index}")
        x.register_hook(lambda _grad: mark(f"b{index}"))  # type: ignore[no-untyped-call]
        out: torch.Tensor
        if store is not None:
            out = tierstore.checkpoint(block, x, store=store)
        else:
            out = torch_checkpoint(block, x, use_reentrant=False)
        return out

    for _ in range(args.steps):
        marks.clear()
        opt.zero_grad(set_to_none=True)
        with PeakRSS(0.001) as sampler:
            logits = model(ids[:, :-1], wrap)
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
            del logits
            loss.backward()  # type: ignore[no-untyped-call]
        digest = hashlib.sha256()
        for p in model.parameters():
            assert p.grad is not None
            digest.update(p.grad.numpy().tobytes())
        if args.grads_out:  # the last step's, for the parent to say where modes differ
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            torch.save(grads, args.grads_out)
        opt.step()
    if store is not None:
        store.close()
    return {"marks": marks, "peak": sampler.peak, "grads": digest.hexdigest()}


def _where_they_differ(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """One line per parameter whose gradients differ: how many elements, the largest gap."""
    lines = []
    for name, x in a.items():
        y = b[name]
        if not torch.equal(x, y):
            ne = (x != y).sum().item()
            gap = (x - y).abs().max().item()
            lines.append(f"  {name}: {ne} of {x.numel()} elements differ, at most by {gap:.3g}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--attention", choices=ATTENTION, default="explicit")
    parser.add_argument("--prefetch-bytes", type=int, default=32 * MiB)
    parser.add_argument("--disk-dir", default=None)
    parser.add_argument("--worker", choices=("torch_ckpt", "ts_ckpt"), help=argparse.SUPPRESS)
    parser.add_argument("--grads-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(_worker(args)))
        return 0
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="1048576")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("torch_ckpt", "ts_ckpt"):
            cmd = [sys.executable, __file__, *sys.argv[1:], "--worker", mode]
            cmd += ["--grads-out", os.path.join(tmp, f"{mode}.pt")]
            if args.disk_dir is None:
                cmd += ["--disk-dir", tmp]
            done = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
            results[mode] = json.loads(done.stdout.splitlines()[-1])
        if results["torch_ckpt"]["grads"] != results["ts_ckpt"]["grads"]:
            a, b = (torch.load(os.path.join(tmp, f"{m}.pt")) for m in ("torch_ckpt", "ts_ckpt"))
            where = "\n".join(_where_they_differ(a, b))
            print(f"the two modes' gradients differ: no figures\n{where}", file=sys.stderr)
            return 1
    input_mib = args.batch * args.seq * args.dim * 4 / MiB
    print(f"block input {input_mib:.0f} MiB; RSS in MiB at each mark of the last step")
    names = [name for name, _ in results["torch_ckpt"]["marks"]]
    print(f"{'mode':<11}" + "".join(f"{n:>6}" for n in names) + f"{'peak':>7}")
    for mode, r in results.items():
        by_name = dict(r["marks"])
        cells = "".join(f"{by_name[n] / MiB:>6.0f}" for n in names)
        print(f"{mode:<11}{cells}{r['peak'] / MiB:>7.0f}")
    print("gradients: identical")
    return 0


if __name__ == "__main__":
    sys.exit(main())
