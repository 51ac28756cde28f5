"""Two CPU ranks (gloo) train under FSDP2 and tensor parallelism, with and without tierstore.

Run by ``test_fsdp2.py`` as a script: it spawns its two ranks itself, with a file rendezvous
(no network, no port to find), and each rank writes what the test compares into ``--out``:

- ``fsdp2-{mode}-rank{r}.pt``: every gradient shard of every step of a small decoder under
  ``fully_shard`` (one FSDP unit per block and one for the root), for modes ``none``,
  ``hooks`` (``offload_activations``) and ``checkpoint`` (each block through
  ``tierstore.checkpoint``);
- ``tp-{mode}-rank{r}.pt``: the same for an MLP under tensor parallelism, whose hidden
  activations are DTensors (modes ``none`` and ``hooks``);
- ``report-rank{r}.json``: bytes each mode wrote to disk, skips, what a probe saw of a saved
  DTensor after the store gave it back (type, mesh, placements, shape, stride, bytes), and
  what became of a saved DTensor written in place.

Every store has ``host_bytes=0``: all that is stored goes to disk and is read back from it.
The decoder's attention maps are 4 MiB per rank and its MLP activations 2 MiB; the MLP's
DTensor activations have 2 MiB shards.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _adapters_util import TinyDecoder  # this script's directory is on sys.path
from differential import settle
from torch import nn

import tierstore

WORLD = 2


class Decoder(TinyDecoder):
    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        # FSDP2 warns when a sharded module returns a view (the logits are one).
        return super().forward(*args, **kwargs).clone()


def fsdp2_grads(mode: str, store: tierstore.TieredStore, steps: int) -> list[torch.Tensor]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Decoder(vocab=97, dim=128, heads=4, layers=2, seq=256, p=0.1)
    # An explicit CPU mesh: without one, fully_shard shards onto the accelerator when the
    # machine has one, and two ranks on a one-GPU machine then fail.
    mesh = init_device_mesh("cpu", (WORLD,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def through_store(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return tierstore.checkpoint(block, x, store=store)

    grads: list[torch.Tensor] = []
    for step in range(steps):
        torch.manual_seed(100 * rank + step)  # each rank its own batch and dropout masks
        ids = torch.randint(0, 97, (4, 257))
        if mode == "hooks":
            with tierstore.offload_activations(store):
                loss = model.loss(ids)
        elif mode == "checkpoint":
            loss = model.loss(ids, through_store)
        else:
            loss = model.loss(ids)
        settle(store)  # every write lands: backward reads each tensor back from disk
        loss.backward()  # FSDP2 reduce-scatters the gradients here
        grads += [p.grad.to_local().clone() for p in model.parameters() if p.grad is not None]
        opt.step()
        opt.zero_grad()
    return grads


class _Probe(torch.autograd.Function):
    """Saves its input for backward and records what backward gets back."""

    seen: list[dict[str, Any]] = []  # noqa: RUF012

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.expected = _describe(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        _Probe.seen.append({"expected": ctx.expected, "got": _describe(x)})
        return grad


def _describe(x: torch.Tensor) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    info: dict[str, Any] = {"type": type(x).__name__, "shape": list(x.shape)}
    info["stride"] = list(x.stride())
    if isinstance(x, DTensor):
        local = x.to_local()
        info["mesh"] = repr(x.device_mesh)
        info["placements"] = repr(x.placements)
        info["local_stride"] = list(local.stride())
        raw = local.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        info["sha256"] = hashlib.sha256(raw).hexdigest()
    return info


class MLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)  # a DTensor, sharded on its last dimension
        h = _Probe.apply(nn.functional.gelu(h))  # gelu saves the DTensor h; so does the probe
        # A transposed DTensor activation: its global stride is not contiguous.
        h = (h.transpose(0, 1) * 0.5).transpose(0, 1)
        return self.fc2(h)


def tp_grads(mode: str, store: tierstore.TieredStore, steps: int) -> list[torch.Tensor]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (WORLD,))
    torch.manual_seed(0)
    model = MLP(128)
    plan = {"fc1": ColwiseParallel(use_local_output=False), "fc2": RowwiseParallel()}
    parallelize_module(model, mesh, plan)
    grads: list[torch.Tensor] = []
    for step in range(steps):
        torch.manual_seed(step)  # tensor parallelism: every rank sees the same batch
        x = torch.randn(2048, 128, requires_grad=True)
        if mode == "hooks":
            with tierstore.offload_activations(store):
                loss = model(x).pow(2).mean()
        else:
            loss = model(x).pow(2).mean()
        settle(store)
        loss.backward()
        grads += [p.grad.to_local().clone() for p in model.parameters()]
        grads.append(x.grad.clone())
    return grads


def dtensor_written_in_place(store: tierstore.TieredStore) -> dict[str, bool]:
    """A saved DTensor written in place: its old graph raises, a new save stores the new bytes.

    DTensor's in-place operations bump the DTensor's version, not its shard's.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (WORLD,))
    torch.manual_seed(7)
    x = distribute_tensor(torch.randn(2048, 512), mesh, [Shard(0)])  # 2 MiB shards
    w1 = distribute_tensor(torch.randn(2048, 512), mesh, [Shard(0)]).requires_grad_()
    w2 = distribute_tensor(torch.randn(2048, 512), mesh, [Shard(0)]).requires_grad_()
    expected = x.to_local() * 2
    with tierstore.offload_activations(store):
        first = (w1 * x).sum()  # saves x
        x.mul_(2)
        second = (w2 * x).sum()  # saves x again: its new bytes
    second.backward()
    assert w2.grad is not None
    try:
        first.backward()
        raised = False
    except RuntimeError as e:
        raised = "modified by an inplace operation" in str(e)
    return {
        "second_save_has_new_bytes": torch.equal(w2.grad.to_local(), expected),
        "first_graph_raises": raised,
    }


def rank_main(rank: int, rendezvous: str, out: Path, disk_dir: str, steps: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=WORLD)
    report: dict[str, Any] = {}
    settings: dict[str, Any] = {"device_bytes": 0, "host_bytes": 0, "min_bytes": 0}
    with tierstore.TieredStore(disk_dir=disk_dir, **settings) as store:
        for mode in ("none", "hooks", "checkpoint"):
            before = store.stats()
            grads = fsdp2_grads(mode, store, steps)
            torch.save(grads, out / f"fsdp2-{mode}-rank{rank}.pt")
            report[f"fsdp2-{mode}"] = store.stats().bytes_to_disk - before.bytes_to_disk
        for mode in ("none", "hooks"):
            _Probe.seen.clear()
            before = store.stats()
            grads = tp_grads(mode, store, steps)
            torch.save(grads, out / f"tp-{mode}-rank{rank}.pt")
            after = store.stats()
            report[f"tp-{mode}"] = after.bytes_to_disk - before.bytes_to_disk
            report[f"tp-{mode}-unsupported"] = after.skipped.get("unsupported", 0) - (
                before.skipped.get("unsupported", 0)
            )
            report[f"tp-{mode}-probe"] = list(_Probe.seen)
        report["in-place"] = dtensor_written_in_place(store)
    (out / f"report-rank{rank}.json").write_text(json.dumps(report))
    # Both ranks done before either tears gloo down: one leaving while the other's gloo
    # threads still talk to it now and then aborts a process at exit.
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--disk-dir", required=True)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rendezvous = str(args.out / "rendezvous")
    mp.spawn(rank_main, args=(rendezvous, args.out, args.disk_dir, args.steps), nprocs=WORLD)


if __name__ == "__main__":
    main()
