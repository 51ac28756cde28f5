"""Striping a store over 1, 2 and 4 spill directories: throughput and CPU per GB.

Run: PYTHONPATH=src python benchmarks/striping.py --dir /var/tmp [--dirs 1,2,4] [--rounds 3]

Each measurement puts ``--total`` bytes of ``--size`` CPU tensors through a ``TieredStore``
with no host tier (so every tensor spills), waits for the spills, then gets them back newest
first, as backward does; a second pass through the same store is the steady state. The
directory counts take turns within each round. CPU is the process's user + system time (the
I/O threads included) divided by the bytes moved. Every tensor read back is compared with what
was put. On a machine with one disk every directory sits on it, so the figures show what
striping costs, not what several drives gain; give ``--dir`` a ``:``-separated list of
directories on different drives to measure that.
"""

from __future__ import annotations

import argparse
import resource
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

import tierstore
from tierstore.bench._paths import stamp
from tierstore.config import parse_size


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _settle(store: tierstore.TieredStore, nbytes: int, exactly: bool = False) -> None:
    """Wait until the disk tier holds ``nbytes`` (at least, or exactly) and nothing moves."""
    while True:
        st = store.stats()
        on_disk = st.disk.bytes == nbytes if exactly else st.disk.bytes >= nbytes
        if st.inflight_bytes == 0 and on_disk:
            return
        time.sleep(0.001)


def _one(parents: list[Path], n_dirs: int, size: int, total: int) -> dict[str, float]:
    dirs = [Path(tempfile.mkdtemp(dir=parents[i % len(parents)])) for i in range(n_dirs)]
    count = max(1, total // size)
    tensors = [
        torch.randint(-(2**31), 2**31 - 1, (size // 4,), dtype=torch.int32) for _ in range(count)
    ]
    out: dict[str, float] = {}
    try:
        with tierstore.TieredStore(device_bytes=0, host_bytes=0, disk_dir=dirs) as store:
            for phase in ("first", "steady"):
                # Note: [Every page differs]: a steady write that never happened would
                # otherwise read back the first phase's bytes and pass.
                stamp([t.view(torch.uint8) for t in tensors])
                c0, t0 = _cpu(), time.perf_counter()
                handles = [store.put(t) for t in tensors]
                _settle(store, count * size)
                c1, t1 = _cpu(), time.perf_counter()
                back = [store.get(h) for h in reversed(handles)]
                c2, t2 = _cpu(), time.perf_counter()
                for t, b in zip(reversed(tensors), back, strict=True):
                    if not torch.equal(b, t):
                        raise SystemExit(f"wrong bytes read back with {n_dirs} directories")
                del back
                for h in handles:
                    store.release(h)
                del handles
                _settle(store, 0, exactly=True)
                moved = count * size / 1e9
                out[f"{phase} write GB/s"] = moved / (t1 - t0)
                out[f"{phase} read GB/s"] = moved / (t2 - t1)
                out[f"{phase} write CPU s/GB"] = (c1 - c0) / moved
                out[f"{phase} read CPU s/GB"] = (c2 - c1) / moved
    finally:
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default="/var/tmp", help="parent(s), ':'-separated")
    p.add_argument("--dirs", default="1,2,4", help="directory counts to compare")
    p.add_argument("--size", default="64MiB")
    p.add_argument("--total", default="1GiB")
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    parents = [Path(x) for x in a.dir.split(":")]
    counts = [int(x) for x in a.dirs.split(",")]
    size, total = parse_size(a.size, name="--size"), parse_size(a.total, name="--total")
    results: dict[int, list[dict[str, float]]] = {n: [] for n in counts}
    for r in range(a.rounds):
        order = counts if r % 2 == 0 else list(reversed(counts))
        for n in order:
            results[n].append(_one(parents, n, size, total))
            print(
                f"round {r + 1}, {n} dir(s): "
                + ", ".join(f"{k} {v:.3f}" for k, v in results[n][-1].items()),
                flush=True,
            )
    print(f"\n{a.size} tensors, {a.total} per pass, median (min-max) of {a.rounds} rounds")
    for n in counts:
        keys = results[n][0].keys()
        cells = []
        for k in keys:
            vals = [x[k] for x in results[n]]
            cells.append(f"{k} {statistics.median(vals):.2f} ({min(vals):.2f}-{max(vals):.2f})")
        print(f"{n} dir(s): " + "; ".join(cells))


if __name__ == "__main__":
    main()
