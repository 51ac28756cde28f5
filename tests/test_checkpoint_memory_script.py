"""benchmarks/checkpoint_memory.py runs tiny, compares gradients, shows where a step peaks."""

from __future__ import annotations

from pathlib import Path

from scripts import run_benchmark


def test_both_modes_report_every_block_and_identical_gradients(tmp_path: Path) -> None:
    proc = run_benchmark(
        "checkpoint_memory.py", "--layers", "3", "--dim", "256", "--heads", "4", "--seq", "256",
        "--batch", "4", "--steps", "2", "--disk-dir", str(tmp_path), timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("block input 1 MiB")  # offloaded: at least min_bytes
    assert lines[1].split() == ["mode", "f1", "f2", "f3", "b3", "b2", "b1", "peak"]
    assert [line.split()[0] for line in lines[2:4]] == ["torch_ckpt", "ts_ckpt"]
    assert all(len(line.split()) == 8 for line in lines[2:4])
    assert lines[-1] == "gradients: identical"
