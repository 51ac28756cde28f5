"""Smoke test: the benchmark runs tiny, end to end, and writes the promised JSON schema."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from scripts import run_benchmark

SRC = Path(__file__).resolve().parents[2] / "src"


def test_bench_runs_tiny_and_writes_the_json_schema(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    env = {k: v for k, v in env.items() if not k.startswith("TIERSTORE_")}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tierstore.bench",
            "disk",
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
        "raw-limit-overwrite",
        "tierstore-raw",
        "tierstore-raw-steady",
        "tierstore-raw-2dirs",
        "tierstore-raw-2dirs-steady",
        "tierstore-zarr",
        "torch.save",
        "aiofiles",
    } <= engines
    for r in data["results"]:
        assert set(r) == {
            "engine",
            "op",
            "size_bytes",
            "gbps_min",
            "gbps_median",
            "gbps_max",
            "cpu_s_per_gb",
        }
        # Every path reports its CPU per GB; the raw limit's first write has none of its own.
        if (r["engine"], r["op"]) != ("raw-limit", "write"):
            assert r["cpu_s_per_gb"] is not None and r["cpu_s_per_gb"] >= 0, r
        assert r["op"] in {"write", "read"}
        # Overwriting is a write-only figure: reads have one limit.
        assert r["engine"] != "raw-limit-overwrite" or r["op"] == "write"
        assert r["size_bytes"] in {64 << 10, 1 << 20}
        assert 0 < r["gbps_min"] <= r["gbps_median"] <= r["gbps_max"]
    pairs = {(r["engine"], r["op"], r["size_bytes"]) for r in data["results"]}
    assert len(pairs) == len(data["results"])  # one row per engine, op and size
    assert "tierstore-raw" in done.stdout and "GB/s" in done.stdout
    assert "tierstore-raw-steady write = " in done.stdout and "x raw-limit-overwrite" in done.stdout
    assert "page cache" in done.stdout
    # One stats line per store path and size, each naming its size.
    for path in ("tierstore-raw", "tierstore-raw-2dirs", "tierstore-zarr"):
        for size in ("64KiB", "1MiB"):
            assert f"\n{path} {size} stats (last repeat, both rounds): tierstore:" in done.stdout
    # Nothing left behind in the directory the benchmark ran in.
    assert [p.name for p in tmp_path.iterdir()] == ["bench.json"]


def test_raw_limit_falls_back_to_a_one_request_loop_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tierstore.bench import _system
    from tierstore.tiers.raw import probe_direct_io

    if not probe_direct_io(tmp_path).supported:
        pytest.skip(f"{tmp_path} refuses O_DIRECT, which the fallback needs")
    monkeypatch.setattr(_system.shutil, "which", lambda name: None)
    limit = _system.measure_raw_limit(tmp_path, 4 << 20)
    assert limit is not None
    assert limit.tool.startswith("loop:") and "fio not installed" in limit.tool
    assert limit.write_gbps > 0 and limit.overwrite_gbps > 0 and limit.read_gbps > 0
    assert list(tmp_path.iterdir()) == []


def test_the_disk_limit_writes_random_pages_never_the_same_twice(tmp_path: Path) -> None:
    """Note: [The disk's limit is measured with real bytes]: dd wrote zeros, which a disk may
    take faster than data; a first loop cycled 16 MiB and overwrote with the same bytes."""
    from tierstore.bench import _system
    from tierstore.tiers.raw import probe_direct_io

    if not probe_direct_io(tmp_path).supported:
        pytest.skip(f"{tmp_path} refuses O_DIRECT")
    path = tmp_path / "limit"
    nbytes = 4 << 20
    _system.direct_io(path, nbytes, "write", block=256 << 10)
    first = path.read_bytes()
    _system.direct_io(path, nbytes, "write", block=256 << 10)
    second = path.read_bytes()
    assert len(first) == len(second) == nbytes
    for data in (first, second):
        pages = [data[i : i + 4096] for i in range(0, nbytes, 4096)]
        assert len(set(pages)) == len(pages) and bytes(4096) not in pages
    assert first != second
    gbps, cpu = _system.direct_io(path, nbytes, "read", block=256 << 10)
    assert gbps > 0 and cpu >= 0


def test_a_request_failing_inside_the_limit_loop_gives_no_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failed request left a slice of the buffer exported, and closing the buffer raised
    BufferError over the OSError: the sweep died instead of going on without a limit."""
    import errno

    from tierstore.bench import _system
    from tierstore.tiers.raw import probe_direct_io

    if not probe_direct_io(tmp_path).supported:
        pytest.skip(f"{tmp_path} refuses O_DIRECT")
    real, calls = os.pwrite, [0]

    def third_fails(fd: int, data: Any, offset: int) -> int:
        calls[0] += 1
        if calls[0] == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(_system.os, "pwrite", third_fails)
    monkeypatch.setattr(_system.shutil, "which", lambda name: None)
    with pytest.raises(OSError, match="No space"):
        _system.direct_io(tmp_path / "limit", 4 << 20, "write", block=256 << 10)
    (tmp_path / "limit").unlink()
    calls[0] = 0
    assert _system.measure_raw_limit(tmp_path, 4 << 20) is None
    assert list(tmp_path.iterdir()) == []


def test_a_directory_that_refuses_o_direct_gives_no_limit_and_the_sweep_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """O_DIRECT refused (tmpfs before Linux 6.6, fio not installed) killed the sweep, and
    the README's main command with it."""
    import errno
    import json

    from tierstore.bench import _disk as bench
    from tierstore.bench import _system
    from tierstore.tiers.raw import DirectIOProbe

    def refused(*args: object, **kwargs: object) -> None:
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(_system.shutil, "which", lambda name: None)
    monkeypatch.setattr(_system, "direct_io", refused)
    assert _system.measure_raw_limit(tmp_path, 4 << 20) is None
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(bench, "MAX_TENSORS", 4)
    # The machine facts say so too, instead of claiming O_DIRECT.
    monkeypatch.setattr(
        "tierstore.tiers.raw.probe_direct_io",
        lambda d: DirectIOProbe(str(d), False, "refused by the test"),
    )
    out = tmp_path.parent / f"{tmp_path.name}.json"
    argv = ["--sizes", "1MiB", "--total", "4MiB", "--repeats", "1", "--json", str(out)]
    argv += ["--engines", "raw-limit,tierstore-raw", "--dir", str(tmp_path), "--no-progress"]
    assert bench.main(argv) == 0
    assert "no raw disk limit" in capsys.readouterr().err
    machine = json.loads(out.read_text())["machine"]
    assert machine["o_direct"] is False
    assert machine["page_cache"].startswith("O_DIRECT is refused here (refused by the test)")


def test_no_two_pages_of_the_benchmarks_tensors_are_alike_and_a_new_round_restamps() -> None:
    """Note: [Every page differs]: the tensors were one random block copied, marked only in
    their first 8 bytes, so a chunk read from another tensor's place, or a steady-round write
    that never reached the disk, read back equal and passed the check."""
    import torch

    from tierstore.bench._disk import _make_tensors
    from tierstore.bench._paths import stamp

    tensors = _make_tensors(64 << 10, 3) + _make_tensors(6000, 2) + _make_tensors(16, 2)
    pages = [bytes(t[i : i + 4096].tolist()) for t in tensors[:3] for i in range(0, 64 << 10, 4096)]
    assert len(set(pages)) == len(pages) == 48
    assert not torch.equal(tensors[3][4096:], tensors[4][4096:])  # the partial last page too
    for _ in range(2):  # each round differs from the one before, in every page
        before = [t.clone() for t in tensors]
        stamp(tensors)
        assert all(not torch.equal(a, b) for a, b in zip(before, tensors, strict=True))
        assert not torch.equal(before[3][4096:], tensors[3][4096:])


def test_the_steady_round_spills_into_the_extents_the_first_round_freed(tmp_path: Path) -> None:
    """What tierstore-raw-steady measures: a second round reuses the spill file, never grows
    it (Note: [First spill and steady state])."""
    import torch

    from tierstore import TieredStore
    from tierstore.bench._paths import _drained, _store_round

    # 72 MiB: the file grows to 128 MiB, too small to hold a second round beside the first.
    tensors = [torch.full((4 << 20,), i, dtype=torch.uint8) for i in range(16)]
    tensors += [torch.full((64 << 10,), i, dtype=torch.uint8) for i in range(128)]
    with TieredStore(
        host_bytes=0, device_bytes=0, min_bytes=0, disk_dir=str(tmp_path), timeout=None
    ) as store:
        _store_round(store, tensors, "first")
        (spill,) = tmp_path.rglob("spill.raw")
        grown = spill.stat().st_size
        assert grown == 128 << 20
        for _ in range(3):
            _drained(store)
            _store_round(store, tensors, "again")
            assert spill.stat().st_size == grown


def test_every_path_starts_with_the_free_heap_handed_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No path reads into memory an earlier one left in glibc's heap (Note: [Every path reads
    into new memory])."""
    from tierstore.bench import _disk as bench
    from tierstore.bench._paths import PATHS

    events: list[str] = []
    monkeypatch.setattr(bench, "trim_now", lambda: events.append("trim") or True)
    for name in ("os", "raw-engine"):
        path = PATHS[name]
        monkeypatch.setitem(
            PATHS,
            name,
            lambda ctx, ts, _name=name, _path=path: events.append(_name) or _path(ctx, ts),
        )
    argv = ["--sizes", "64KiB", "--total", "256KiB", "--repeats", "2", "--engines", "os,raw-engine"]
    assert bench.main([*argv, "--dir", str(tmp_path), "--no-progress"]) == 0
    assert events == ["trim", "os", "trim", "raw-engine"] * 2


def _tiny_default_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default run's constants, shrunk so that it takes seconds."""
    from tierstore.bench import __main__ as bench

    monkeypatch.setattr(bench, "QUICK_SIZES", [64 << 10, 1 << 20])
    monkeypatch.setattr(bench, "QUICK_TOTAL", 2 << 20)
    monkeypatch.setattr(bench, "QUICK_REPEATS", 1)
    monkeypatch.setattr(bench, "QUICK_MODES", ("none", "ts_disk"))
    tiny = ["--layers", "1", "--dim", "32", "--heads", "2", "--seq", "64", "--batch", "2"]
    monkeypatch.setattr(
        bench, "QUICK_TRAIN", [*tiny, "--vocab", "64", "--warmup", "1", "--steps", "1"]
    )


def test_the_default_run_answers_both_questions_and_draws_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    from tierstore.bench import __main__ as bench

    _tiny_default_run(monkeypatch)
    png, out = tmp_path / "b.png", tmp_path / "b.json"
    argv = ["--dir", str(tmp_path), "--plot", str(png), "--json", str(out), "--no-progress"]
    assert bench.main(argv) == 0
    text = capsys.readouterr().out
    assert "How fast this store spills and reads back here" in text
    assert "What offloading saves in a training step" in text
    for label in ("no offloading", "tierstore, disk tier"):
        assert label in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads(out.read_text())
    assert {r["mode"] for r in data["train"]} == {"none", "ts_disk"}
    assert {r["engine"] for r in data["disk"]} >= {"tierstore-raw-steady", "torch.save"}
    # The headline names the tool that measured the disk's limit (fio, or the one-request
    # loop where fio is absent), not fio whatever ran.
    loop = data["machine"]["raw_limit_tool"].startswith("loop:")
    name = "a one-request loop" if loop else "fio"
    assert f"the disk limit is {name}" in text and f"{name} writing a new file" in text
    # A one-request limit says why the store may pass it.
    assert ("(the loop keeps one request in flight" in text) == loop


@pytest.mark.parametrize("command", [[], ["disk"]], ids=["default", "disk"])
def test_a_plot_without_matplotlib_fails_at_once_with_the_install_hint(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    command: list[str],
) -> None:
    import sys

    from tierstore.bench import __main__ as bench

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    argv = [*command, "--dir", str(tmp_path), "--plot", str(tmp_path / "b.png")]
    assert bench.main(argv) == 2
    err = capsys.readouterr().err
    assert "pip install 'tierstore[plot]'" in err
    assert not (tmp_path / "b.png").exists()


def test_full_runs_the_disk_sweep(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tierstore.bench import __main__ as bench

    argv = ["--full", "--sizes", "64KiB", "--total", "256KiB", "--repeats", "1"]
    argv += ["--engines", "tierstore-raw", "--dir", str(tmp_path), "--no-progress"]
    assert bench.main(argv) == 0
    assert "tierstore-raw" in capsys.readouterr().out
    # --help lists --no-plot beside --full; the sweep's own parser refused it.
    assert bench.main([*argv, "--no-plot"]) == 0


def test_the_disk_offloader_baseline_trains_exactly_and_cleans_up(tmp_path: Path) -> None:
    """The baseline the training benchmark compares with: one file per checkpointed input,
    deleted once backward used it; the same gradients as plain training."""
    import torch
    from torch import nn

    from tierstore.bench._disk_offloader import DiskOffloader

    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(64, 64), nn.Dropout(0.2), nn.Tanh()) for _ in range(3)]
    x = torch.randn(512, 64, requires_grad=True)
    torch.manual_seed(1)
    h = x
    for layer in layers:
        h = layer(h)
    h.sum().backward()
    expected = [p.grad.clone() for layer in layers for p in layer.parameters()] + [x.grad.clone()]
    for layer in layers:
        layer.zero_grad()
    x.grad = None

    offloader = DiskOffloader(tmp_path)
    torch.manual_seed(1)
    h = x
    for layer in layers:
        h = offloader.checkpoint(layer, h)
    assert len(list(offloader.directory.glob("*.pt"))) <= 3
    h.sum().backward()
    got = [p.grad.clone() for layer in layers for p in layer.parameters()] + [x.grad.clone()]
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    assert list(offloader.directory.iterdir()) == []  # every file deleted after use
    offloader.close()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"], ["disk", "--help"]])
def test_help_describes_each_command_in_plain_text(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    from tierstore.bench import __main__ as bench

    with pytest.raises(SystemExit) as exit_:
        bench.main(argv)
    assert exit_.value.code == 0
    help_text = capsys.readouterr().out
    assert "``" not in help_text
    assert "tierstore-bench" in help_text


def test_the_gpu_copy_script_runs_on_the_cpu(tmp_path: Path) -> None:
    """benchmarks/gpu_copy.py runs only where a GPU is lent, rarely: its CPU mode keeps it
    working in between (every path checks its tensors bit for bit, so this also checks them)."""
    argv = ["--device", "cpu", "--size", "1MiB", "--count", "4", "--rounds", "2"]
    done = run_benchmark("gpu_copy.py", *argv, "--disk-dir", str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    for path in ("host tier", "disk tier", "disk tier, CPU tensors"):
        for op in ("put", "get"):
            assert any(line.startswith(f"{path} {op} ") for line in lines), done.stdout
    assert "disk tier store, all rounds: tierstore: 16 tensors" in done.stdout
    assert list(tmp_path.iterdir()) == []


def test_the_zarr_path_is_written_back_and_evicted_as_the_file_paths_are(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """zarr writes through the page cache: unflushed and cached, its figures were the page
    cache's while every file path paid for its write-back and read from the disk."""
    import torch

    from tierstore.bench import _paths
    from tierstore.bench._system import PageCache

    synced: list[Path] = []
    evicted: list[Path] = []
    real_write_back = _paths._write_back
    monkeypatch.setattr(_paths, "_write_back", lambda p: (synced.append(p), real_write_back(p)))
    monkeypatch.setattr(PageCache, "evict", lambda self, paths: evicted.extend(paths))
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "not-the-stores.bin").write_bytes(b"x")  # only the store's files
    ctx = _paths.Context(tmp_path / "a", tmp_path / "b", PageCache())
    tensors = [torch.randn(1 << 18) for _ in range(3)]  # 1 MiB each
    _paths.PATHS["tierstore-zarr"](ctx, tensors)
    assert synced and synced == evicted
    assert all(str(p).startswith(str(tmp_path / "a" / "tierstore-")) for p in synced), synced
    synced.clear()
    _paths.PATHS["tierstore-raw"](ctx, tensors)  # O_DIRECT, or flushed by the engine itself
    assert synced == []


def test_the_torch_save_path_saves_and_loads_from_four_threads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    import torch

    from tierstore.bench import _paths
    from tierstore.bench._system import PageCache

    threads: dict[str, set[int]] = {"save": set(), "load": set()}
    barriers = {name: threading.Barrier(4, timeout=10) for name in threads}
    real = {"save": torch.save, "load": torch.load}

    def four_at_once(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            threads[name].add(threading.get_ident())
            barriers[name].wait()  # four at once, or this times out
            return real[name](*args, **kwargs)

        return call

    monkeypatch.setattr(torch, "save", four_at_once("save"))
    monkeypatch.setattr(torch, "load", four_at_once("load"))
    ctx = _paths.Context(tmp_path, tmp_path, PageCache())
    tensors = [torch.randn(1024) for _ in range(8)]
    _paths.PATHS["torch.save"](ctx, tensors)  # and checks what came back, newest first
    assert len(threads["save"]) == len(threads["load"]) == 4


@pytest.mark.filterwarnings("ignore:No artists with labels:UserWarning")  # no disk rows
def test_the_headline_shows_the_gpu_peak_when_the_run_was_on_a_gpu(tmp_path: Path) -> None:
    """On CUDA offloading frees GPU memory and fills host memory: the host's RSS, which the
    headline showed, grew where the GPU's peak fell."""
    from tierstore.bench import __main__ as bench
    from tierstore.bench._plot import plot_summary
    from tierstore.bench.train import GPU_PEAK, Report

    mib = 1 << 20

    def row(mode: str, rss: int, gpu: int) -> dict[str, object]:
        return {"mode": mode, "label": mode, "step_s_median": 1.0, "peak_rss_bytes": rss * mib,
                GPU_PEAK: gpu * mib}  # fmt: skip

    report = Report([row("none", 1000, 800), row("ts_disk", 1300, 300)], [])
    text = bench.headline([], report)
    assert "peak GPU MiB" in text and "peak RSS MiB" not in text
    line = next(x for x in text.splitlines() if x.startswith("ts_disk"))
    assert line.split()[3:5] == ["300", "500"]  # the GPU's peak, and what it saved
    host = Report([{k: v for k, v in r.items() if k != GPU_PEAK} for r in report.results], [])
    assert "peak RSS MiB" in bench.headline([], host)
    assert "no raw disk limit" in text  # no raw-limit rows: the nan columns are explained
    pytest.importorskip("matplotlib")
    png = tmp_path / "s.png"
    plot_summary([], report.results, png, {"cpus": 2, "filesystem": "ext4"})
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_the_raw_limit_moves_what_the_paths_move_at_each_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It moved --total capped at 1 GiB whatever the size, where the paths move at most
    MAX_TENSORS tensors: 1 GiB against 256 MiB of 64 KiB tensors in the documented sweep."""
    from tierstore.bench import _disk as bench
    from tierstore.bench._system import RawLimit

    asked: list[int] = []

    def fake(directory: Path, nbytes: int) -> RawLimit:
        asked.append(nbytes)
        return RawLimit("fake", 1.0, 1.0, 1.0)

    monkeypatch.setattr(bench, "measure_raw_limit", fake)
    monkeypatch.setattr(bench, "MAX_TENSORS", 8)
    argv = ["--sizes", "1MiB,4MiB", "--total", "64MiB", "--repeats", "1"]
    argv += ["--engines", "raw-limit,os", "--dir", str(tmp_path), "--no-progress"]
    assert bench.main(argv) == 0
    assert asked == [16 << 20, 32 << 20]  # 8 x 1 MiB, raised to the 16 MiB floor; 8 x 4 MiB


def test_the_wait_for_the_disk_reports_its_own_cpu() -> None:
    """Note: [The wait is not the store's CPU]: a store path's write CPU leaves it out."""
    import time
    from types import SimpleNamespace

    from tierstore.bench import _paths

    calls = 0

    class Store:
        def stats(self) -> SimpleNamespace:
            nonlocal calls
            calls += 1
            end = time.thread_time() + 0.004
            while time.thread_time() < end:  # a snapshot that costs 4 ms of this thread
                pass
            settled = calls >= 5
            return SimpleNamespace(
                inflight_bytes=0, disk=SimpleNamespace(bytes=10 if settled else 0)
            )

    waited = _paths.settle(Store(), 10)  # type: ignore[arg-type]
    assert calls == 5 and 0.02 <= waited < 1.0
