"""``tierstore-bench disk``: tierstore's disk tier against the disk's own limit and the others.

Example:
    tierstore-bench disk --sizes 1MiB,16MiB --total 256MiB --repeats 3 --json out.json
    tierstore-bench --full        # the whole sweep below, with its defaults (15-20 minutes)

Every measurement pushes ``--total`` bytes of tensors of one size through one path, writes
them, then reads them back newest first. The paths, all in one run:

* ``raw-limit``: fio with O_DIRECT, 1 MiB blocks, 16 in flight (where fio is absent, an O_DIRECT
  loop of 1 MiB requests, one in flight, as dd's, of random bytes),
  writing a new file; ``raw-limit-overwrite``: the same writes over the file just written;
* ``tierstore-raw``, ``tierstore-raw-2dirs``, ``tierstore-zarr``: a ``TieredStore`` with no
  host tier, so every tensor spills, through ``put``/``get`` (the 2dirs variant stripes over
  ``--dir`` and ``--dir2``); ``tierstore-raw-steady`` and ``tierstore-raw-2dirs-steady``: the
  same tensors again through the same store once the first round is released, as in every
  training step after the first (Note: [First spill and steady state]);
* ``raw-engine``: the raw engine without the store around it;
* ``torch.save``: one ``torch.save``/``torch.load`` file per tensor from 4 threads, as
  axolotl's offloader saves;
* ``aiofiles``: whole-file writes and ``readinto`` reads, 16 in flight;
* ``os``: plain ``os.write``/``os.readv`` of whole files.

Buffered paths (the file paths, ``tierstore-zarr``) are written back (``sync_file_range``)
within their write time and
their files evicted from the page cache before reading; the output says how. Every path
starts with the heap's free memory handed back to the OS, so each reads into new memory
(Note: [Every path reads into new memory]). GB/s means 10**9 bytes per second.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from tierstore._malloc import trim_now
from tierstore.bench._disk_table import Row, print_table, size_name
from tierstore.bench._paths import PATHS, Context, Timing, stamp
from tierstore.bench._system import PageCache, RawLimit, machine_facts, measure_raw_limit
from tierstore.config import StoreConfig, parse_size

__all__ = ["DiskRun", "main", "parser", "print_table", "sweep", "workdirs"]

DEFAULT_SIZES = "64KiB,1MiB,16MiB,256MiB"
DEFAULT_TOTAL = "2GiB"
DEFAULT_ENGINES = ("raw-limit", *PATHS)
MAX_TENSORS = 4096
"""At most this many tensors per measurement, so small sizes do not take minutes per file path."""


def parser() -> argparse.ArgumentParser:
    """The options of ``tierstore-bench disk`` (and of ``tierstore-bench --full``)."""
    p = argparse.ArgumentParser(
        prog="tierstore-bench disk",
        description="Measure tierstore's disk tier against the raw disk and the alternatives.",
    )
    p.add_argument("--sizes", default=DEFAULT_SIZES, help=f"tensor sizes (default {DEFAULT_SIZES})")
    p.add_argument(
        "--total",
        default=DEFAULT_TOTAL,
        help=f"bytes per measurement (default {DEFAULT_TOTAL}; at most {MAX_TENSORS} tensors)",
    )
    p.add_argument("--repeats", type=int, default=3, help="repeats per measurement (default 3)")
    p.add_argument(
        "--engines",
        default=",".join(DEFAULT_ENGINES),
        help=f"comma-separated paths to measure (default all: {','.join(DEFAULT_ENGINES)})",
    )
    p.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="where to run (default: the first TIERSTORE_DISK_DIR directory)",
    )
    p.add_argument(
        "--dir2",
        type=Path,
        default=None,
        help="second directory for the striping figure (default: a second directory under --dir)",
    )
    p.add_argument("--json", type=Path, default=None, help="write the results as JSON here")
    p.add_argument("--plot", type=Path, default=None, help="draw GB/s against size (matplotlib)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


@dataclass
class DiskRun:
    """What one sweep measured."""

    results: list[Row]
    machine: dict[str, object]
    summaries: dict[str, str]
    """The store's ``stats().summary()`` per store path and size (last repeat)."""


@contextlib.contextmanager
def workdirs(directory: Path | None, second: Path | None) -> Iterator[tuple[Path, Path]]:
    """Two private scratch directories, under ``directory`` (default: the first
    ``TIERSTORE_DISK_DIR``) and ``second`` (default: beside the first); removed afterwards."""
    base = directory if directory is not None else StoreConfig.from_env().disk_dirs[0]
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="tierstore-bench-", dir=base))
    d2: Path | None = None
    try:
        d1 = work / "dir1"
        d1.mkdir(mode=0o700)
        if second is not None:
            second.mkdir(parents=True, exist_ok=True)
            d2 = Path(tempfile.mkdtemp(prefix="tierstore-bench-", dir=second))
        else:
            d2 = work / "dir2"
            d2.mkdir(mode=0o700)
        yield d1, d2
    finally:
        if second is not None and d2 is not None:
            shutil.rmtree(d2, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


def steps_of(sizes: list[int], repeats: int, engines: list[str]) -> int:
    """How many measurements :func:`sweep` makes (for a progress bar)."""
    paths = [e for e in engines if e != "raw-limit"]
    return repeats * len(sizes) * (len(paths) + ("raw-limit" in engines))


def _stats(values: list[float]) -> tuple[float, float, float]:
    return min(values), statistics.median(values), max(values)


def main(argv: list[str] | None = None) -> int:
    """``tierstore-bench disk``: run the sweep, print it, write JSON and a plot if asked."""
    from tierstore.bench._progress import progress_bar

    p = parser()
    args = p.parse_args(argv)
    sizes = [parse_size(s, name="--sizes") for s in args.sizes.split(",") if s.strip()]
    total = parse_size(args.total, name="--total")
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [e for e in engines if e not in DEFAULT_ENGINES]
    if unknown or not sizes or args.repeats < 1 or any(s <= 0 for s in sizes):
        p.error(
            f"unknown engine(s) {unknown}; known: {', '.join(DEFAULT_ENGINES)}"
            if unknown
            else "need at least one positive size and --repeats >= 1"
        )
    if args.plot is not None:
        from tierstore.bench._plot import PlotUnavailableError, require_matplotlib

        try:
            require_matplotlib()  # before minutes of measuring, not after
        except PlotUnavailableError as exc:
            print(f"tierstore-bench: {exc}", file=sys.stderr)
            return 2
    with (
        workdirs(args.dir, args.dir2) as (d1, d2),
        progress_bar(steps_of(sizes, args.repeats, engines), not args.no_progress) as step,
    ):
        run = sweep(sizes, total, args.repeats, engines, d1, d2, step)
    print_table(run.results, sizes, run.machine, run.summaries)
    if args.json is not None:
        args.json.write_text(json.dumps({"machine": run.machine, "results": run.results}, indent=2))
        print(f"wrote {args.json}")
    if args.plot is not None:
        from tierstore.bench._plot import plot_disk

        plot_disk(run.results, args.plot, run.machine)
        print(f"wrote {args.plot}")
    return 0


def sweep(
    sizes: list[int],
    total: int,
    repeats: int,
    engines: list[str],
    d1: Path,
    d2: Path,
    progress: Callable[[str], None],
) -> DiskRun:
    """Measure every path of ``engines`` at every size, ``repeats`` times, in ``d1`` (and
    ``d2`` for striping); ``progress`` is called with a label as each measurement starts."""
    from tierstore.tiers.raw import probe_direct_io

    cache = PageCache()
    ctx = Context(d1, d2, cache)
    paths = [e for e in engines if e != "raw-limit"]
    write: dict[tuple[str, int], list[float]] = {}
    cpu: dict[tuple[str, str, int], list[float]] = {}
    read: dict[tuple[str, int], list[float]] = {}
    cached: dict[str, list[int]] = {}
    us_per_tensor: dict[str, list[float]] = {}
    summaries: dict[str, str] = {}
    limits: list[RawLimit] = []

    limit_by_size: dict[int, list[RawLimit]] = {}
    unmeasured = False
    for size in sizes:
        # One size at a time, so only its tensors are in memory; the raw limit is measured
        # next to the paths it is compared with, in each repeat.
        tensors = _make_tensors(size, max(1, min(MAX_TENSORS, total // size)))
        nbytes = sum(t.numel() for t in tensors)
        gb = nbytes / 1e9
        for _ in range(repeats):
            if "raw-limit" in engines:
                progress(f"raw-limit {size_name(size)}")
                # The bytes the paths move at this size (at least 16 MiB, for a tool's
                # start-up to weigh little): a disk's rate depends on how much it is given.
                limit = measure_raw_limit(d1, max(nbytes, 16 << 20))
                if limit is None:
                    if not unmeasured:
                        print(
                            f"tierstore-bench: no raw disk limit in {d1}: O_DIRECT requests "
                            "failed there (fio not installed); the paths are measured alone",
                            file=sys.stderr,
                        )
                    unmeasured = True
                else:
                    limits.append(limit)
                    limit_by_size.setdefault(size, []).append(limit)
            for name in paths:
                progress(f"{name} {size_name(size)} x{len(tensors)}")
                _hand_back_free_memory()
                timing: Timing = PATHS[name](ctx, tensors)
                rounds = [(name, timing)]
                if timing.steady is not None:
                    rounds.append((f"{name}-steady", timing.steady))
                for label, t in rounds:
                    write.setdefault((label, size), []).append(nbytes / t.write_s / 1e9)
                    read.setdefault((label, size), []).append(nbytes / t.read_s / 1e9)
                    cpu.setdefault((label, "write", size), []).append(t.write_cpu_s / gb)
                    cpu.setdefault((label, "read", size), []).append(t.read_cpu_s / gb)
                    if t.cached_delta_bytes is not None:
                        cached.setdefault(f"{label} {size_name(size)}", []).append(
                            t.cached_delta_bytes
                        )
                    if size == min(sizes):
                        per = (t.write_s + t.read_s) / len(tensors) * 1e6
                        us_per_tensor.setdefault(f"{label} {size_name(size)}", []).append(per)
                if timing.stats:
                    # The last repeat's store at each size; its stats cover both rounds.
                    summaries[f"{name} {size_name(size)}"] = timing.stats
        del tensors

    results: list[Row] = []
    for size in sizes:
        if size in limit_by_size:
            here = limit_by_size[size]
            for engine, op, values, cpus in (
                ("raw-limit", "write", [x.write_gbps for x in here], None),
                (
                    "raw-limit",
                    "read",
                    [x.read_gbps for x in here],
                    [x.read_cpu_s_per_gb for x in here],
                ),
                (
                    "raw-limit-overwrite",
                    "write",
                    [x.overwrite_gbps for x in here],
                    [x.write_cpu_s_per_gb for x in here],
                ),
            ):
                lo, med, hi = _stats(values)
                results.append(_result(engine, op, size, lo, med, hi, cpus))
        for name, sz in write:
            if sz != size:
                continue
            for op, table in (("write", write), ("read", read)):
                lo, med, hi = _stats(table[(name, size)])
                results.append(_result(name, op, size, lo, med, hi, cpu[(name, op, size)]))

    machine = machine_facts(d1)
    probe = probe_direct_io(d1)
    machine.update(
        {
            "raw_limit_tool": limits[0].tool if limits else None,
            "o_direct": probe.supported,
            "page_cache": (
                "raw-limit and tierstore-raw use O_DIRECT (no page cache); "
                if probe.supported
                else f"O_DIRECT is refused here ({probe.reason}): the store writes through "
                "the page cache and drops its pages; "
            )
            + cache.method,
            "total_bytes_per_measurement": total,
            "max_tensors_per_measurement": MAX_TENSORS,
            "repeats": repeats,
            "command": "tierstore-bench " + " ".join(sys.argv[1:] if len(sys.argv) > 1 else []),
            "cached_growth_while_spilling_bytes": {
                k: int(statistics.median(v)) for k, v in cached.items()
            },
            "put_get_us_per_tensor": {
                k: round(statistics.median(v), 1) for k, v in us_per_tensor.items()
            },
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
    )
    return DiskRun(results, machine, summaries)


def _hand_back_free_memory() -> None:
    """Start a path with no memory an earlier path freed into the heap.

    Note: [Every path reads into new memory]
        Every path's read phase allocates the tensors it reads back. glibc keeps freed blocks
        of up to 32 MiB in its heap once a free has raised its mmap threshold, so without
        this a path could read into memory the path before it left there, already backed,
        while another path faulted in new memory: ``torch.load`` read markedly faster into
        such memory than into new memory (docs/benchmarks.md), depending only on what ran
        before it. The store hands freed memory back on its own (Note: [Returning host
        memory]), so its reads always faulted in new memory. Collecting garbage and trimming
        the heap before each path gives every path the same start.
    """
    gc.collect()
    trim_now()


def _make_tensors(size: int, n: int) -> list[torch.Tensor]:
    """``n`` tensors of ``size`` random bytes, no two pages alike (Note: [Every page
    differs]), in distinct storages (the store would keep one copy of shared memory)."""
    g = torch.Generator().manual_seed(size)
    block = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g)
    tensors = [block.clone() for _ in range(n)]
    stamp(tensors, 0)
    return tensors


def _result(
    engine: str, op: str, size: int, lo: float, med: float, hi: float, cpus: list[float] | None
) -> Row:
    cpu = statistics.median(cpus) if cpus else None
    return {
        "engine": engine,
        "op": op,
        "size_bytes": size,
        "gbps_min": round(lo, 3),
        "gbps_median": round(med, 3),
        "gbps_max": round(hi, 3),
        # CPU seconds per GB moved (user + system, every thread), median; None where the
        # tool does not report it.
        "cpu_s_per_gb": None if cpu is None or math.isnan(cpu) else round(cpu, 4),
    }


if __name__ == "__main__":
    raise SystemExit(main())
