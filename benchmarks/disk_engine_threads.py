"""A/B of the raw engine's thread count when reading into freshly allocated tensors.

Run: PYTHONPATH=src python benchmarks/disk_engine_threads.py --dir /var/tmp

``sequential``: 8 tensors of 128 MiB written concurrently, read back one at a time newest
first into fresh tensors (as sequential ``get`` calls do); prints write / read GB/s for 4 and
8 threads, three alternating rounds. ``concurrent``: the same tensors read all at once, next to
fio's O_DIRECT read limit, for a few thread and chunk settings.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import tempfile
import time
from pathlib import Path

import torch

from tierstore.bench._system import measure_raw_limit
from tierstore.config import StoreConfig
from tierstore.tiers.raw import RawEngine

N, SIZE = 8, 128 << 20


async def _sequential(directory: Path, threads: int) -> tuple[float, float]:
    d = Path(tempfile.mkdtemp(dir=directory))
    e = RawEngine((d,), StoreConfig.from_env({}, io_threads=threads))
    s = [torch.randint(0, 256, (SIZE,), dtype=torch.uint8) for _ in range(N)]
    t0 = time.perf_counter()
    await asyncio.gather(*(e.write(i, s[i]) for i in range(N)))
    t1 = time.perf_counter()
    outs = {}
    for i in reversed(range(N)):
        outs[i] = torch.empty(SIZE, dtype=torch.uint8)
        await e.read(i, outs[i])
    t2 = time.perf_counter()
    await e.close()
    shutil.rmtree(d)
    _check(s, outs)
    return N * SIZE / (t1 - t0) / 1e9, N * SIZE / (t2 - t1) / 1e9


async def _concurrent(directory: Path, threads: int, chunk: str) -> float:
    d = Path(tempfile.mkdtemp(dir=directory))
    e = RawEngine((d,), StoreConfig.from_env({}, io_threads=threads, io_chunk_bytes=chunk))
    s = [torch.randint(0, 256, (SIZE,), dtype=torch.uint8) for _ in range(N)]
    await asyncio.gather(*(e.write(i, s[i]) for i in range(N)))

    outs = {i: torch.empty(SIZE, dtype=torch.uint8) for i in range(N)}
    t0 = time.perf_counter()
    await asyncio.gather(*(e.read(i, outs[i]) for i in reversed(range(N))))
    t1 = time.perf_counter()
    await e.close()
    shutil.rmtree(d)
    _check(s, outs)
    return N * SIZE / (t1 - t0) / 1e9


def _check(written: list[torch.Tensor], read: dict[int, torch.Tensor]) -> None:
    """A speed counts only if every byte came back: stop the run otherwise."""
    for i, t in enumerate(written):
        if not torch.equal(read[i], t):
            raise SystemExit(f"tensor {i} did not read back as written; no figure is valid")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", type=Path, default=Path("/var/tmp"))
    args = p.parse_args()
    print("sequential reads: io_threads  write / read GB/s")
    for _ in range(3):
        for threads in (4, 8):
            w, r = asyncio.run(_sequential(args.dir, threads))
            print(f"  {threads}  {w:.2f} / {r:.2f}")
    print("concurrent reads: GB/s")
    for _ in range(2):
        limit = measure_raw_limit(args.dir, 1 << 30)
        if limit is None:
            print("  no O_DIRECT read limit: O_DIRECT failed in this directory")
        else:
            tool = limit.tool.split()[0].rstrip(":")
            print(f"  {tool} O_DIRECT read limit {limit.read_gbps:.2f}")
        for threads, chunk in ((4, "8MiB"), (8, "8MiB"), (16, "4MiB"), (8, "2MiB")):
            speed = asyncio.run(_concurrent(args.dir, threads, chunk))
            print(f"  threads {threads} chunk {chunk}: {speed:.2f}")


if __name__ == "__main__":
    main()
