"""ruff and mypy --strict are part of the test suite, so CI enforces them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, check=False
    )


def test_ruff_is_clean() -> None:
    proc = _run("ruff", "check", "src", "tests", "benchmarks", "examples")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_mypy_strict_is_clean() -> None:
    proc = _run("mypy")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_ruff_format_leaves_the_code_as_it_is() -> None:
    proc = _run("ruff", "format", "--check", "src", "tests", "benchmarks", "examples")
    assert proc.returncode == 0, proc.stdout + proc.stderr
