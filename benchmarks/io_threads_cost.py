"""What a pool of I/O threads costs in CPU over the disk's own work, request size by request size.

Run: PYTHONPATH=src python benchmarks/io_threads_cost.py --dir /var/tmp

The raw engine moves every chunk with one ``pwrite``/``preadv`` on a thread of its pool. The
kernel's O_DIRECT work (pinning pages, building the request) costs the same however the call is
made; what a pool adds is a hand-off, a thread wake-up and the interpreter per request, which
is what io_uring would save. This measures that share: O_DIRECT writes (over a file already
written, as steady-state spilling does) and reads of ``--total`` bytes in requests of each of
``--sizes``, made by

- ``loop``: one request at a time on the calling thread, no hand-off, as dd makes them (the
  disk limit ``tierstore-bench`` compares with where fio is absent);
- ``pool x1``: the engine's syscall loops on a pool of one thread, one request in flight;
- ``pool xN``: the same on ``--threads`` threads (the engine's default, 8), N in flight.

Every path writes random bytes (Note: [The disk's limit is measured with real bytes] in
``tierstore.bench._system``); the loop's never repeat, while a pool's N buffers repeat through
the file, which moves a deduplicating disk's speed but not the CPU per request measured here.
CPU is the process's user + system seconds (all its threads) per GB; the loop's is its
thread's. The paths take turns within each round. After the last round every block is read
back and checked against the stamp the pool wrote into it.
"""

from __future__ import annotations

import argparse
import functools
import mmap
import os
import random
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tierstore.bench._system import direct_io
from tierstore.config import parse_size
from tierstore.errors import ConfigError
from tierstore.tiers.raw import probe_direct_io
from tierstore.tiers.raw._syscalls import pread_all, pwrite_all


@functools.lru_cache(maxsize=64)
def _stamp(block: int, i: int) -> bytes:
    # Random, no page of a buffer like another: a disk may take zeros faster than data.
    return random.Random(i).randbytes(block)


def pool(path: Path, total: int, block: int, threads: int, write: bool) -> tuple[float, float]:
    """(GB/s, CPU seconds per GB) of ``total`` bytes in ``block``-byte requests on ``threads``."""
    fd = os.open(path, (os.O_WRONLY if write else os.O_RDONLY) | os.O_DIRECT)
    # Page-aligned, as O_DIRECT needs; request i uses buffer i % threads, so each thread's
    # requests find their buffer free (map hands request i to a thread after request i - threads).
    buffers = [mmap.mmap(-1, block) for _ in range(threads)]
    views = [memoryview(b) for b in buffers]
    for i, b in enumerate(buffers):
        b.write(_stamp(block, i))

    def one(i: int) -> None:
        if write:
            pwrite_all(fd, views[i % threads], i * block)
        else:
            pread_all(fd, views[i % threads], i * block, path)

    try:
        cpu, t0 = time.process_time(), time.perf_counter()
        with ThreadPoolExecutor(threads) as workers:
            for _ in workers.map(one, range(total // block)):
                pass
        seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu
    finally:
        os.close(fd)
        for v in views:
            v.release()
        for b in buffers:
            b.close()
    return total / seconds / 1e9, cpu / (total / 1e9)


def check(path: Path, total: int, block: int, threads: int) -> None:
    """Every block holds the stamp of the buffer the pool wrote it from."""
    with path.open("rb", buffering=0) as f:
        for i in range(total // block):
            if f.read(block) != _stamp(block, i % threads):
                raise SystemExit(f"block {i} of {block} bytes did not read back as written")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    ap.add_argument("--sizes", default="64KiB,1MiB,8MiB", help="request sizes, comma-separated")
    ap.add_argument("--total", default="1GiB", help="bytes per measurement (default 1GiB)")
    ap.add_argument("--threads", type=int, default=8, help="the pool's threads (default 8)")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    try:
        sizes = [parse_size(s, name="--sizes") for s in args.sizes.split(",")]
        total = parse_size(args.total, name="--total")
    except ConfigError as e:
        ap.error(str(e))
    if bad := [s for s in sizes if s % 4096 or total % s]:
        ap.error(f"--sizes {bad}: each must be a multiple of 4 KiB dividing --total {total}")
    probe = probe_direct_io(args.dir)
    if not probe.supported:
        ap.error(f"--dir {args.dir}: no O_DIRECT there ({probe.reason}); name a disk's directory")

    fd, name = tempfile.mkstemp(dir=args.dir, prefix=".io-threads-cost-")
    os.close(fd)
    path = Path(name)
    try:
        direct_io(path, total, "write", block=max(sizes))  # the blocks exist: runs overwrite
        print(f"{'size':>8}  {'op':5}  {'loop GB/s  CPU s/GB':>18}  {'pool x1':>14}  "
              f"{f'pool x{args.threads}':>14}")  # fmt: skip
        for r in range(args.rounds):
            for block in sizes:
                for op in ("write", "read"):
                    rows = [
                        direct_io(path, total, op, block=block),
                        pool(path, total, block, 1, op == "write"),
                        pool(path, total, block, args.threads, op == "write"),
                    ]
                    cells = "  ".join(f"{gbps:6.2f} {cpu:7.3f}" for gbps, cpu in rows)
                    print(f"{block >> 10:>5} KiB  {op:5}  {cells}   (round {r + 1})", flush=True)
            # The pool wrote last, in the last size.
            check(path, total, block=sizes[-1], threads=args.threads)
    finally:
        path.unlink(missing_ok=True)
    print(f"verified: every {sizes[-1]}-byte block read back as the pool wrote it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
