"""GPU tensors through the store against the PCIe limit, on a CUDA device.

For each round: plain copies of N tensors from the GPU into pinned host memory and back (the
link's limit as PyTorch reaches it), then the same tensors through a store's host tier
(``store.put`` until every copy has landed, ``store.get`` newest first, each read checked
bit for bit against its source), then through its disk tier, from the GPU and from CPU
memory. Modes take turns; the figures are GB/s over all N tensors, minimum, median and
maximum over the rounds.

    python benchmarks/gpu_copy.py --size 64MiB --count 32 --rounds 3 --disk-dir /var/tmp

Exits with a message if a tensor came back different. Needs CUDA (``--device cpu`` only
checks the script).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch

import tierstore
from tierstore.bench._paths import stamp
from tierstore.config import parse_size


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Callable[[], object]) -> float:
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def raw_rates(src: list[torch.Tensor]) -> tuple[float, float]:
    """GB/s of GPU -> pinned and pinned -> GPU copies of ``src``, one stream, non-blocking."""
    pin = src[0].is_cuda
    pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for t in src]
    back = [torch.empty_like(t) for t in src]
    nbytes = sum(t.nbytes for t in src)
    d2h = timed(lambda: [p.copy_(t, non_blocking=True) for p, t in zip(pinned, src, strict=True)])
    h2d = timed(lambda: [b.copy_(p, non_blocking=True) for b, p in zip(back, pinned, strict=True)])
    for b, t in zip(back, src, strict=True):
        if not torch.equal(b, t):
            raise SystemExit("a plain copy came back different: the device is not sound")
    return nbytes / d2h / 1e9, nbytes / h2d / 1e9


def store_rates(store: tierstore.TieredStore, src: list[torch.Tensor]) -> tuple[float, float]:
    """GB/s of putting ``src`` until it has left the GPU, and of getting it back newest first."""
    nbytes = sum(t.nbytes for t in src)
    handles: list[tierstore.TensorHandle] = []

    def put_all() -> None:
        handles.extend(store.put(t) for t in src)
        while store.stats().inflight_bytes:
            time.sleep(0.0002)

    put_s = timed(put_all)
    got: list[torch.Tensor] = []

    def get_all() -> None:
        store.prefetch(reversed(handles))
        got.extend(store.get(h) for h in reversed(handles))

    get_s = timed(get_all)
    for t, g in zip(reversed(src), got, strict=True):
        if g.device != t.device or not torch.equal(g, t):
            raise SystemExit(f"WRONG: a {t.nbytes} B tensor came back different from {store!r}")
    for h in handles:
        store.release(h)
    return nbytes / put_s / 1e9, nbytes / get_s / 1e9


def spread(xs: list[float]) -> str:
    return f"{min(xs):6.1f} {statistics.median(xs):6.1f} {max(xs):6.1f}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="64MiB", help="bytes per tensor (default 64MiB)")
    p.add_argument("--count", type=int, default=32, help="tensors per round (default 32)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--disk-dir", default=None, help="parent of the spill directory")
    p.add_argument("--device", default="cuda", help="cuda (default); cpu only checks the script")
    args = p.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    size = parse_size(args.size, name="--size")
    g = torch.Generator(device=args.device).manual_seed(0)
    src = [torch.randn(size // 4, device=args.device, generator=g) for _ in range(args.count)]
    cpu_src = [t.cpu() for t in src]
    rates: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(dir=args.disk_dir) as d:
        common = {"device_bytes": 0, "min_bytes": 0, "disk_dir": d}
        host = tierstore.TieredStore(**common, host_bytes="unlimited")
        disk = tierstore.TieredStore(**common, host_bytes=0)
        try:
            for _ in range(args.rounds):
                d2h, h2d = raw_rates(src)
                rates.setdefault("plain copy GPU->pinned", []).append(d2h)
                rates.setdefault("plain copy pinned->GPU", []).append(h2d)
                for name, store, tensors in (
                    ("host tier", host, src),
                    ("disk tier", disk, src),
                    # The same store and bytes from CPU memory: what the disk gives without
                    # the device copies, to tell the GPU path's cost from the disk's.
                    ("disk tier, CPU tensors", disk, cpu_src),
                ):
                    # Note: [Every page differs]: new bytes for every pass, so a write that
                    # never happened cannot read back as the pass before's.
                    stamp([t.view(torch.uint8) for t in tensors])
                    put, get = store_rates(store, tensors)
                    rates.setdefault(f"{name} put", []).append(put)
                    rates.setdefault(f"{name} get", []).append(get)
            disk_stats = disk.stats().summary()
        finally:
            host.close()
            disk.close()
    name = torch.cuda.get_device_name() if src[0].is_cuda else "CPU"
    print(f"{name}, {args.count} x {args.size}, {args.rounds} rounds")
    print(f"{'GB/s':<36} {'min':>6} {'median':>6} {'max':>6}")
    for name, xs in rates.items():
        print(f"{name:<36} {spread(xs)}")
    print(f"disk tier store, all rounds: {disk_stats}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
