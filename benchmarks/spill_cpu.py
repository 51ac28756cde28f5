"""CPU seconds per GB of the store's steady spills and reads of big tensors, round by round.

Run: PYTHONPATH=src python benchmarks/spill_cpu.py --dir /var/tmp
     perf record -g -- env PYTHONPATH=src python benchmarks/spill_cpu.py --dir /var/tmp \
         --rounds 20 --no-read           # where a write's CPU goes (perf report --no-children)

A store with no host tier (every tensor spills) takes ``--count`` tensors of ``--size``, the
same tensors every round, as a training step's activations are the same sizes every step: the
first round spills into new space, the later ones reuse it. Each round waits until every tensor
is on disk (polling the store's counters), then, unless ``--no-read``, gets them back newest
first and checks every value. CPU is the process's user + system seconds, I/O threads
included, per GB moved; a write's leaves out what the wait itself spent on its thread, as
``tierstore-bench disk`` does. The setup fills the tensors with a non-zero constant each (a
``memset``; a disk may take zeros faster than data), and each round stamps every page anew
(24 bytes a page), so a profile of a long run is mostly the rounds.

Where the kernel gives each thread's CPU time (``/proc/self/task``), the steady writes' CPU
is also split by thread: the caller's (its puts, less the wait), the store's event loop, its
I/O threads and any other, as totals over the steady rounds per GB (the kernel counts in
ticks of 10 ms, so one round alone is too coarse).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

import tierstore
from tierstore.bench._paths import settle, stamp
from tierstore.config import parse_size
from tierstore.errors import ConfigError

_ROLES = {"MainThread": "caller", "tierstore-loop": "loop"}


def thread_cpu() -> dict[str, float]:
    """CPU seconds (user + system) each role of thread has used so far: the caller, the
    store's loop, its I/O threads, others; empty where ``/proc`` does not say."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended meanwhile
        name = names.get(int(tid), "")
        role = _ROLES.get(name, "I/O threads" if name.startswith("tierstore-io") else "other")
        out[role] = out.get(role, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()), help="spill parent")
    p.add_argument("--size", default="64MiB", help="bytes per tensor (64MiB)")
    p.add_argument("--count", type=int, default=16, help="tensors per round (16)")
    p.add_argument("--rounds", type=int, default=6, help="rounds (6); the first spills anew")
    p.add_argument("--no-read", action="store_true", help="spill only; release unread")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1)")
    args = p.parse_args(argv)
    try:
        args.size = parse_size(args.size, name="--size")
    except ConfigError as exc:
        p.error(str(exc))
    if args.size < 4 or args.count < 1 or args.rounds < 1:
        p.error("--size must be at least 4 bytes, --count and --rounds at least 1")
    torch.set_num_threads(args.threads)
    n = args.size // 4
    tensors = [torch.full((n,), float(i + 1)) for i in range(args.count)]  # no zeros
    gb = args.count * n * 4 / 1e9
    rows: list[tuple[float, float, float, float]] = []
    by_thread: dict[str, float] = {}
    with tierstore.TieredStore(
        device_bytes=0, host_bytes=0, min_bytes=0, disk_dir=args.dir
    ) as store:
        print(f"{args.count} x {n * 4 / 2**20:.0f} MiB per round, spilling under {args.dir}")
        for r in range(args.rounds):
            # Note: [Every page differs]: a write that never happened reads back stale.
            stamp([t.view(torch.uint8) for t in tensors])
            before = store.stats().disk.bytes
            threads = thread_cpu()
            cpu, t0 = time.process_time(), time.perf_counter()
            handles = [store.put(t) for t in tensors]
            waited = settle(store, before + args.count * n * 4)
            write_s, write_cpu = time.perf_counter() - t0, time.process_time() - cpu - waited
            if r:  # steady rounds
                for role, used in thread_cpu().items():
                    spent = used - threads.get(role, 0.0) - (waited if role == "caller" else 0)
                    by_thread[role] = by_thread.get(role, 0.0) + spent
            read_s = read_cpu = float("nan")
            if not args.no_read:
                cpu, t0 = time.process_time(), time.perf_counter()
                for i in reversed(range(args.count)):
                    got = store.get(handles[i])
                    if not torch.equal(got, tensors[i]):
                        print(f"round {r}: tensor {i} read back wrong", file=sys.stderr)
                        return 1
                    del got
                read_s, read_cpu = time.perf_counter() - t0, time.process_time() - cpu
            for h in handles:
                store.release(h)
            del handles
            rows.append((gb / write_s, write_cpu / gb, gb / read_s, read_cpu / gb))
            w, wc, rd, rc = rows[-1]
            print(f"round {r}: write {w:.2f} GB/s {wc:.3f} CPU-s/GB | read {rd:.2f} GB/s "
                  f"{rc:.3f} CPU-s/GB", flush=True)  # fmt: skip
    steady = rows[1:] or rows
    for name, col in (("write GB/s", 0), ("write CPU-s/GB", 1), ("read GB/s", 2),
                      ("read CPU-s/GB", 3)):  # fmt: skip
        values = sorted(row[col] for row in steady)
        print(f"steady {name}: {values[0]:.3f} / {statistics.median(values):.3f} / "
              f"{values[-1]:.3f} (min / median / max of {len(values)})")  # fmt: skip
    if by_thread and args.rounds > 1:
        steady_gb = gb * (args.rounds - 1)
        split = ", ".join(
            # Ticks against the wait's exact thread time: the caller's can come out a hair
            # below zero.
            f"{role} {max(0.0, by_thread.get(role, 0.0)) / steady_gb:.3f}"
            for role in ("caller", "loop", "I/O threads", "other")
        )
        print(f"steady write CPU-s/GB by thread (totals of {args.rounds - 1} rounds): {split}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
