"""Plots of the benchmark's results (matplotlib, the ``plot`` extra)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tierstore.bench.train import peak_measure

__all__ = ["PlotUnavailableError", "plot_disk", "plot_summary", "require_matplotlib"]

Row = dict[str, Any]


class PlotUnavailableError(RuntimeError):
    """A plot was asked for and matplotlib is not installed."""


def require_matplotlib() -> Any:
    """matplotlib's ``pyplot`` on the Agg backend.

    Raises:
        PlotUnavailableError: matplotlib is not installed; the message says how to get it.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise PlotUnavailableError(
            "plotting needs matplotlib: pip install 'tierstore[plot]' (or pass --no-plot)"
        ) from exc
    return plt


def plot_disk(results: list[Row], path: Path, machine: dict[str, object]) -> None:
    """GB/s against tensor size, one line per path, write and read side by side."""
    plt = require_matplotlib()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    _throughput(axes, results)
    fig.suptitle(f"tierstore-bench disk on {machine['cpus']} CPUs, {machine['filesystem']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_summary(disk: list[Row], train: list[Row], path: Path, machine: dict[str, object]) -> None:
    """The default run's picture: disk GB/s per path and size; step time and peak memory."""
    plt = require_matplotlib()
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.5))
    _throughput(axes[:2], disk)
    names = [str(r["label"]) for r in train]
    ys = range(len(names))
    base = next((r for r in train if r["mode"] == "none"), None)
    step = [float(r["step_s_median"]) for r in train]
    axes[2].barh(ys, step, color="tab:blue")
    axes[2].set_title("training step, seconds (median)")
    key, title = peak_measure(train)
    peak = [int(r[key]) / 2**20 for r in train]
    axes[3].barh(ys, peak, color="tab:orange")
    axes[3].set_title(f"{title} (median)")
    for ax in axes[2:]:
        ax.set_yticks(list(ys), names, fontsize=8)
        ax.invert_yaxis()
        ax.grid(True, axis="x", alpha=0.3)
    if base is not None:
        axes[2].axvline(float(base["step_s_median"]), color="grey", ls="--", lw=1)
        axes[3].axvline(int(base[key]) / 2**20, color="grey", ls="--", lw=1)
    fig.suptitle(f"tierstore-bench on {machine['cpus']} CPUs, {machine['filesystem']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _throughput(axes: Any, results: list[Row]) -> None:
    import matplotlib.pyplot as plt

    engines = list(dict.fromkeys(str(r["engine"]) for r in results))
    # More engines than the default cycle's ten colours: two would share one.
    palette = plt.get_cmap("tab20")  # ListedColormap: an int picks its n-th colour
    colour = {name: palette((2 * i) % 20 + (2 * i) // 20 % 2) for i, name in enumerate(engines)}
    for ax, op in zip(axes, ("write", "read"), strict=True):
        for name in engines:
            rows = sorted(
                (r for r in results if r["engine"] == name and r["op"] == op),
                key=lambda r: int(r["size_bytes"]),
            )
            if not rows:
                continue
            xs = [int(r["size_bytes"]) for r in rows]
            med = [float(r["gbps_median"]) for r in rows]
            lo = [float(r["gbps_min"]) for r in rows]
            hi = [float(r["gbps_max"]) for r in rows]
            style = "--" if name.startswith("raw-limit") else "-"
            ax.plot(xs, med, style, marker="o", label=name, color=colour[name])
            ax.fill_between(xs, lo, hi, color=colour[name], alpha=0.15)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tensor size (bytes)")
        ax.set_ylabel("GB/s")
        ax.set_title(f"disk {op} (median, band min-max)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
