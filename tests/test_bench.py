"""Smoke test: the benchmark runs tiny, end to end, and writes the promised JSON schema."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"


def test_bench_runs_tiny_and_writes_the_json_schema(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    env = {k: v for k, v in env.items() if not k.startswith("TIERSTORE_")}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tierstore.bench",
            "--sizes",
            "64KiB,1MiB",
            "--total",
            "4MiB",
            "--repeats",
            "2",
            "--dir",
            str(tmp_path),
            "--json",
            str(out),
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    data = json.loads(out.read_text())
    assert set(data) == {"machine", "results"}
    assert isinstance(data["machine"], dict)
    engines = {r["engine"] for r in data["results"]}
    assert {
        "raw-limit",
        "tierstore-raw",
        "tierstore-raw-2dirs",
        "tierstore-zarr",
        "torch.save",
        "aiofiles",
    } <= engines
    for r in data["results"]:
        assert set(r) == {"engine", "op", "size_bytes", "gbps_min", "gbps_median", "gbps_max"}
        assert r["op"] in {"write", "read"}
        assert r["size_bytes"] in {64 << 10, 1 << 20}
        assert 0 < r["gbps_min"] <= r["gbps_median"] <= r["gbps_max"]
    pairs = {(r["engine"], r["op"], r["size_bytes"]) for r in data["results"]}
    assert len(pairs) == len(data["results"])  # one row per engine, op and size
    assert "tierstore-raw" in done.stdout and "GB/s" in done.stdout
    assert "page cache" in done.stdout
    # Nothing left behind in the directory the benchmark ran in.
    assert [p.name for p in tmp_path.iterdir()] == ["bench.json"]


def test_raw_limit_falls_back_to_dd_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tierstore.bench import _system
    from tierstore.tiers._raw import probe_direct_io

    if not probe_direct_io(tmp_path).supported:
        pytest.skip(f"{tmp_path} refuses O_DIRECT, which dd's fallback needs")
    monkeypatch.setattr(_system.shutil, "which", lambda name: None)
    limit = _system.measure_raw_limit(tmp_path, 4 << 20)
    assert limit.tool.startswith("dd") and "fio not installed" in limit.tool
    assert limit.write_gbps > 0 and limit.read_gbps > 0
    assert list(tmp_path.iterdir()) == []
