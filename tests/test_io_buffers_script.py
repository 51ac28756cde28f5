"""benchmarks/io_buffers.py runs tiny, verifies what it wrote, and refuses a bad chunk size."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from scripts import main_of_benchmark, run_benchmark


def test_every_memory_kind_is_measured_and_the_bytes_come_back(tmp_path: Path) -> None:
    proc = run_benchmark(
        "io_buffers.py", "--dir", str(tmp_path), "--size", "2MiB", "--chunk", "256KiB",
        "--threads", "2", "--repeats", "2",
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


def test_a_chunk_that_does_not_divide_the_size_is_refused_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--dir", str(tmp_path), "--size", "1MiB", "--chunk", "768KiB"]
    with pytest.raises(SystemExit) as exit_:
        main_of_benchmark("io_buffers.py")(args)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--chunk 786432" in err and "--size 1048576" in err
