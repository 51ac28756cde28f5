"""ruff and mypy --strict are part of the test suite, so CI enforces them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TYPED_AGAINST = "2.13"
"""The torch whose type stubs the code is checked against: the one README.md's commands pin."""


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, check=False
    )


def test_ruff_is_clean() -> None:
    proc = _run("ruff", "check", "src", "tests", "benchmarks", "examples")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_mypy_strict_is_clean() -> None:
    import torch

    if torch.__version__ < TYPED_AGAINST:
        # The package runs on older torches (README.md); their stubs type some calls otherwise.
        pytest.skip(
            f"the annotations follow torch {TYPED_AGAINST}'s stubs, not {torch.__version__}'s"
        )
    proc = _run("mypy")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_ruff_format_leaves_the_code_as_it_is() -> None:
    proc = _run("ruff", "format", "--check", "src", "tests", "benchmarks", "examples")
    assert proc.returncode == 0, proc.stdout + proc.stderr
