"""``tierstore-bench``: how fast the store spills to this disk, and what offloading saves.

    tierstore-bench                 # about two minutes: both answers, a table, and a PNG
    tierstore-bench --full          # the whole disk sweep (15-20 minutes)
    tierstore-bench disk [...]      # the disk sweep with its own options (--help)
    tierstore-bench train [...]     # the training-step benchmark with its own options (--help)

The default run answers the two questions a user comes with:

1. How fast does the store spill and read back on this disk, against the disk's own limit
   (fio, or O_DIRECT requests one at a time) and against ``torch.save``/``torch.load``?
   Tensors of 1 MiB and 64 MiB, 512 MiB of each, through a store whose host tier is empty,
   three times each.
2. How much memory does offloading save in a training step, and at what cost in step time?
   A small decoder (4 blocks, width 256, batch 4, sequence 512) trains in a fresh process per
   mode: plain, ``torch.utils.checkpoint``, and tierstore's host tier, disk tier and
   offloaded checkpoint. Each mode's gradients are first checked against plain training; a
   mode that differs is refused, not reported.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from tierstore.bench import _disk, train
from tierstore.bench._plot import PlotUnavailableError, plot_summary, require_matplotlib
from tierstore.bench._progress import progress_bar
from tierstore.bench.train import peak_measure

__all__ = ["main"]

MiB = 1 << 20
QUICK_SIZES = [1 * MiB, 64 * MiB]
QUICK_TOTAL = 512 * MiB
QUICK_REPEATS = 3
QUICK_ENGINES = ["raw-limit", "tierstore-raw", "torch.save"]
QUICK_TRAIN = [
    "--layers", "4", "--dim", "256", "--heads", "4", "--seq", "512", "--batch", "4",
    "--warmup", "1", "--steps", "3",
]  # fmt: skip
QUICK_MODES = ("none", "torch_ckpt", "ts_host", "ts_disk", "ts_ckpt")
LABELS = {
    "none": "no offloading",
    "save_on_cpu": "torch save_on_cpu",
    "torch_ckpt": "torch.utils.checkpoint",
    "disk_baseline": "one-file-per-tensor disk offloader (baseline)",
    "ts_host": "tierstore, host tier",
    "ts_disk": "tierstore, disk tier",
    "ts_ckpt": "tierstore.checkpoint, disk",
}
DEFAULT_PLOT = Path("tierstore-bench.png")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tierstore-bench",
        description=__doc__.splitlines()[0].replace("``", ""),
        epilog="Subcommands: 'disk' (the disk sweep) and 'train' (the training-step "
        "benchmark) take their own options; see 'tierstore-bench disk --help'.",
    )
    p.add_argument(
        "--full",
        action="store_true",
        help="run the whole disk sweep instead; it takes the options of 'tierstore-bench disk' "
        "and writes a PNG only with --plot",
    )
    p.add_argument("--dir", type=Path, help="where to spill (default: TIERSTORE_DISK_DIR's first)")
    p.add_argument("--json", type=Path, help="write every figure as JSON here")
    p.add_argument(
        "--plot", type=Path, default=DEFAULT_PLOT, help=f"the PNG to write (default {DEFAULT_PLOT})"
    )
    p.add_argument("--no-plot", action="store_true", help="write no PNG")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run ``tierstore-bench``; return the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["disk"]:
        return _disk.main(argv[1:])
    if argv[:1] == ["train"]:
        return train.main(argv[1:])
    if "--full" in argv:
        # The sweep takes the disk command's options; it writes a PNG only when given --plot.
        argv = [a for a in argv if a not in ("--full", "--no-plot")]
        return _disk.main(argv)
    args = _parser().parse_args(argv)
    plot = None if args.no_plot else args.plot
    try:
        if plot is not None:
            require_matplotlib()  # before minutes of measuring, not after
        return _quick(args, plot)
    except PlotUnavailableError as exc:
        print(f"tierstore-bench: {exc}", file=sys.stderr)
        return 2


def _quick(args: argparse.Namespace, plot: Path | None) -> int:
    steps = _disk.steps_of(QUICK_SIZES, QUICK_REPEATS, QUICK_ENGINES) + len(QUICK_MODES)
    t0 = time.monotonic()
    with (
        _disk.workdirs(args.dir, None) as (d1, d2),
        progress_bar(steps, not args.no_progress) as step,
    ):
        disk = _disk.sweep(QUICK_SIZES, QUICK_TOTAL, QUICK_REPEATS, QUICK_ENGINES, d1, d2, step)
        report = train.measure(
            [*QUICK_TRAIN, "--modes", ",".join(QUICK_MODES), "--disk-dir", str(d1)], step
        )
    for line in report.warnings:  # the progress bar is gone: nothing to write over
        print(line, file=sys.stderr)
    for r in report.results:
        r["label"] = LABELS[r["mode"]]
    print(headline(disk.results, report, disk.machine.get("raw_limit_tool")))
    print(f"\n(took {time.monotonic() - t0:.0f} s; 'tierstore-bench --full' sweeps every size")
    print(" and path, 'tierstore-bench train --help' sizes the model)")
    if args.json is not None:
        data = {"machine": disk.machine, "disk": disk.results, "train": report.results}
        args.json.write_text(json.dumps(data, indent=2))
        print(f"wrote {args.json}")
    if plot is not None:
        plot_summary(disk.results, report.results, plot, disk.machine)
        print(f"wrote {plot}")
    return 1 if report.wrong else 0


def headline(disk: list[dict[str, Any]], report: train.Report, tool: object = None) -> str:
    """The two answers as two small tables (medians; GB/s is 10**9 bytes per second).

    ``tool``: what measured the raw disk limit (``measure_raw_limit``'s description); the
    text names fio, or the one-request loop that stands in for it.
    """
    by = {(r["engine"], r["op"], r["size_bytes"]): r for r in disk}
    kind = str(tool).split()[0].rstrip(":") if tool else ""
    limit = {"fio": "fio", "loop": "a one-request loop"}.get(kind, "the disk tool")

    def med(engine: str, op: str, size: int) -> float:
        row = by.get((engine, op, size))
        return float(row["gbps_median"]) if row else float("nan")

    lines = [
        f"How fast this store spills and reads back here (GB/s, median of {QUICK_REPEATS};",
        f"{QUICK_TOTAL // MiB} MiB per run, host tier empty; steady state, as in every training",
        f"step after the first: spills reuse space freed before, and the disk limit is {limit}",
        "overwriting its file):",
        f"{'tensor':>8}  {'tierstore':>16}  {'raw disk limit':>16}  {'torch.save/load':>16}"
        f"  {'vs disk':>13}  {'vs torch':>13}",
        f"{'':>8}  {'write   read':>16}  {'write   read':>16}  {'write   read':>16}"
        f"  {'write  read':>13}  {'write  read':>13}",
    ]
    first = []
    for size in QUICK_SIZES:
        ours = med("tierstore-raw-steady", "write", size), med("tierstore-raw-steady", "read", size)
        disk_ = med("raw-limit-overwrite", "write", size), med("raw-limit", "read", size)
        save = med("torch.save", "write", size), med("torch.save", "read", size)
        lines.append(
            f"{size // MiB:>5} MiB  {ours[0]:>7.2f}{ours[1]:>7.2f}  "
            f"{disk_[0]:>9.2f}{disk_[1]:>7.2f}  {save[0]:>9.2f}{save[1]:>7.2f}  "
            f"{ours[0] / disk_[0]:>6.2f}x{ours[1] / disk_[1]:>5.2f}x  "
            f"{ours[0] / save[0]:>6.2f}x{ours[1] / save[1]:>5.2f}x"
        )
        first.append(
            f"{size // MiB} MiB {med('tierstore-raw', 'write', size):.2f} write "
            f"({med('tierstore-raw', 'write', size) / med('raw-limit', 'write', size):.2f}x "
            f"{limit} writing a new file)"
        )
    lines.append("first spill, into new space: " + "; ".join(first))
    if not any(r["engine"].startswith("raw-limit") for r in disk):
        lines.append(
            "(no raw disk limit: this directory refuses O_DIRECT, so the 'vs disk' columns"
            " read nan)"
        )
    if kind == "loop":
        lines += [
            "(the loop keeps one request in flight, as dd, and the store several, so the store",
            " can pass it, reading most of all; with fio installed the limit keeps 16 in flight)",
        ]

    def cpu(engine: str, op: str, size: int) -> str:
        row = by.get((engine, op, size))
        value = row.get("cpu_s_per_gb") if row else None
        return "-" if value is None else f"{value:.3f}"

    for size in QUICK_SIZES:
        lines.append(
            f"CPU seconds per GB at {size // MiB} MiB: tierstore write "
            f"{cpu('tierstore-raw-steady', 'write', size)} read "
            f"{cpu('tierstore-raw-steady', 'read', size)}; the disk tool write "
            f"{cpu('raw-limit-overwrite', 'write', size)} read {cpu('raw-limit', 'read', size)}"
        )
    results = report.results
    base = next((r for r in results if r["mode"] == "none"), None)
    peak, peak_name = peak_measure(results)
    lines += [
        "",
        "What offloading saves in a training step (each mode in its own process; "
        "gradients checked against no offloading):",
        f"{'mode':<28}{'step s':>8}{'x none':>8}{peak_name:>14}{'saved MiB':>11}"
        f"{'offloaded MiB/step':>20}",
    ]
    for r in results:
        ratio = r["step_s_median"] / base["step_s_median"] if base else float("nan")
        saved = (base[peak] - r[peak]) / MiB if base else float("nan")
        off = r.get("offloaded_bytes_per_step", 0) / MiB
        lines.append(
            f"{r.get('label', r['mode']):<28}{r['step_s_median']:>8.2f}{ratio:>8.2f}"
            f"{r[peak] / MiB:>14.0f}{saved:>11.0f}{off:>20.0f}"
        )
    for mode in report.wrong:
        what = report.why.get(mode, "values")
        lines.append(f"{LABELS[mode]:<28}REFUSED: its {what} differ from no offloading")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
