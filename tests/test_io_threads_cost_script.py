"""benchmarks/io_threads_cost.py runs tiny, checks what it wrote, and refuses bad sizes by name."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tierstore.tiers.raw import probe_direct_io

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "io_threads_cost.py"


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


def test_each_size_and_direction_is_measured_three_ways_and_the_blocks_come_back(
    tmp_path: Path,
) -> None:
    if not probe_direct_io(tmp_path).supported:
        pytest.skip(f"no O_DIRECT in {tmp_path}")
    proc = _run("--dir", str(tmp_path), "--sizes", "64KiB,256KiB", "--total", "1MiB",
                "--threads", "3", "--rounds", "2")  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = re.findall(r"^\s*(\d+) KiB\s+(write|read)\s+((?:[\d.]+\s+){6})\(round (\d)\)$",
                      proc.stdout, re.M)  # fmt: skip
    assert [(kib, op, r) for kib, op, _, r in rows] == [
        (kib, op, r) for r in "12" for kib in ("64", "256") for op in ("write", "read")
    ]
    for *_, cells, _ in rows:
        numbers = [float(x) for x in cells.split()]
        assert all(x > 0 for x in numbers[::2]), cells  # every path moved bytes
    assert "pool x3" in proc.stdout
    assert "verified: every 262144-byte block read back as the pool wrote it" in proc.stdout
    assert list(tmp_path.iterdir()) == []  # its file is gone


def _main_of_script() -> Callable[[list[str]], int]:
    spec = importlib.util.spec_from_file_location("io_threads_cost", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    main: Callable[[list[str]], int] = module.main
    return main


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--sizes", "3000"], "--sizes [3000]"),
        (["--sizes", "64KiB", "--total", "100KiB"], "--total 102400"),
        (["--sizes", "lots"], "--sizes='lots'"),
    ],
)
def test_a_bad_size_is_refused_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], named: str
) -> None:
    with pytest.raises(SystemExit) as exit_:
        _main_of_script()(["--dir", str(tmp_path), *args])
    assert exit_.value.code == 2
    assert named in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
