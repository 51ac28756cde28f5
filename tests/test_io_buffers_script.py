"""benchmarks/io_buffers.py runs tiny, verifies what it wrote, and refuses a bad chunk size."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "io_buffers.py"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_every_memory_kind_is_measured_and_the_bytes_come_back(tmp_path: Path) -> None:
    proc = _run(
        "--dir", str(tmp_path), "--size", "2MiB", "--chunk", "256KiB", "--threads", "2",
        "--repeats", "2",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = re.findall(r"^(write|read)\s+(\S+)\s+([\d.]+) / ([\d.]+) / ([\d.]+)$", proc.stdout, re.M)
    kinds = [(op, kind) for op, kind, *_ in rows]
    assert kinds == [
        ("write", "huge"),
        ("write", "4k-one-thread"),
        ("write", "4k-io-threads"),
        ("write", "bounce"),
        ("write", "lead"),
        ("read", "huge"),
        ("read", "4k-one-thread"),
        ("read", "4k-io-threads"),
    ]
    for *_, lo, med, hi in rows:
        assert 0 < float(lo) <= float(med) <= float(hi)
    assert "verified: the file read back equals" in proc.stdout
    assert list(tmp_path.iterdir()) == []  # its file is gone


def test_a_chunk_that_does_not_divide_the_size_is_refused_by_name(tmp_path: Path) -> None:
    proc = _run("--dir", str(tmp_path), "--size", "1MiB", "--chunk", "768KiB")
    assert proc.returncode == 2
    assert "--chunk 786432" in proc.stderr and "--size 1048576" in proc.stderr
