"""The table ``tierstore-bench disk`` prints: each path's throughput and the ratios that matter."""

from __future__ import annotations

from typing import Any

__all__ = ["RATIOS", "Row", "print_table", "size_name"]

Row = dict[str, Any]
"""One result: engine, op, size_bytes, gbps_min, gbps_median, gbps_max, cpu_s_per_gb."""

RATIOS = (
    ("tierstore-raw", "write", "raw-limit"),
    ("tierstore-raw", "read", "raw-limit"),
    ("tierstore-raw-steady", "write", "raw-limit-overwrite"),
    ("tierstore-raw-steady", "read", "raw-limit"),
    ("tierstore-raw", "write", "torch.save"),
    ("tierstore-raw", "read", "torch.save"),
    ("tierstore-raw-steady", "write", "torch.save"),
    ("tierstore-raw-steady", "read", "torch.save"),
    ("raw-engine", "write", "raw-limit"),
    ("raw-engine", "read", "raw-limit"),
)
"""(ours, op, reference) pairs whose median ratios the table ends with. The steady round's
writes compare with fio overwriting its file (Note: [First spill and steady state]); every
torch.save round writes new files, in training as here."""


def size_name(n: int) -> str:
    for unit, factor in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= factor and n % factor == 0:
            return f"{n // factor}{unit}"
    return f"{n}B"


def print_table(
    results: list[Row],
    sizes: list[int],
    machine: dict[str, object],
    summaries: dict[str, str],
) -> None:
    print(
        f"machine: {machine['cpus']} CPUs, {machine['filesystem']}, kernel {machine['kernel']}, "
        f"O_DIRECT {'yes' if machine['o_direct'] else 'no'}"
    )
    print(f"raw limit: {machine['raw_limit_tool'] or 'not measured'}")
    print(f"page cache: {machine['page_cache']}")
    print()
    head = f"{'engine':<26}{'size':>8}  {'write GB/s min/med/max':>24}"
    print(f"{head}  {'read GB/s min/med/max':>24}  {'CPU s/GB write read':>20}")
    by_key = {(r["engine"], r["op"], r["size_bytes"]): r for r in results}
    engines = list(dict.fromkeys(str(r["engine"]) for r in results))
    for size in sizes:
        for name in engines:
            w = by_key.get((name, "write", size))
            r = by_key.get((name, "read", size))
            if w is None and r is None:
                continue
            print(
                f"{name:<26}{size_name(size):>8}  {_triple(w):>24}  {_triple(r):>24}"
                f"  {_cpu(w):>10}{_cpu(r):>10}"
            )
        print()
    for size in sizes:
        lines = []
        for name, op, ref in RATIOS:
            ours = by_key.get((name, op, size))
            other = by_key.get((ref, op, size))
            if ours is not None and other is not None:
                ratio = ours["gbps_median"] / max(other["gbps_median"], 1e-9)
                lines.append(f"{name} {op} = {ratio:.2f}x {ref}")
        if lines:
            print(f"ratios of medians at {size_name(size)}: " + "; ".join(lines))
    cached = machine.get("cached_growth_while_spilling_bytes")
    if isinstance(cached, dict) and cached:
        print(
            "page cache growth while spilling (Cached in /proc/meminfo, median): "
            + ", ".join(f"{k} {v / (1 << 20):+.1f} MiB" for k, v in cached.items())
        )
    per = machine.get("put_get_us_per_tensor")
    if isinstance(per, dict) and per:
        print(
            "write+read per tensor (us, median): " + ", ".join(f"{k} {v}" for k, v in per.items())
        )
    for name, summary in summaries.items():
        print(f"{name} stats (last repeat, both rounds): {summary}")


def _cpu(r: Row | None) -> str:
    value = r.get("cpu_s_per_gb") if r is not None else None
    return "-" if value is None else f"{value:.3f}"


def _triple(r: Row | None) -> str:
    if r is None:
        return "-"
    return f"{r['gbps_min']:.2f}/{r['gbps_median']:.2f}/{r['gbps_max']:.2f}"
