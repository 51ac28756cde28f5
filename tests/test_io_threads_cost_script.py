"""benchmarks/io_threads_cost.py runs tiny, checks what it wrote, and refuses bad sizes by name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from scripts import main_of_benchmark, run_benchmark
from tierstore.tiers.raw import probe_direct_io


def test_each_size_and_direction_is_measured_three_ways_and_the_blocks_come_back(
    tmp_path: Path,
) -> None:
    if not probe_direct_io(tmp_path).supported:
        pytest.skip(f"no O_DIRECT in {tmp_path}")
    proc = run_benchmark(
        "io_threads_cost.py", "--dir", str(tmp_path), "--sizes", "64KiB,256KiB", "--total", "1MiB",
        "--threads", "3", "--rounds", "2",
    )  # fmt: skip
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
        main_of_benchmark("io_threads_cost.py")(["--dir", str(tmp_path), *args])
    assert exit_.value.code == 2
    assert named in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
