"""``python -m tierstore info`` reports the configuration and what it detected."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pytest

import tierstore
from tierstore import __main__ as main_module

SRC = Path(__file__).resolve().parents[1] / "src"


def _run(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``python -m tierstore *args`` in a process of its own, with only ``env``'s TIERSTORE_*."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("TIERSTORE_")}
    return subprocess.run(
        [sys.executable, "-m", "tierstore", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**base, "PYTHONPATH": str(SRC), **env},
    )


class Done(NamedTuple):
    returncode: int
    stdout: str
    stderr: str


Info = Callable[..., Done]


@pytest.fixture
def info(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Info:
    """``python -m tierstore info *args`` in this process (a process each costs seconds of
    importing torch; one test runs the real command), with only ``env``'s TIERSTORE_*."""

    def run(*args: str, env: dict[str, str]) -> Done:
        capsys.readouterr()
        with monkeypatch.context() as m:
            for var in [v for v in os.environ if v.startswith("TIERSTORE_")]:
                m.delenv(var)
            for var, value in env.items():
                m.setenv(var, value)
            code = main_module.main(["info", *args])
        out = capsys.readouterr()
        return Done(code, out.out, out.err)

    return run


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
    assert info["engine"]["format"] == "raw" and info["engine"]["io_threads"] == 3
    assert len(info["engine"]["directories"]) == 2  # one of its own under each parent
    assert list(a.iterdir()) == [] and list(b.iterdir()) == []  # probe and engine cleaned up

    text = _run("info", env={"TIERSTORE_DISK_DIR": str(a)})
    assert text.returncode == 0, text.stderr
    assert f"spill directory {a}:" in text.stdout and "O_DIRECT" in text.stdout
    assert "CUDA available:" in text.stdout and "torch" in text.stdout


@pytest.mark.parametrize(
    ("env", "line"),
    [
        ({}, "disk engine: raw (io_threads 8, io_chunk_bytes 8.0 MiB, checksum "),
        ({"TIERSTORE_DISK_FORMAT": "zarr"}, "disk engine: zarr (zarr "),
        (
            {"TIERSTORE_CHECKSUM": "none", "TIERSTORE_IO_CHUNK_BYTES": "1MiB"},
            "1.0 MiB, checksum none",
        ),
        ({"TIERSTORE_DISK_BYTES": "0"}, "disk engine: none (the disk tier is off"),
    ],
)
def test_info_shows_what_the_disk_engine_detected_and_leaves_nothing(
    tmp_path: Path, info: Info, env: dict[str, str], line: str
) -> None:
    done = info(env={"TIERSTORE_DISK_DIR": str(tmp_path), **env})
    assert done.returncode == 0, done.stderr
    engine_line = next(ln for ln in done.stdout.splitlines() if ln.startswith("disk engine:"))
    assert line in engine_line, engine_line
    assert str(tmp_path) not in engine_line  # its directories were temporary; not shown
    assert list(tmp_path.iterdir()) == []


def test_info_still_reports_everything_else_when_the_engine_cannot_open(
    tmp_path: Path, info: Info, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_space(config: object) -> object:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("tierstore.core._disk_tier.open_disk_tier", no_space)
    done = info(env={"TIERSTORE_DISK_DIR": str(tmp_path)})
    # A store would fail to open there: exit 2, as for a directory it refuses outright.
    assert done.returncode == 2, done.stderr
    assert "disk engine: cannot open ([Errno 28] No space left on device)" in done.stdout
    assert "torch" in done.stdout and f"spill directory {tmp_path}:" in done.stdout


def test_a_spill_directory_that_cannot_be_made_exits_2_with_the_stores_hint(info: Info) -> None:
    """``/proc`` takes no directory. As root, which passes the permission check, the
    engine's mkdir failed, ``info`` exited 0, and the hint said to free space there."""
    expected = _store_error(Path("/proc"))
    assert "free space" not in expected, expected
    done = info(env={"TIERSTORE_DISK_DIR": "/proc"})
    assert done.returncode == 2, done.stdout
    assert expected.split("tierstore-")[0] in done.stdout + done.stderr


def test_info_can_be_collected_inside_a_running_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TIERSTORE_DISK_DIR", str(tmp_path))

    async def in_a_notebook() -> dict[str, object]:
        return main_module.collect_info()

    facts = asyncio.run(in_a_notebook())
    engine = facts["engine"]
    assert isinstance(engine, dict) and engine["format"] == "raw", engine
    assert list(tmp_path.iterdir()) == []


def test_info_names_a_bad_variable(info: Info) -> None:
    done = info(env={"TIERSTORE_IO_THREADS": "lots"})
    assert done.returncode == 2
    assert "TIERSTORE_IO_THREADS" in done.stderr


def _store_error(parent: Path) -> str:
    """What a store says about ``parent`` as its spill directory."""
    with pytest.raises(tierstore.ConfigError) as info:
        tierstore.TieredStore(disk_dir=parent)
    return str(info.value)


def test_info_fails_as_the_store_does_on_a_bad_spill_directory(tmp_path: Path, info: Info) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("x")
    bad = [tmp_path / "missing", a_file]
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        bad.append(locked)
    for parent in bad:
        expected = _store_error(parent)
        for args in ([], ["--json"]):
            done = info(*args, env={"TIERSTORE_DISK_DIR": str(parent)})
            assert done.returncode == 2, (parent, done.stdout)
            assert expected in done.stderr, (expected, done.stderr)


def test_info_shows_the_capacities_a_store_would_have(tmp_path: Path, info: Info) -> None:
    env = {"TIERSTORE_DISK_DIR": str(tmp_path), "LOCAL_WORLD_SIZE": "4"}
    facts = json.loads(info("--json", env=env).stdout)
    caps, free = facts["capacities"], facts["disk_dirs"][0]["free_bytes"]
    assert facts["config"]["disk_bytes"] is None
    assert 0 < caps["disk_bytes"] <= free + 64 * 2**20
    assert caps["disk_bytes"] == caps["disk_free_bytes"]
    assert caps["host_bytes"] == facts["host_default"]["memory_bytes"] // 4 // 4
    assert "4 ranks" in caps["host_from"]
    text = info(env=env).stdout
    assert "disk_bytes           unset: the free space" in text
    disk = next(ln for ln in text.splitlines() if ln.startswith("  disk   "))
    assert "B (the free space under the spill directories)" in disk and "None" not in disk

    capped = {"TIERSTORE_DISK_DIR": str(tmp_path), "TIERSTORE_DISK_BYTES": "1000TiB"}
    text = info(env=capped).stdout
    assert "(TIERSTORE_DISK_BYTES=1000 TiB, capped at the " in text, text
    off = info("--json", env={**capped, "TIERSTORE_DISK_BYTES": "0"}).stdout
    assert json.loads(off)["capacities"]["disk_bytes"] == 0


def test_info_warns_of_a_spill_directory_in_ram(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, info: Info
) -> None:
    from tierstore import _spilldir

    for var in [v for v in os.environ if v.startswith("TIERSTORE_")]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("TIERSTORE_DISK_DIR", str(tmp_path))
    monkeypatch.setattr(_spilldir, "_fs_magic", lambda path: 0x858458F6)
    facts = main_module.collect_info()
    assert facts["disk_dirs"][0]["in_ram"] == "ramfs"  # type: ignore[index]
    monkeypatch.undo()
    shm = Path("/dev/shm")
    if _spilldir.ram_filesystem(shm) != "tmpfs" or not os.access(shm, os.W_OK):
        pytest.skip("no writable tmpfs at /dev/shm")
    done = info(env={"TIERSTORE_DISK_DIR": str(shm)})
    assert done.returncode == 0, done.stderr
    assert f"warning: disk_dir/TIERSTORE_DISK_DIR '{shm}' is on tmpfs" in done.stdout
    facts = json.loads(info("--json", env={"TIERSTORE_DISK_DIR": str(shm)}).stdout)
    assert facts["disk_dirs"][0]["in_ram"] == "tmpfs"


def test_info_into_a_pipe_closed_early_exits_quietly(tmp_path: Path) -> None:
    """``tierstore info | head -1``: writing the report into a closed pipe raised
    BrokenPipeError with a traceback."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERSTORE_")}
    env.update({"PYTHONPATH": str(SRC), "TIERSTORE_DISK_DIR": str(tmp_path)})
    with subprocess.Popen(
        [sys.executable, "-m", "tierstore", "info"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    ) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()  # before the report is written: as head does, only sooner
        err = proc.stderr.read().decode()
        assert proc.wait(timeout=60) == 0, err
    assert "Traceback" not in err, err
