"""Two processes under torchrun (gloo, CPU) train with DDP: offloading changes no gradient bit."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which(
    "torchrun"
)


@pytest.mark.slow
@pytest.mark.skipif(TORCHRUN is None, reason="torchrun is not installed")
def test_ddp_two_ranks_offloaded_gradients_equal_plain(tmp_path: Path) -> None:
    assert TORCHRUN is not None
    out = tmp_path / "out"
    spill = tmp_path / "spill"
    spill.mkdir()
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT / "src"),
        "OMP_NUM_THREADS": "1",
    }
    proc = subprocess.run(
        [
            TORCHRUN,
            "--standalone",
            "--nproc_per_node",
            "2",
            str(ROOT / "examples" / "torchrun_ddp.py"),
            "--steps",
            "3",
            "--modes",
            "none,hooks,checkpoint",
            "--out",
            str(out),
            "--disk-dir",
            str(spill),
            "--spill-before-backward",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    reports = [json.loads((out / f"report-rank{r}.json").read_text()) for r in range(2)]
    # Each rank had its own store and its own private spill directory, now removed.
    assert reports[0]["pid"] != reports[1]["pid"]
    dirs = [set(r["spill_dirs"]) for r in reports]
    assert dirs[0] and dirs[1] and not dirs[0] & dirs[1]
    assert list(spill.iterdir()) == []
    for rank in range(2):
        plain = torch.load(out / f"grads-none-rank{rank}.pt", weights_only=True)
        assert len(plain) > 0
        for mode in ("hooks", "checkpoint"):
            assert reports[rank][f"{mode}_bytes_to_disk"] > 0, reports[rank]
            got = torch.load(out / f"grads-{mode}-rank{rank}.pt", weights_only=True)
            assert len(got) == len(plain)
            for i, (a, b) in enumerate(zip(plain, got, strict=True)):
                assert torch.equal(a, b), f"rank {rank} {mode}: gradient {i} differs"
    # DDP all-reduced: both ranks hold the same gradients.
    r0 = torch.load(out / "grads-hooks-rank0.pt", weights_only=True)
    r1 = torch.load(out / "grads-hooks-rank1.pt", weights_only=True)
    assert all(torch.equal(a, b) for a, b in zip(r0, r1, strict=True))
