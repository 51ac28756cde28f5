"""The runnable examples of docs/adapters.md run (tiny sizes) and do what they say."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _adapters_util import fully_shard_is_public, skip_unless_compile_traces_without_hooks

from optional_modules import importorskip_transformers

ROOT = Path(__file__).resolve().parents[2]


def run_example(name: str, *args: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    spill = tmp_path / "spill"
    spill.mkdir(exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), *args, "--disk-dir", str(spill)],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert list(spill.iterdir()) == []  # the spill directory is gone after close
    return proc


def losses(proc: subprocess.CompletedProcess[str]) -> list[str]:
    """The exact loss of every step, as the example printed it (``repr`` of a float)."""
    found = [ln.split("loss ")[1].split(";")[0] for ln in proc.stdout.splitlines() if "loss " in ln]
    assert found, proc.stdout
    return found


@pytest.mark.parametrize("mode", ["hooks", "checkpoint"])
def test_plain_loop_example(tmp_path: Path, mode: str) -> None:
    # 1.2 MiB layer inputs, 4.7 MiB hidden activations: the chunked path, not only packs.
    sizes = ["--dim", "256", "--batch", "4", "--seq", "300", "--layers", "2"]
    run = ["plain_loop.py", "--steps", "3", "--mode", mode, *sizes]
    proc = run_example(*run, "--host-bytes", "100KiB", tmp_path=tmp_path)
    plain = run_example(*run, "--no-offload", tmp_path=tmp_path)
    assert losses(proc) == losses(plain)
    # The summary logged at close shows tensors really spilled to disk.
    summary = [ln for ln in proc.stderr.splitlines() if ln.startswith("tierstore INFO")]
    assert summary and "disk 0 " not in summary[-1], proc.stderr


def test_hf_trainer_example(tmp_path: Path) -> None:
    importorskip_transformers()
    run = ["hf_trainer.py", "--output-dir", str(tmp_path / "out"), "--steps", "2"]
    proc = run_example(*run, tmp_path=tmp_path)
    plain = run_example(*run, "--no-offload", tmp_path=tmp_path)
    assert losses(proc) == losses(plain)
    assert len(losses(proc)) == 2
    logged = [ln for ln in proc.stdout.splitlines() if "'loss'" in ln]
    assert len(logged) == 2 and all("'tierstore/disk_gib'" in ln for ln in logged), proc.stdout
    # The callback's line per optimizer step, on the tierstore logger: everything went to disk.
    steps = [ln for ln in proc.stderr.splitlines() if "tierstore: step " in ln]
    assert [ln.split("tierstore: step ")[1].split()[0] for ln in steps] == ["1", "2"], proc.stderr
    for ln in steps:
        assert ln.startswith("tierstore INFO tierstore: step ") and " offloaded " in ln, ln
        assert "(host 0.0, disk " in ln, ln
        assert "peak off-device " in ln and "backward waited " in ln and "skipped " in ln, ln
    line = [ln for ln in proc.stdout.splitlines() if "layer inputs stored" in ln][-1]
    stored, written, held = (int(w) for w in line.split() if w.isdigit())
    assert stored > 0 and written > 2 * 2**20 and held == 0


# -- FSDP2 under torchrun, and torch.compile: against the same run without tierstore ---------
# Their --mode checkpoint paths are the ones test_fsdp2.py and test_compile.py check gradient
# by gradient; each launch here costs seconds (two ranks importing torch, or a compile).

TORCHRUN = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which(
    "torchrun"
)


GLOO_EXIT_ABORT = "terminate called without an active exception"


def run_torchrun_example(name: str, *args: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """``name`` on two ranks under torchrun; its spill directories are gone afterwards."""
    assert TORCHRUN is not None
    spill = tmp_path / "spill"
    spill.mkdir(exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    example = [str(ROOT / "examples" / name), *args, "--disk-dir", str(spill)]
    for _ in range(2):
        proc = subprocess.run(
            [TORCHRUN, "--standalone", "--nproc_per_node", "2", *example],
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
        # Gloo now and then aborts a rank at exit, after its work is done, with or without
        # tierstore (the example's own comment at its barrier): that run is tried once more.
        if proc.returncode == 0 or GLOO_EXIT_ABORT not in proc.stderr:
            break
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert list(spill.iterdir()) == []
    return proc


# What torch itself says about the machine, not about the program: a CUDA build of torch on a
# machine without a GPU warns so when Inductor first compiles.
TORCH_ABOUT_THE_MACHINE = ("No CUDA runtime is found, using CUDA_HOME",)


def spilled_to_disk(proc: subprocess.CompletedProcess[str], stores: int) -> None:
    """Every store's summary (logged at close) shows tensors written to disk, and stderr holds
    nothing else: no warning, no "Exception ignored"."""
    lines = [
        ln for ln in proc.stderr.splitlines() if not any(m in ln for m in TORCH_ABOUT_THE_MACHINE)
    ]
    summaries = [ln for ln in lines if ln.startswith("tierstore INFO")]
    assert len(summaries) == stores and all("disk 0 " not in s for s in summaries), proc.stderr
    assert len(lines) == stores, proc.stderr


@pytest.mark.slow
@pytest.mark.skipif(TORCHRUN is None, reason="torchrun is not installed")
def test_fsdp2_torchrun_example(tmp_path: Path) -> None:
    if not fully_shard_is_public():  # the example imports it from there
        pytest.skip(f"torch {torch.__version__} has no public FSDP2 (fully_shard)")
    # host_bytes=0: everything stored (4 MiB attention maps among it) goes to disk, both ranks.
    run = ["fsdp2_torchrun.py", "--steps", "2"]
    proc = run_torchrun_example(*run, "--host-bytes", "0", tmp_path=tmp_path)
    plain = run_torchrun_example(*run, "--no-offload", tmp_path=tmp_path)
    assert losses(proc) == losses(plain)
    assert [len(line.split()) for line in losses(proc)] == [2, 2]  # both ranks, each step
    spilled_to_disk(proc, stores=2)


@pytest.mark.slow
def test_compiled_example(tmp_path: Path) -> None:
    skip_unless_compile_traces_without_hooks()
    # Inductor, the example's default, on the model and sizes test_compile.py compiles too
    # (4 MiB hidden activations), so the kernels are compiled once. All of it to disk.
    run = ["compiled.py", "--steps", "2"]
    proc = run_example(*run, "--host-bytes", "0", tmp_path=tmp_path)
    plain = run_example(*run, "--no-offload", tmp_path=tmp_path)
    assert losses(proc) == losses(plain)
    assert len(losses(proc)) == 2
    spilled_to_disk(proc, stores=1)
