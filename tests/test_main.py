"""``python -m tierstore info`` reports the configuration and what it detected."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def _run(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("TIERSTORE_")}
    return subprocess.run(
        [sys.executable, "-m", "tierstore", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**base, "PYTHONPATH": str(SRC), **env},
    )


def test_info_reports_each_spill_directory(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    done = _run(
        "info",
        "--json",
        env={"TIERSTORE_DISK_DIR": f"{a}{os.pathsep}{b}", "TIERSTORE_IO_THREADS": "3"},
    )
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    assert info["config"]["io_threads"] == 3
    assert [d["path"] for d in info["disk_dirs"]] == [str(a), str(b)]
    for d in info["disk_dirs"]:
        assert d["free_bytes"] > 0 and isinstance(d["o_direct"], bool)
    assert info["cuda"]["available"] in (True, False)
    assert {"python", "torch", "zarr", "numpy"} <= set(info["versions"])
    assert list(a.iterdir()) == [] and list(b.iterdir()) == []  # the probe cleaned up

    text = _run("info", env={"TIERSTORE_DISK_DIR": str(a)})
    assert text.returncode == 0, text.stderr
    assert f"spill directory {a}:" in text.stdout and "O_DIRECT" in text.stdout
    assert "CUDA available:" in text.stdout and "torch" in text.stdout


def test_info_names_a_bad_variable() -> None:
    done = _run("info", env={"TIERSTORE_IO_THREADS": "lots"})
    assert done.returncode == 2
    assert "TIERSTORE_IO_THREADS" in done.stderr
