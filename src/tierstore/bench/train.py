"""``tierstore-bench train``: step time and peak memory of a decoder-only transformer per mode.

Modes (each in a fresh process, so peaks do not mix):
  none            plain training, autograd keeps every activation
  save_on_cpu     torch.autograd.graph.save_on_cpu (pin_memory on a GPU)
  torch_ckpt      torch.utils.checkpoint(use_reentrant=False) around each block
  disk_baseline   a baseline of the one-file-per-tensor disk offloader (axolotl's published
                  design: torch.save from 4 threads, polling, a prefetch of one; see
                  tierstore/bench/_disk_offloader.py) checkpointing each block
  ts_host         tierstore.offload_activations, host tier only (device_bytes=0)
  ts_disk         tierstore.offload_activations, disk tier only (device_bytes=0, host_bytes=0)
  ts_ckpt         tierstore.checkpoint around each block, layer inputs on the disk tier

Step time is the median of --steps steps after --warmup steps. Peak memory is the peak RSS
sampled by a thread every --sample-ms during the measured steps; on CUDA the table shows
torch.cuda.max_memory_allocated instead, the memory offloading frees, and the workers use
deterministic algorithms so that the gradient check below can compare bit for bit. With
--rounds N every mode runs N times, the modes taking turns, so that load from other processes
on a shared machine falls on all modes alike; the step time is then the median over all
rounds' steps and the peak the median of the rounds'.

Before it is timed, every mode trains one step from the same weights, batch and dropout seed
and reports a digest of its loss and gradients; after the timed steps it reports a digest of
the weights and the optimizer's state, which every timed step's gradients shaped. A mode
whose digests differ from plain training's (``none``, run for the comparison when not asked
for) computed wrong values: it is not reported, the run says so, and it exits with status 1.
Figures taken while values were wrong mean nothing. Plain training must give one digest of
each kind over all rounds, or nothing can be checked against it and the run stops.

Every child runs with MALLOC_MMAP_THRESHOLD_=1048576, so that every mode returns freed
tensors of 1 MiB and more to the OS at once. Without it glibc would keep them in its heap in
the modes that do not offload, while the store returns what it frees with malloc_trim (Note:
[Returning host memory]), and the RSS comparison would favour
the store.

    tierstore-bench train --json results.jsonl      # or: python -m tierstore.bench.train
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from tierstore.bench._model import ATTENTION, Decoder, PeakRSS, saved_activation_bytes
from tierstore.config import parse_size

__all__ = ["MODES", "Report", "main", "measure", "peak_measure", "table"]

MODES = ("none", "save_on_cpu", "torch_ckpt", "disk_baseline", "ts_host", "ts_disk", "ts_ckpt")

GPU_PEAK = "cuda_max_allocated_bytes"
"""A CUDA run's peak GPU memory (torch.cuda.max_memory_allocated over the measured steps)."""
FORWARD_PEAK = "cuda_forward_peak_bytes"
"""A CUDA run's peak GPU memory by the end of forward, the most over the measured steps."""


CHECKED_DIGEST = "grads_sha256"
"""The digest of the checked step's loss and gradients."""
FINAL_DIGEST = "final_state_sha256"
"""The digest of the weights and the optimizer's state after the timed steps."""


def _bytes_of(t: torch.Tensor) -> bytes:
    return t.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()


def state_digest(model: nn.Module, opt: torch.optim.Optimizer) -> str:
    """A digest of ``model``'s weights and ``opt``'s state for each, in parameter order."""
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(_bytes_of(p))
        state = opt.state.get(p, {})
        for key in sorted(state):
            value = state[key]
            digest.update(key.encode())
            digest.update(
                _bytes_of(value) if isinstance(value, torch.Tensor) else repr(value).encode()
            )
    return digest.hexdigest()


def store_for(mode: str, args: argparse.Namespace) -> Any:
    import tierstore

    common: dict[str, Any] = {
        "min_bytes": args.min_bytes,
        "disk_dir": args.disk_dir,
        "device_bytes": 0,
        "prefetch_bytes": args.prefetch_bytes,
        "max_inflight_bytes": args.inflight_bytes,
    }
    if mode == "ts_host":
        return tierstore.TieredStore(**common, host_bytes="unlimited")
    return tierstore.TieredStore(**common, host_bytes=0)


def run_worker(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda":
        # The gradient check compares bit for bit, so every mode must compute the same way:
        # cuBLAS picks its reductions by workspace, and some kernels accumulate with atomics.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        # Deterministic mode would also fill every torch.empty, the store's buffers included.
        torch.utils.deterministic.fill_uninitialized_memory = False  # type: ignore[attr-defined]
    torch.manual_seed(0)
    model = Decoder(args.vocab, args.dim, args.heads, args.layers, args.dropout, args.attention)
    model = model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq + 1), device=device)
    store = store_for(mode, args) if mode.startswith("ts_") else None

    import tierstore

    wrap: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None
    if mode == "torch_ckpt":

        def wrap(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = torch_checkpoint(block, x, use_reentrant=False)
            return out
    elif mode == "ts_ckpt":

        def wrap(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = tierstore.checkpoint(block, x, store=store)
            return out
    elif mode == "disk_baseline":
        from tierstore.bench._disk_offloader import DiskOffloader

        offloader = DiskOffloader(args.disk_dir)
        wrap = offloader.checkpoint

    def context() -> AbstractContextManager[Any]:
        if mode == "save_on_cpu":
            return torch.autograd.graph.save_on_cpu(pin_memory=device.type == "cuda")
        if mode in ("ts_host", "ts_disk"):
            return tierstore.offload_activations(store)
        return nullcontext()

    cpu_times: list[float] = []
    # Per step on CUDA: the GPU's peak allocation by the end of forward, and over the step.
    forward_peaks: list[int] = []
    step_peaks: list[int] = []
    digest = hashlib.sha256()

    def step(check: bool = False) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(device)
        c0 = time.process_time()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with context():
            logits = model(ids[:, :-1], wrap)
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        del logits
        if device.type == "cuda":
            forward_peaks.append(torch.cuda.max_memory_allocated(device))
        loss.backward()  # type: ignore[no-untyped-call]
        if check:
            digest.update(_bytes_of(loss))
            for p in model.parameters():
                if p.grad is not None:
                    digest.update(_bytes_of(p.grad))
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
            step_peaks.append(torch.cuda.max_memory_allocated(device))
        cpu_times.append(time.process_time() - c0)
        return time.perf_counter() - t0

    torch.manual_seed(1)  # the dropout masks of the checked step
    step(check=True)  # also the first warm-up step
    for _ in range(args.warmup - 1):
        step()
    cpu_times.clear()
    forward_peaks.clear()
    step_peaks.clear()
    before = store.stats() if store is not None else None
    rss_before = PeakRSS.now()
    times: list[float] = []
    with PeakRSS(args.sample_ms / 1000) as sampler:
        for _ in range(args.steps):
            times.append(step())
    result: dict[str, Any] = {
        "mode": mode,
        "device": str(device),
        "threads": torch.get_num_threads(),
        "steps": args.steps,
        "step_s_median": statistics.median(times),
        "step_s": times,
        CHECKED_DIGEST: digest.hexdigest(),
        # CPU seconds of all the process's threads (store I/O threads included): on a shared
        # machine, less disturbed by other processes than wall time.
        "cpu_s": list(cpu_times),
        "cpu_s_median": statistics.median(cpu_times),
        "rss_before_bytes": rss_before,
        "peak_rss_bytes": sampler.peak,
        "ru_maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "saved_activation_bytes": saved_activation_bytes(model, ids, args.min_bytes),
        "config": {k: v for k, v in vars(args).items() if k not in ("json", "modes", "worker")},
    }
    result[FINAL_DIGEST] = state_digest(model, opt)
    if device.type == "cuda":
        result[GPU_PEAK] = max(step_peaks)
        result[FORWARD_PEAK] = max(forward_peaks)
    if store is not None:
        # Writes of the last step may still be in flight; their bytes count when they end.
        while store.stats().inflight_bytes:
            time.sleep(0.001)
        after = store.stats()
        assert before is not None
        n = args.steps
        result.update(
            offloaded_bytes_per_step=(after.bytes_put - before.bytes_put) // n,
            offloaded_tensors_per_step=(after.puts - before.puts) // n,
            bytes_to_disk_per_step=(after.bytes_to_disk - before.bytes_to_disk) // n,
            # Spills started; a tiny step's backward may release an entry before its write.
            spilled_tensors_per_step=(after.disk.total_entries - before.disk.total_entries) / n,
            bytes_from_disk_per_step=(after.bytes_from_disk - before.bytes_from_disk) // n,
            get_wait_s_per_step=(after.get_wait_seconds - before.get_wait_seconds) / n,
            put_wait_s_per_step=(after.put_wait_seconds - before.put_wait_seconds) / n,
            skipped_bytes=dict(after.skipped_bytes),
            # What the store itself held at most on the device and in host memory.
            store_device_peak_bytes=after.device.peak_bytes,
            store_host_peak_bytes=after.host.peak_bytes,
            summary=after.summary(),
        )
        store.close()
    if mode == "disk_baseline":
        offloader.close()
    return result


@contextmanager
def _busy_core(enabled: bool) -> Iterator[None]:
    """Another process spinning on one core for the duration, when ``enabled``."""
    if not enabled:
        yield
        return
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        spinner.kill()
        spinner.wait()


@contextmanager
def spill_parent(path: str | None) -> Iterator[str]:
    if path is not None:
        yield path
        return
    # /var/tmp is on disk where /tmp may be a tmpfs (which would put "disk" back in RAM).
    parent = "/var/tmp" if os.access("/var/tmp", os.W_OK) else None
    with tempfile.TemporaryDirectory(prefix="tierstore-bench-", dir=parent) as d:
        yield d


def _byte_size(text: str) -> int:
    try:
        return parse_size(text, name="--min-bytes")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parser() -> argparse.ArgumentParser:
    """The options of ``tierstore-bench train``; defaults are the model measured in docs."""
    p = argparse.ArgumentParser(
        prog="tierstore-bench train",
        description=__doc__.splitlines()[0].replace("``", ""),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated of {MODES}")
    p.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda"
    )
    p.add_argument("--layers", type=int, default=4, help="decoder blocks")
    p.add_argument("--dim", type=int, default=384, help="model width")
    p.add_argument("--heads", type=int, default=6, help="attention heads (divide --dim)")
    p.add_argument(
        "--seq",
        type=int,
        default=512,
        help="sequence length: a block's input is batch x seq x dim floats",
    )
    p.add_argument("--batch", type=int, default=4, help="sequences per step")
    p.add_argument("--vocab", type=int, default=2048, help="vocabulary size")
    p.add_argument("--dropout", type=float, default=0.1, help="dropout probability")
    p.add_argument(
        "--attention",
        choices=ATTENTION,
        default="explicit",
        help="explicit: the causal map built with its own ops, dropout on it; sdpa: the fused "
        "scaled_dot_product_attention, which keeps no map, as long-context models train",
    )
    p.add_argument(
        "--warmup", type=int, default=2, help="untimed steps, at least 1: the checked step"
    )
    p.add_argument("--steps", type=int, default=5, help="timed steps per round")
    p.add_argument(
        "--threads", type=int, default=torch.get_num_threads(), help="torch's CPU threads"
    )
    p.add_argument("--sample-ms", type=float, default=1.0, help="RSS sampling interval")
    p.add_argument(
        "--min-bytes",
        type=_byte_size,
        default="1MiB",  # a string default goes through type, and shows as written
        help="store and adapter min_bytes, in bytes or with a unit",
    )
    p.add_argument("--prefetch-bytes", default="32MiB", help="store prefetch window")
    p.add_argument("--inflight-bytes", default="32MiB", help="store save semaphore")
    p.add_argument(
        "--disk-dir",
        help="parent of the spill directory (default: a temp dir)%(default).0s",  # not "None"
    )
    p.add_argument("--rounds", type=int, default=1, help="run every mode this many times")
    p.add_argument(
        "--busy",
        action="store_true",
        help="keep one core busy with another process while each mode runs (as a data "
        "loader or a neighbour would)",
    )
    p.add_argument("--json", type=Path, help="append one JSON line per mode to this file")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    return p


@dataclass
class Report:
    """What a run measured: one combined result per mode whose gradients were right."""

    results: list[dict[str, Any]]
    wrong: list[str]
    """Modes whose values differed from plain training: measured, never reported."""
    why: dict[str, str] = field(default_factory=dict)
    """For each mode of ``wrong``, what differed."""
    warnings: list[str] = field(default_factory=list)
    """What the workers wrote to stderr, each line once, prefixed by ``[mode]``: the caller
    shows them once its progress bar is gone."""

    def refusals(self) -> list[str]:
        """One line per refused mode, saying what differed."""
        return [
            f"REFUSED {mode}: its {self.why.get(mode, 'values')} differ from training without "
            "offloading, so its figures are not reported"
            for mode in self.wrong
        ]


def measure(argv: list[str], progress: Callable[[str], None] | None = None) -> Report:
    """Run every mode of ``argv`` (``tierstore-bench train`` options) in its own process.

    ``progress`` is called with a label before each worker starts.

    Raises:
        SystemExit: a bad option, or a worker that failed.
    """
    p = parser()
    args = p.parse_args(argv)
    if args.warmup < 1:
        p.error("--warmup must be at least 1: the first warm-up step is the checked one")
    modes = args.modes.split(",")
    unknown = set(modes) - set(MODES)
    if unknown:
        p.error(f"unknown modes {sorted(unknown)}; choose from {MODES}")
    # Plain training is the reference every mode's gradients are checked against.
    run_modes = modes if "none" in modes else ["none", *modes]
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in run_modes}
    warnings: dict[str, None] = {}  # ordered, each line once over the rounds
    with spill_parent(args.disk_dir) as disk_dir:
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
        # The package's own parent first, so a worker imports this very tierstore.
        here = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [here, env.get("PYTHONPATH")]))
        forwarded = _strip(list(argv), ("--json", "--modes", "--disk-dir", "--rounds"))
        forwarded = [a for a in forwarded if a != "--busy"]
        for _ in range(args.rounds):
            for mode in run_modes:
                if progress is not None:
                    progress(f"train {mode}")
                cmd = [
                    sys.executable,
                    "-m",
                    "tierstore.bench.train",
                    *forwarded,
                    "--worker",
                    mode,
                    "--disk-dir",
                    disk_dir,
                ]
                with _busy_core(args.busy):
                    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
                if proc.returncode != 0:
                    sys.stderr.write(proc.stderr)
                    raise SystemExit(f"mode {mode} failed (exit {proc.returncode})")
                # A worker's warnings (no room, nothing offloaded) say what its figures mean.
                warnings.update(dict.fromkeys(f"[{mode}] {x}" for x in proc.stderr.splitlines()))
                runs[mode].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    keys = {
        CHECKED_DIGEST: "loss and gradients of the checked step",
        FINAL_DIGEST: "weights and optimizer state after the timed steps",
    }
    for key in keys:
        seen = {r[key] for r in runs["none"]}
        if len(seen) != 1:
            raise SystemExit(
                f"plain training gave {len(seen)} different {key} over {args.rounds} "
                "rounds: it is not deterministic here, so no mode can be checked against it"
            )
    why: dict[str, str] = {}
    for mode in modes:
        plain = runs["none"][0]
        differ = [what for k, what in keys.items() if {r[k] for r in runs[mode]} != {plain[k]}]
        if differ:
            why[mode] = " and ".join(differ)
    wrong = list(why)
    unforwarded = {"rounds": args.rounds, "busy": args.busy}
    # Plain training was run, asked for or not: every ratio is taken against it.
    results = [combine(runs[mode], **unforwarded) for mode in run_modes if mode not in wrong]
    return Report(results, wrong, why, list(warnings))


def main(argv: list[str] | None = None) -> int:
    """``tierstore-bench train``: measure, print the table, exit 1 if a mode was refused."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    if args.worker:
        print(json.dumps(run_worker(args.worker, args)))
        return 0
    report = measure(argv)
    if args.json is not None:
        with args.json.open("a") as f:
            for result in report.results:
                f.write(json.dumps(result) + "\n")
    print(table(report.results))
    for line in [*report.warnings, *report.refusals()]:
        print(line, file=sys.stderr)
    return 1 if report.wrong else 0


_PER_ROUND = (
    "peak_rss_bytes",
    "rss_before_bytes",
    "ru_maxrss_bytes",
    GPU_PEAK,
    FORWARD_PEAK,
    "offloaded_bytes_per_step",
    "offloaded_tensors_per_step",
    "bytes_to_disk_per_step",
    "spilled_tensors_per_step",
    "bytes_from_disk_per_step",
    "get_wait_s_per_step",
    "put_wait_s_per_step",
    "store_device_peak_bytes",
    "store_host_peak_bytes",
)
"""A worker's figures that :func:`combine` reports as the median of the rounds' (each
round's kept beside it, under the key with ``_rounds`` added)."""


def combine(runs: list[dict[str, Any]], /, **config: Any) -> dict[str, Any]:
    """One result per mode: median step over all rounds' steps, and of every figure in
    ``_PER_ROUND`` the median of the rounds'. ``config`` (the options the workers were not
    given, such as ``rounds`` and ``busy``) is added to the recorded configuration."""
    result = dict(runs[-1])
    result["config"] = {**result.get("config", {}), **config}
    times = [t for r in runs for t in r["step_s"]]
    cpu = [t for r in runs for t in r["cpu_s"]]
    result["rounds"] = len(runs)
    result["step_s"] = times
    result["step_s_median"] = statistics.median(times)
    result["cpu_s"] = cpu
    result["cpu_s_median"] = statistics.median(cpu)
    for key in _PER_ROUND:
        if key not in result:
            continue
        median = statistics.median(r[key] for r in runs)
        result[key] = median if isinstance(result[key], float) else int(median)
        result[key + "_rounds"] = [r[key] for r in runs]
    return result


def _strip(argv: list[str], names: tuple[str, ...]) -> list[str]:
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in names:
            skip = True
            continue
        if any(a.startswith(n + "=") for n in names):
            continue
        out.append(a)
    return out


def peak_measure(results: list[dict[str, Any]]) -> tuple[str, str]:
    """The peak that shows what offloading saves, and its column title: the GPU's peak
    allocation when every result has one (on CUDA, offloading frees GPU memory and fills host
    memory), else the process's peak RSS."""
    if results and all(GPU_PEAK in r for r in results):
        return GPU_PEAK, "peak GPU MiB"
    return "peak_rss_bytes", "peak RSS MiB"


SAVED_AGAINST = {"ts_ckpt": "torch_ckpt"}
"""The mode whose peak a mode's saving is measured against, where not ``none``: the offloaded
checkpoint moves only block inputs, so what it saves is what torch's checkpoint keeps."""


def table(results: list[dict[str, Any]]) -> str:
    """The results as a text table; ``saved/offloaded`` is the peak memory a mode saves against
    plain training (against torch's checkpoint for ``ts_ckpt``) per byte it offloads, and
    ``read back`` what the store read from disk per step (``-`` for modes without a store).

    The peak is the process's RSS on the CPU and the GPU's peak allocation on CUDA, where
    offloading moves activations out of the GPU's memory into the host's. On CUDA a column
    adds the peak by the end of forward: the optimizer's step, the same in every mode, can
    set the step's peak and hide what offloading saved."""
    mib = 1 << 20
    by_mode = {r["mode"]: r for r in results}
    base = by_mode.get("none")
    peak, peak_name = peak_measure(results)
    forward = peak == GPU_PEAK and all(FORWARD_PEAK in r for r in results)
    head = (
        f"{'mode':<12} {'step s':>8} {'x none':>7} {'CPU s':>7} {'x none':>7} "
        f"{peak_name:>13} {'vs none':>9} "
        + (f"{'fwd GPU MiB':>12} " if forward else "")
        + f"{'offloaded MiB/step':>19} {'read back MiB/step':>19} {'saved/offloaded':>16}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        ratio = r["step_s_median"] / base["step_s_median"] if base else float("nan")
        cpu_ratio = r["cpu_s_median"] / base["cpu_s_median"] if base else float("nan")
        delta = (r[peak] - base[peak]) / mib if base else float("nan")
        off = r.get("offloaded_bytes_per_step")
        # From disk: a disk tier whose gets were served from memory shows it here.
        read = r.get("bytes_from_disk_per_step")
        ref = by_mode.get(SAVED_AGAINST.get(r["mode"], "none"))
        saved = f"{(ref[peak] - r[peak]) / off:.0%}" if ref and off else "-"
        lines.append(
            f"{r['mode']:<12} {r['step_s_median']:>8.3f} {ratio:>7.2f} "
            f"{r['cpu_s_median']:>7.2f} {cpu_ratio:>7.2f} "
            f"{r[peak] / mib:>13.0f} {delta:>+9.0f} "
            + (f"{r[FORWARD_PEAK] / mib:>12.0f} " if forward else "")
            + f"{(off or 0) / mib:>19.0f} "
            + (f"{read / mib:>19.0f} " if read is not None else f"{'-':>19} ")
            + f"{saved:>16}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
