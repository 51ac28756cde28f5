"""O_DIRECT where the filesystem takes it: the probe, and the engine's auto/on/off."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tierstore.errors import ConfigError
from tierstore.testing import CHUNK, make_dirs, random_bytes
from tierstore.tiers.raw import RawEngine, probe_direct_io

from .backdoor import reads_back

if TYPE_CHECKING:
    from collections.abc import Iterator

    from tierstore.config import StoreConfig


def _has_o_direct(engine: RawEngine) -> bool:
    return bool(fcntl.fcntl(engine.files[0].fd, fcntl.F_GETFL) & os.O_DIRECT)


async def test_auto_uses_o_direct_where_the_filesystem_takes_it(
    tmp_path: Path, config: StoreConfig
) -> None:
    if not probe_direct_io(tmp_path).supported:
        pytest.skip(f"{tmp_path} refuses O_DIRECT")
    engine = RawEngine(make_dirs(tmp_path, 1), config)
    try:
        assert _has_o_direct(engine)
        assert engine.describe()["direct_io"] == {str(engine.directories[0]): True}
    finally:
        await engine.close()


async def test_off_never_uses_o_direct(tmp_path: Path, config: StoreConfig) -> None:
    engine = RawEngine(make_dirs(tmp_path, 1), config.replace(direct_io="off"))
    try:
        assert not _has_o_direct(engine)
        src = random_bytes(3 * CHUNK + 1)
        await engine.write(1, src)
        assert await reads_back(engine, 1, src)
    finally:
        await engine.close()


def _refusing_mount() -> Path | None:
    """A writable directory on a filesystem that really refuses O_DIRECT, if there is one."""
    candidates = [Path("/dev/shm")]
    with open("/proc/mounts") as mounts:
        for line in mounts:
            fields = line.split()
            if fields[2] in {"ramfs", "tmpfs"}:
                candidates.append(Path(fields[1]))
    for path in candidates:
        usable = path.is_dir() and os.access(path, os.W_OK | os.X_OK)
        if usable and not probe_direct_io(path).supported:
            return path
    return None


@pytest.fixture
def refusing_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A directory where opening with O_DIRECT fails with EINVAL.

    tmpfs takes O_DIRECT since Linux 6.6, so a real refusing filesystem (ramfs, an old tmpfs)
    is used where one is mounted; otherwise os.open refuses O_DIRECT there exactly as such a
    kernel does.
    """
    mount = _refusing_mount()
    if mount is not None:
        d = Path(tempfile.mkdtemp(dir=mount))
        os.chmod(d, 0o700)
        yield d
        shutil.rmtree(d, ignore_errors=True)
        return
    d = tmp_path / "refuses"
    d.mkdir(mode=0o700)
    real_open = os.open

    def refusing_open(path: str | os.PathLike[str], flags: int, *args: object, **kw: object) -> int:
        if flags & os.O_DIRECT and os.fspath(path).startswith(str(d)):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", refusing_open)
    yield d


def test_probe_reports_a_refusing_filesystem(refusing_dir: Path) -> None:
    probe = probe_direct_io(refusing_dir)
    assert not probe.supported
    assert "Invalid argument" in probe.reason
    assert list(refusing_dir.iterdir()) == []  # the scratch file is gone


def test_on_where_o_direct_is_refused_is_a_clear_error(
    refusing_dir: Path, config: StoreConfig
) -> None:
    with pytest.raises(ConfigError, match=r"TIERSTORE_DIRECT_IO='on'.*refuses O_DIRECT"):
        RawEngine((refusing_dir,), config.replace(direct_io="on"))
    assert list(refusing_dir.iterdir()) == []


async def test_auto_falls_back_to_buffered_io_and_says_so_once(
    refusing_dir: Path, tmp_path: Path, config: StoreConfig, caplog: pytest.LogCaptureFixture
) -> None:
    other = make_dirs(tmp_path, 1)[0]
    with caplog.at_level(logging.WARNING, logger="tierstore"):
        engine = RawEngine((refusing_dir, other), config)
    try:
        warnings = [r for r in caplog.records if "O_DIRECT is refused" in r.getMessage()]
        assert len(warnings) == 1
        assert str(refusing_dir) in warnings[0].getMessage()
        assert not engine.files[0].direct
        src = random_bytes(5 * CHUNK + 3, seed=7)
        await engine.write(1, src)
        assert await reads_back(engine, 1, src)
    finally:
        await engine.close()
