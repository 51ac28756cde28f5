"""Running the scripts of benchmarks/ as a user does, against this checkout's package.

This folder is on ``sys.path`` (its conftest.py puts it there), so tests in every subfolder
import this module by its name.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_benchmark(name: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``python benchmarks/<name> *args`` with ``src`` on the path; its output captured."""
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / name), *args],
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def main_of_benchmark(name: str) -> Callable[[list[str]], object]:
    """The ``main`` of ``benchmarks/<name>``, loaded in this process (seconds cheaper than a
    process that imports torch, for checks that never reach the measuring)."""
    spec = importlib.util.spec_from_file_location(Path(name).stem, ROOT / "benchmarks" / name)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    main: Callable[[list[str]], object] = module.main
    return main
