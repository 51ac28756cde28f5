"""A baseline of the one-file-per-tensor disk offloader, for the training-step benchmark.

This is tierstore's reconstruction of the design axolotl publishes for its disk-offloaded
gradient checkpointing, written from that description for comparison; it is not axolotl's
code. The design:

- a checkpoint function that saves each checkpointed layer's input with ``torch.save``, one
  file per tensor, from a pool of 4 save threads, and runs the layer without keeping its
  activations;
- backward waits for that layer's save by polling, loads the file with ``torch.load``, starts
  loading the file backward needs next (a prefetch of one), recomputes the layer with the
  forward's RNG state and backpropagates through it (a reentrant checkpoint);
- each file is deleted after use.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["DiskOffloader"]

_POLL_SECONDS = 0.001
"""How often backward looks whether a save has finished."""


class DiskOffloader:
    """Checkpoints whose inputs go to disk with ``torch.save``, one file per tensor.

    Args:
        directory: where the files go (a private directory is made inside).
        save_threads: threads running ``torch.save`` (4, as the design describes).
    """

    def __init__(self, directory: str | os.PathLike[str], save_threads: int = 4) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix="disk-offloader-", dir=directory))
        self.saves = ThreadPoolExecutor(save_threads, thread_name_prefix="offloader-save")
        self.loads = ThreadPoolExecutor(1, thread_name_prefix="offloader-load")
        self._lock = threading.Lock()
        self._count = 0
        self._stack: list[_Saved] = []
        """Saved inputs in forward order: backward walks it from the end."""

    def checkpoint(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """Run ``layer(x)`` keeping only ``x``, in a file, for backward."""
        with self._lock:
            path = self.directory / f"{self._count:06d}.pt"
            self._count += 1
        saved = _Saved(path, self.saves.submit(torch.save, x.detach(), path))
        self._stack.append(saved)
        out: torch.Tensor = _DiskCheckpoint.apply(self, saved, layer, x)  # type: ignore[no-untyped-call]
        return out

    def load(self, saved: _Saved) -> torch.Tensor:
        """The input of ``saved``: wait for its save by polling, then load (or take the
        prefetched load), and start loading the one backward needs next."""
        while not saved.save.done():
            time.sleep(_POLL_SECONDS)
        saved.save.result()
        load = saved.load or self.loads.submit(_load, saved.path)
        with self._lock:
            i = self._stack.index(saved)
            self._stack.pop(i)
            if i > 0:
                previous = self._stack[i - 1]
                if previous.load is None and previous.save.done():
                    previous.load = self.loads.submit(_load, previous.path)
        x = load.result()
        os.unlink(saved.path)
        return x

    def close(self) -> None:
        """Stop the threads and remove the directory and whatever files are left."""
        self.saves.shutdown(wait=True)
        self.loads.shutdown(wait=True)
        for p in self.directory.iterdir():
            p.unlink()
        self.directory.rmdir()


class _Saved:
    __slots__ = ("load", "path", "save")

    def __init__(self, path: Path, save: Future[None]) -> None:
        self.path = path
        self.save = save
        self.load: Future[torch.Tensor] | None = None


def _load(path: Path) -> torch.Tensor:
    t: torch.Tensor = torch.load(path, weights_only=True)
    return t


class _DiskCheckpoint(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, offloader: DiskOffloader, saved: _Saved, layer: nn.Module, x: torch.Tensor
    ) -> torch.Tensor:
        ctx.offloader, ctx.saved, ctx.layer = offloader, saved, layer
        ctx.rng = torch.get_rng_state()
        # Dropout on a GPU draws from the device's generator: the recompute needs its state too
        # (without it, the baseline's gradients differed from plain training on an H200).
        ctx.device = x.device if x.is_cuda else None
        ctx.device_rng = torch.cuda.get_rng_state(x.device) if x.is_cuda else None
        with torch.no_grad():
            out: torch.Tensor = layer(x)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None, torch.Tensor | None]:
        x = ctx.offloader.load(ctx.saved).requires_grad_()
        with torch.random.fork_rng(devices=[] if ctx.device is None else [ctx.device]):
            torch.set_rng_state(ctx.rng)
            if ctx.device is not None:
                torch.cuda.set_rng_state(ctx.device_rng, ctx.device)
            with torch.enable_grad():
                out = ctx.layer(x)
        torch.autograd.backward(out, grad)
        return None, None, None, x.grad
