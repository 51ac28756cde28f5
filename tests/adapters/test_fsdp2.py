"""FSDP2 and tensor parallelism on two CPU ranks (gloo): offloading changes no gradient bit; each
rank's default host tier is its share of the machine.

``fsdp2_worker.py`` does the training; see its docstring for the models and sizes. Every
store there has ``host_bytes=0``, so all that is stored is written to disk and read back.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _adapters_util import fully_shard_is_public

ROOT = Path(__file__).resolve().parents[2]


pytestmark = [
    pytest.mark.skipif(
        not torch.distributed.is_available(), reason="torch.distributed is not available"
    ),
    pytest.mark.skipif(
        torch.distributed.is_available() and not fully_shard_is_public(),
        reason=f"torch {torch.__version__} has no public FSDP2 (fsdp.fully_shard)",
    ),
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, object]]]:
    tmp = tmp_path_factory.mktemp("fsdp2")
    out, spill = tmp / "out", tmp / "spill"
    spill.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    worker = Path(__file__).parent / "fsdp2_worker.py"
    proc = subprocess.run(
        [sys.executable, str(worker), "--out", str(out), "--disk-dir", str(spill), "--steps", "2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Warning" not in proc.stderr, proc.stderr[-3000:]
    assert list(spill.iterdir()) == []  # each rank's spill directory is gone after close
    reports = [json.loads((out / f"report-rank{r}.json").read_text()) for r in range(2)]
    return out, reports


def _assert_same_grads(out: Path, kind: str, mode: str, rank: int) -> None:
    plain = torch.load(out / f"{kind}-none-rank{rank}.pt", weights_only=True)
    got = torch.load(out / f"{kind}-{mode}-rank{rank}.pt", weights_only=True)
    assert len(plain) == len(got) > 0
    for i, (a, b) in enumerate(zip(plain, got, strict=True)):
        assert torch.equal(a, b), f"rank {rank} {kind} {mode}: gradient {i} differs"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["hooks", "checkpoint"])
def test_fsdp2_offloaded_gradients_equal_plain(
    trained: tuple[Path, list[dict[str, object]]], mode: str
) -> None:
    out, reports = trained
    for rank in range(2):
        _assert_same_grads(out, "fsdp2", mode, rank)
        # 2 steps: hooks store every activation (4 MiB attention maps among them),
        # checkpoint each block's 512 KiB input; all of it went to disk.
        least = 2 * (4 << 20) if mode == "hooks" else 2 * 2 * (512 << 10)
        assert reports[rank][f"fsdp2-{mode}"] >= least


@pytest.mark.slow
def test_dtensor_activations_are_offloaded_and_rebuilt_exactly(
    trained: tuple[Path, list[dict[str, object]]],
) -> None:
    out, reports = trained
    for rank in range(2):
        _assert_same_grads(out, "tp", "hooks", rank)
        report = reports[rank]
        # Every DTensor activation (2 MiB shards) and the row-wise layer's pending collective
        # result went to disk, none was left in place as unsupported: per step, x (1 MiB),
        # gelu's and the probe's inputs and fc2's transposed input (2 MiB shards each) and
        # the output (1 MiB).
        assert report["tp-hooks-unsupported"] == 0
        assert report["tp-hooks"] == 2 * (8 << 20)
        # What backward got back: a DTensor on the same mesh, with the same placements,
        # global shape and stride, and the same bytes in its shard.
        probes = report["tp-hooks-probe"]
        assert isinstance(probes, list) and len(probes) == 2
        for probe in probes:
            assert probe["got"]["type"] == "DTensor"
            assert probe["got"] == probe["expected"]


@pytest.mark.slow
def test_a_saved_dtensor_written_in_place_is_caught_and_never_stale(
    trained: tuple[Path, list[dict[str, object]]],
) -> None:
    # DTensor's in-place operations bump the DTensor's version and not its shard's: the
    # graph that saved it raises as autograd does, and saving it again stores the new bytes
    # rather than finding the old entry of the same storage.
    _, reports = trained
    for report in reports:
        assert report["in-place"] == {"second_save_has_new_bytes": True, "first_graph_raises": True}


@pytest.mark.parametrize(("value", "share"), [("8", 8), ("2", 2), (None, 1), ("0", 1), ("x", 1)])
def test_each_local_rank_defaults_to_its_share_of_the_host_tier(
    monkeypatch: pytest.MonkeyPatch, value: str | None, share: int
) -> None:
    # torchrun sets LOCAL_WORLD_SIZE; every rank opens its own store, and the quarter of
    # memory that is the default host tier is split between them.
    from tierstore.config import StoreConfig, _physical_memory_bytes

    if value is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", value)
    assert StoreConfig.from_env({}).host_bytes == _physical_memory_bytes() // 4 // share
    # An explicit size is what it says.
    assert StoreConfig.from_env({}, host_bytes="1GiB").host_bytes == 1 << 30


def test_info_shows_the_per_rank_host_tier(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from tierstore.__main__ import main
    from tierstore.config import _physical_memory_bytes

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.delenv("TIERSTORE_HOST_BYTES", raising=False)
    assert main(["info", "--json"]) == 0
    facts = json.loads(capsys.readouterr().out)
    share = _physical_memory_bytes() // 4 // 4
    assert facts["host_default"]["local_world_size"] == 4
    assert facts["config"]["host_bytes"] == facts["host_default"]["host_bytes"] == share
    assert main(["info"]) == 0
    assert "/ 4 ranks on this machine (LOCAL_WORLD_SIZE)" in capsys.readouterr().out
