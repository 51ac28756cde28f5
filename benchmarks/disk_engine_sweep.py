"""Sweep the raw engine's knobs (chunk size, threads, checksum) to choose its defaults.

Run: python benchmarks/disk_engine_sweep.py --dir /var/tmp --size 256MiB --count 4

Each point writes ``count`` tensors of ``size`` through the raw engine (O_DIRECT where the
filesystem takes it), reads them back newest first into reused buffers, and prints GB/s.
Also prints the speed of CRC32C alone, which is what the checksum costs the I/O threads.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import mmap
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from tierstore.config import StoreConfig, parse_size
from tierstore.tiers._checksum import IMPLEMENTATION, crc32c
from tierstore.tiers.raw import RawEngine


async def _point(
    directory: Path, cfg: StoreConfig, tensors: list[torch.Tensor]
) -> tuple[float, float]:
    work = Path(tempfile.mkdtemp(prefix="sweep-", dir=directory))
    engine = RawEngine((work,), cfg)
    outs = [torch.zeros_like(t) for t in tensors]
    try:
        total = sum(t.numel() for t in tensors)
        t0 = time.perf_counter()
        await asyncio.gather(*(engine.write(k, t) for k, t in enumerate(tensors)))
        t1 = time.perf_counter()
        await asyncio.gather(*(engine.read(k, outs[k]) for k in reversed(range(len(tensors)))))
        t2 = time.perf_counter()
    finally:
        await engine.close()
        shutil.rmtree(work, ignore_errors=True)
    # Not an assert, which python -O drops: a speed counts only if every byte came back.
    if not all(torch.equal(a, b) for a, b in zip(tensors, outs, strict=True)):
        raise SystemExit("a tensor did not read back as written; no figure is valid")
    return total / (t1 - t0) / 1e9, total / (t2 - t1) / 1e9


def _crc_speed() -> float:
    buf = mmap.mmap(-1, 8 << 20)
    anchor = ctypes.c_char.from_buffer(buf)
    address = ctypes.addressof(anchor)
    t0 = time.perf_counter()
    for _ in range(64):
        crc32c(address, 8 << 20)
    speed = 64 * (8 << 20) / (time.perf_counter() - t0) / 1e9
    del anchor
    buf.close()
    return speed


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", type=Path, default=Path("/var/tmp"))
    p.add_argument("--size", default="256MiB")
    p.add_argument("--count", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--chunks", default="1MiB,4MiB,8MiB,16MiB")
    p.add_argument("--threads", default="2,4,8")
    args = p.parse_args()
    size = parse_size(args.size, name="--size")
    tensors = [torch.randint(0, 256, (size,), dtype=torch.uint8) for _ in range(args.count)]
    print(f"CRC32C alone ({IMPLEMENTATION}), one thread: {_crc_speed():.1f} GB/s")
    print(f"{args.count} x {args.size} per point, median of {args.repeats}; GB/s write / read")
    points = [
        (chunk, threads, checksum)
        for chunk in args.chunks.split(",")
        for threads in (int(t) for t in args.threads.split(","))
        for checksum in ("crc32c", "none")
    ]
    for chunk, threads, checksum in points:
        cfg = StoreConfig.from_env(io_chunk_bytes=chunk, io_threads=threads, checksum=checksum)
        runs = [asyncio.run(_point(args.dir, cfg, tensors)) for _ in range(args.repeats)]
        w = statistics.median(r[0] for r in runs)
        r = statistics.median(r[1] for r in runs)
        print(f"chunk {chunk:>6} threads {threads}  checksum {checksum:<6}  {w:5.2f} / {r:5.2f}")


if __name__ == "__main__":
    main()
