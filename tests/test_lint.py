"""ruff and mypy --strict are part of the test suite, so CI enforces them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TYPED_AGAINST = "2.13"
"""The torch whose type stubs the code is checked against: the one README.md's commands pin."""


MYPY = pytest.StashKey["subprocess.Popen[str]"]()
"""The mypy run started beside the other tests, where this session started one."""


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, check=False
    )


def start_mypy(config: pytest.Config) -> None:
    """Start mypy now, at the lowest CPU priority, for test_mypy_strict_is_clean to collect.

    mypy takes half a minute of one core and most tests keep only one of the machine's cores
    busy, so it runs beside them instead of adding its time to the suite's (tests/conftest.py
    calls this once collection has picked the test).
    """
    if not _typed_against_this_torch():
        return
    proc = subprocess.Popen(
        [sys.executable, "-m", "mypy"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    os.setpriority(os.PRIO_PROCESS, proc.pid, 19)
    config.stash[MYPY] = proc

    def stop() -> None:  # the session ended before the test collected it
        if proc.poll() is None:
            proc.kill()
        proc.communicate()

    config.add_cleanup(stop)


def _typed_against_this_torch() -> bool:
    import torch

    return bool(torch.__version__ >= TYPED_AGAINST)


def test_ruff_is_clean() -> None:
    proc = _run("ruff", "check", "src", "tests", "benchmarks", "examples")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_mypy_strict_is_clean(pytestconfig: pytest.Config) -> None:
    import torch

    if not _typed_against_this_torch():
        # The package runs on older torches (README.md); their stubs type some calls otherwise.
        pytest.skip(
            f"the annotations follow torch {TYPED_AGAINST}'s stubs, not {torch.__version__}'s"
        )
    started = pytestconfig.stash.get(MYPY, None)
    if started is None:
        proc = _run("mypy")
        returncode, output = proc.returncode, proc.stdout + proc.stderr
    else:
        output, _ = started.communicate(timeout=600)
        returncode = started.returncode
    assert returncode == 0, output


def test_ruff_format_leaves_the_code_as_it_is() -> None:
    proc = _run("ruff", "format", "--check", "src", "tests", "benchmarks", "examples")
    assert proc.returncode == 0, proc.stdout + proc.stderr
