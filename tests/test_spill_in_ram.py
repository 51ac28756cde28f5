"""A spill directory on tmpfs or ramfs puts the disk tier back into RAM: the store says so,
once per directory, naming the directory and the filesystem."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import tierstore
from tierstore import _spilldir

TMPFS, RAMFS = 0x01021994, 0x858458F6


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "keeps its files in memory" in r.getMessage()]


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    shm = Path("/dev/shm")
    if _spilldir.ram_filesystem(shm) != "tmpfs" or not os.access(shm, os.W_OK | os.X_OK):
        pytest.skip("no writable tmpfs at /dev/shm")
    d = Path(tempfile.mkdtemp(prefix="tierstore-test-", dir=shm))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_a_real_tmpfs_is_warned_about_once_per_directory(
    shm_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="tierstore"):
        for _ in range(2):
            tierstore.TieredStore(disk_dir=shm_dir).close()
    said = _warnings(caplog)
    assert len(said) == 1, said
    assert str(shm_dir) in said[0] and "on tmpfs" in said[0] and "TIERSTORE_DISK_DIR" in said[0]


def test_a_disk_is_not_warned_about(disk_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    if _spilldir.ram_filesystem(disk_dir) is not None:
        pytest.skip("the temporary directory is itself in RAM here")
    with caplog.at_level(logging.WARNING, logger="tierstore"):
        tierstore.TieredStore(disk_dir=disk_dir).close()
    assert _warnings(caplog) == []


@pytest.mark.parametrize(("magic", "name"), [(TMPFS, "tmpfs"), (RAMFS, "ramfs")])
def test_the_filesystem_type_comes_from_statfs(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    magic: int,
    name: str,
) -> None:
    parent = tmp_path / name
    parent.mkdir()
    monkeypatch.setattr(_spilldir, "_fs_magic", lambda path: magic)
    with caplog.at_level(logging.WARNING, logger="tierstore"):
        tierstore.TieredStore(disk_dir=parent).close()
        tierstore.TieredStore(disk_dir=parent, disk_bytes=0).close()  # no disk tier: silent
    said = _warnings(caplog)
    assert len(said) == 1 and f"'{parent}' is on {name}" in said[0]


def test_mountinfo_answers_when_statfs_cannot(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(_spilldir, "_fs_magic", lambda path: None)
    monkeypatch.setattr(_spilldir, "_fs_name", lambda path: "ramfs")
    assert _spilldir.ram_filesystem(tmp_path) == "ramfs"
    monkeypatch.setattr(_spilldir, "_fs_name", lambda path: "ext4")
    assert _spilldir.ram_filesystem(tmp_path) is None


def test_mountinfo_is_read_for_the_deepest_mount() -> None:
    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip("no /dev/shm")
    fs = _spilldir._fs_name(shm)
    assert fs is not None and fs == _spilldir._fs_name(shm / "nonexistent-child")
    assert _spilldir._fs_name(Path("/proc/self")) == "proc"
