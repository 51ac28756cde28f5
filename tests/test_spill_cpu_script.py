"""benchmarks/spill_cpu.py runs tiny, checks what it reads back, and refuses bad sizes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from scripts import main_of_benchmark, run_benchmark


def test_every_round_is_measured_and_its_tensors_come_back(tmp_path: Path) -> None:
    proc = run_benchmark(
        "spill_cpu.py", "--dir", str(tmp_path), "--size", "3MiB", "--count", "3",
        "--rounds", "3",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rounds = re.findall(r"^round (\d): write ([\d.]+) GB/s [\d.]+ CPU-s/GB \| read ([\d.]+) GB/s",
                        proc.stdout, re.M)  # fmt: skip
    assert [r for r, *_ in rounds] == ["0", "1", "2"]
    assert all(float(w) > 0 and float(r) > 0 for _, w, r in rounds)
    assert "steady write CPU-s/GB" in proc.stdout and "of 2)" in proc.stdout
    by_thread = (
        r"^steady write CPU-s/GB by thread \(totals of 2 rounds\): "
        r"caller [\d.]+, loop [\d.]+, I/O threads [\d.]+, other [\d.]+$"
    )
    split = re.search(by_thread, proc.stdout, re.M)
    assert split is not None, proc.stdout
    assert list(tmp_path.iterdir()) == []  # the store's directory is gone


def test_a_bad_size_is_refused_by_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main_of_benchmark("spill_cpu.py")(["--dir", str(tmp_path), "--size", "lots"])
    assert exit_.value.code == 2
    assert "--size='lots'" in capsys.readouterr().err
