"""``tierstore-bench train`` runs tiny, every mode, and writes one JSON line per mode."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_bench(
    tmp_path: Path, *extra: str, pythonpath: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    out = tmp_path / "results.jsonl"
    spill = tmp_path / "spill"
    spill.mkdir(exist_ok=True)
    path = os.pathsep.join([*pythonpath, str(ROOT / "src")])
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "tierstore.bench",
            "train",
            "--device",
            "cpu",
            "--layers",
            "1",
            "--dim",
            "32",
            "--heads",
            "2",
            "--seq",
            "64",
            "--batch",
            "2",
            "--vocab",
            "64",
            "--warmup",
            "1",
            "--steps",
            "2",
            "--rounds",
            "1",
            "--threads",
            "1",
            "--min-bytes",
            "4096",
            "--disk-dir",
            str(spill),
            "--json",
            str(out),
            *extra,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_train_step_benchmark_smoke(tmp_path: Path) -> None:
    proc = run_bench(tmp_path)
    out, spill = tmp_path / "results.jsonl", tmp_path / "spill"
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    by_mode = {r["mode"]: r for r in rows}
    assert list(by_mode) == [
        "none",
        "save_on_cpu",
        "torch_ckpt",
        "disk_baseline",
        "ts_host",
        "ts_disk",
        "ts_ckpt",
    ]
    for r in rows:
        assert r["rounds"] == 1 and len(r["step_s"]) == 2 and r["step_s_median"] > 0
        assert r["peak_rss_bytes"] >= r["rss_before_bytes"] > 0
        assert r["saved_activation_bytes"] > 0
    assert len({r["grads_sha256"] for r in rows}) == 1  # every mode checked, all equal
    assert len({r["final_state_sha256"] for r in rows}) == 1  # after the timed steps too
    for mode in ("ts_host", "ts_disk", "ts_ckpt"):
        assert by_mode[mode]["offloaded_bytes_per_step"] > 0, mode
    assert by_mode["ts_disk"]["spilled_tensors_per_step"] > 0
    assert by_mode["ts_host"]["spilled_tensors_per_step"] == 0
    assert by_mode["ts_host"]["bytes_to_disk_per_step"] == 0
    assert "peak RSS MiB" in proc.stdout and "read back MiB/step" in proc.stdout
    assert list(spill.iterdir()) == []


def test_fused_attention_trains_bit_exact_in_every_checkpointing_mode(tmp_path: Path) -> None:
    """``--attention sdpa``: the recomputes of both checkpoints and the disk tier give plain
    training's gradients and final state."""
    proc = run_bench(
        tmp_path, "--attention", "sdpa", "--modes", "torch_ckpt,ts_disk,ts_ckpt", "--seq", "128"
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [r["mode"] for r in rows] == ["none", "torch_ckpt", "ts_disk", "ts_ckpt"]
    assert {r["config"]["attention"] for r in rows} == {"sdpa"}
    assert len({r["grads_sha256"] for r in rows}) == 1
    assert len({r["final_state_sha256"] for r in rows}) == 1
    for r in rows[2:]:
        # Spills started: on a loaded machine a step this small may get a tensor back
        # before its write ends, from host memory.
        assert r["spilled_tensors_per_step"] > 0, r["mode"]


def test_fused_attention_saves_no_attention_map() -> None:
    """What ``sdpa`` is for: at a long sequence no seq x seq tensor is saved for backward
    (the explicit block saves several), and a dropout on attention would bring them back."""
    import pytest
    import torch

    from tierstore.bench._model import Block

    x = torch.randn(1, 256, 32, requires_grad=True)
    shapes: dict[str, list[tuple[int, ...]]] = {}
    for attention in ("explicit", "sdpa"):
        saved: list[tuple[int, ...]] = []

        def pack(t: torch.Tensor, saved: list[tuple[int, ...]] = saved) -> torch.Tensor:
            saved.append(tuple(t.shape))
            return t

        torch.manual_seed(0)
        block = Block(32, 2, 0.1, attention)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            block(x).sum().backward()  # type: ignore[no-untyped-call]
        shapes[attention] = saved
    assert any(s[-2:] == (256, 256) for s in shapes["explicit"])
    assert not any(s[-2:] == (256, 256) for s in shapes["sdpa"])
    with pytest.raises(ValueError, match="attention='flash'"):
        Block(32, 2, 0.0, "flash")


def test_a_mode_with_wrong_gradients_is_refused(tmp_path: Path) -> None:
    """Corrupt what the store gives back (a sitecustomize in the children) and see it refused."""
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(
        "import torch\n"
        "from tierstore.adapters import _storage\n"
        "real = _storage.Saved.tensor\n"
        "def shifted(self):\n"
        "    t = real(self)\n"
        "    return t + 1 if t.is_floating_point() else t\n"
        "_storage.Saved.tensor = shifted\n"
    )
    proc = run_bench(tmp_path, "--modes", "ts_disk,torch_ckpt", pythonpath=(str(inject),))
    assert proc.returncode == 1
    assert "REFUSED ts_disk: its loss and gradients of the checked step and" in proc.stderr
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    # Plain training, the reference, is reported too: the ratios are taken against it.
    assert [r["mode"] for r in rows] == ["none", "torch_ckpt"]
    assert "ts_disk" not in proc.stdout and "nan" not in proc.stdout


def test_a_workers_warnings_reach_the_caller(tmp_path: Path) -> None:
    """They say what the figures mean (nothing offloaded here); a worker that succeeded had
    its stderr dropped."""
    proc = run_bench(tmp_path, "--modes", "ts_disk", "--min-bytes", "1GiB", "--rounds", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    warned = [x for x in proc.stderr.splitlines() if "stored nothing" in x]
    assert len(warned) == 1 and warned[0].startswith("[ts_disk] ")  # once over the rounds
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [(r["mode"], r["config"]["rounds"]) for r in rows] == [("none", 2), ("ts_disk", 2)]


def test_a_mode_wrong_only_in_the_timed_steps_is_refused(tmp_path: Path) -> None:
    """Corrupt what the store gives back from the second backward on: the checked step is
    right, the timed steps are not, and the digest of the final state sees it."""
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(
        "import torch\n"
        "from tierstore.adapters import _storage\n"
        "backwards = [0]\n"
        "real_backward = torch.Tensor.backward\n"
        "def counted(self, *a, **k):\n"
        "    backwards[0] += 1\n"
        "    return real_backward(self, *a, **k)\n"
        "torch.Tensor.backward = counted\n"
        "real = _storage.Saved.tensor\n"
        "def shifted(self):\n"
        "    t = real(self)\n"
        "    return t + 1 if backwards[0] > 1 and t.is_floating_point() else t\n"
        "_storage.Saved.tensor = shifted\n"
    )
    proc = run_bench(tmp_path, "--modes", "ts_host,torch_ckpt", pythonpath=(str(inject),))
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert (
        "REFUSED ts_host: its weights and optimizer state after the timed steps differ"
        in proc.stderr
    )
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [r["mode"] for r in rows] == ["none", "torch_ckpt"]


def test_plain_training_that_is_not_deterministic_stops_the_run(tmp_path: Path) -> None:
    """Seeds drawn at random in every child: two rounds of plain training disagree, and no
    mode can be checked against them."""
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(
        "import os, torch\n"
        "real = torch.manual_seed\n"
        "torch.manual_seed = lambda seed: real(int.from_bytes(os.urandom(4), 'little'))\n"
    )
    proc = run_bench(tmp_path, "--modes", "none", "--rounds", "2", pythonpath=(str(inject),))
    assert proc.returncode != 0
    assert "plain training gave 2 different grads_sha256 over 2 rounds" in proc.stderr


MiB = 1 << 20


def row(mode: str, peak_mib: int, offloaded_mib: int = 0, **mib: int) -> dict[str, object]:
    """A result of ``table``'s input: ``peak_mib`` of RSS, and any other byte field in MiB."""
    return {
        "mode": mode,
        "step_s_median": 1.0,
        "cpu_s_median": 1.0,
        "peak_rss_bytes": peak_mib * MiB,
        "offloaded_bytes_per_step": offloaded_mib * MiB,
        **{key: n * MiB for key, n in mib.items()},
    }


def test_the_offloaded_checkpoint_saves_against_torchs_checkpoint() -> None:
    from tierstore.bench.train import table

    text = table(
        [
            row("none", 1000),
            row("torch_ckpt", 500),
            row("ts_disk", 600, 500, bytes_from_disk_per_step=480),
            row("ts_ckpt", 468, 64, bytes_from_disk_per_step=64),
        ]
    )
    lines = {line.split()[0]: line for line in text.splitlines()[2:]}
    assert lines["ts_disk"].endswith("80%")  # (1000 - 600) / 500
    assert lines["ts_ckpt"].endswith("50%")  # (500 - 468) / 64, not (1000 - 468) / 64
    assert lines["torch_ckpt"].endswith("-")
    assert lines["ts_disk"].split()[-2:] == ["480", "80%"]  # read back from disk
    assert lines["torch_ckpt"].split()[-2:] == ["-", "-"]


def test_on_a_gpu_the_table_measures_the_gpus_peak() -> None:
    from tierstore.bench.train import FORWARD_PEAK, GPU_PEAK, table

    # Offloading to the host raises the RSS and lowers the GPU's peak: the GPU's is the saving.
    text = table(
        [row("none", 2000, **{GPU_PEAK: 1000}), row("ts_host", 2900, 800, **{GPU_PEAK: 200})]
    )
    assert "peak GPU MiB" in text.splitlines()[0] and "fwd GPU" not in text
    lines = {line.split()[0]: line for line in text.splitlines()[2:]}
    assert lines["ts_host"].split()[5:7] == ["200", "-800"]
    assert lines["ts_host"].endswith("100%")  # (1000 - 200) / 800

    # The optimizer's step can set the step's peak in every mode: the forward's shows the saving.
    rows = [
        row("torch_ckpt", 1200, **{GPU_PEAK: 2768, FORWARD_PEAK: 2276}),
        row("ts_ckpt", 1900, 128, **{GPU_PEAK: 2768, FORWARD_PEAK: 2164}),
    ]
    text = table(rows)
    assert "fwd GPU MiB" in text.splitlines()[0]
    assert text.splitlines()[3].split()[7] == "2164"


def test_combine_takes_the_median_of_every_rounds_figure_and_records_the_run() -> None:
    """Offloaded bytes, waits and the store's peaks were the last round's alone, and every
    result's recorded configuration said ``rounds: 1, busy: False`` (the options the
    workers are not given)."""
    from tierstore.bench.train import combine

    def worker(step: float, offloaded: int, wait: float) -> dict[str, object]:
        return {
            "step_s": [step, step],
            "cpu_s": [step, step],
            "peak_rss_bytes": offloaded,
            "offloaded_bytes_per_step": offloaded,
            "get_wait_s_per_step": wait,
            "store_host_peak_bytes": offloaded,
            "config": {"rounds": 1, "busy": False, "layers": 8},
        }

    rounds = [worker(1.0, 100, 0.5), worker(3.0, 300, 0.1), worker(2.0, 900, 0.2)]
    result = combine(rounds, rounds=3, busy=True)
    assert result["step_s_median"] == 2.0 and result["rounds"] == 3
    assert result["offloaded_bytes_per_step"] == 300
    assert result["offloaded_bytes_per_step_rounds"] == [100, 300, 900]
    assert result["get_wait_s_per_step"] == 0.2
    assert result["store_host_peak_bytes"] == 300
    assert result["config"] == {"rounds": 3, "busy": True, "layers": 8}
