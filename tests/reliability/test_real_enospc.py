"""Real ENOSPC on small real filesystems: a loop-mounted ext4 image and a size-limited tmpfs.

Mounting needs root (or CAP_SYS_ADMIN); where the kernel refuses, these tests skip and say why.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tierstore import Tier, TieredStore, TierFullError
from tierstore.core import _disk_room as disk_room
from tierstore.testing import audit, install_faults, settled, wait_for

MiB = 1 << 20


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, check=False)


@pytest.fixture(params=["ext4-loop", "tmpfs"])
def small_fs(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path]:
    """A mounted filesystem of about 24 MiB usable space, unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a test filesystem needs root")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if request.param == "ext4-loop":
        if shutil.which("mkfs.ext4") is None:
            pytest.skip("mkfs.ext4 is not installed")
        image = tmp_path / "fs.img"
        with open(image, "wb") as f:
            f.truncate(32 * MiB)
        made = _run("mkfs.ext4", "-q", "-F", "-m", "0", str(image))  # -m 0: no root reserve
        if made.returncode:
            pytest.skip(f"mkfs.ext4 failed: {made.stderr.strip()}")
        mounted = _run("mount", "-o", "loop", str(image), str(mnt))
    else:
        mounted = _run("mount", "-t", "tmpfs", "-o", "size=24m,mode=0755", "tmpfs", str(mnt))
    if mounted.returncode:
        pytest.skip(f"mount refused here: {mounted.stderr.strip()}")
    try:
        d = mnt / "spill"
        d.mkdir()
        yield d
    finally:
        if _run("umount", str(mnt)).returncode:
            _run("umount", "-l", str(mnt))


def _free(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _fill(path: Path) -> Path:
    """Fill the filesystem under ``path`` the way another process would, until ENOSPC."""
    filler = path / "filler.bin"
    fd = os.open(filler, os.O_CREAT | os.O_WRONLY | os.O_APPEND, 0o600)
    try:
        for size in (MiB, 4096):
            block = b"\0" * size
            while True:
                try:
                    os.write(fd, block)
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC
                    break
        os.fsync(fd)
    finally:
        os.close(fd)
    return filler


def _t(i: int) -> torch.Tensor:
    return torch.full((MiB // 4,), float(i))  # 1 MiB


def test_disk_bytes_is_capped_at_the_real_free_space(small_fs: Path) -> None:
    free = _free(small_fs)
    with TieredStore(disk_dir=small_fs, disk_bytes="1GiB", host_bytes=0, min_bytes=0) as store:
        cap = store.stats().disk.capacity
        assert 0 < cap <= free < 32 * MiB
    assert list(small_fs.iterdir()) == []


def test_filling_a_real_filesystem_loses_nothing(small_fs: Path) -> None:
    with TieredStore(
        disk_dir=small_fs, device_bytes=0, host_bytes=2 * MiB, min_bytes=0, disk_bytes="1TiB"
    ) as store:
        kept: list[tuple[object, torch.Tensor]] = []
        with pytest.raises(TierFullError, match="no tier has room"):
            for i in range(200):  # 200 MiB into 2 MiB of host and ~24 MiB of disk
                t = _t(i)
                kept.append((store.put(t), t))
                wait_for(lambda: settled(store))
        assert 8 <= len(kept) < 60, len(kept)
        st = store.stats()
        assert st.disk.bytes <= st.disk.capacity <= 32 * MiB
        assert st.disk.entries > 4
        for h, t in kept:  # every tensor accepted is still exact
            assert torch.equal(store.get(h), t)  # type: ignore[arg-type]
        # Freeing entries makes room again on the same filesystem.
        for h, _ in kept[: len(kept) // 2]:
            store.release(h)  # type: ignore[arg-type]
        kept = kept[len(kept) // 2 :]
        for i in range(4):
            t = _t(1000 + i)
            kept.append((store.put(t), t))
        wait_for(lambda: settled(store))
        for h, t in kept:
            assert torch.equal(store.get(h), t)  # type: ignore[arg-type]
        audit(store)
    assert list(small_fs.iterdir()) == []


def test_real_enospc_mid_run_then_space_returns(
    small_fs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(disk_room, "RETRY_SECONDS", 0.05)
    filler: list[Path] = []
    with TieredStore(
        # direct_io="auto": O_DIRECT wherever the filesystem takes it.
        disk_dir=small_fs,
        device_bytes=0,
        host_bytes=MiB,
        min_bytes=0,
        direct_io="auto",
    ) as store:
        faulty = install_faults(store)
        real_errors: list[BaseException] = []
        inner_write = faulty.inner.write

        async def write(key: int, src: torch.Tensor, **kw: object) -> None:
            try:
                await inner_write(key, src, **kw)
            except OSError as exc:
                real_errors.append(exc)
                raise

        faulty.inner.write = write  # type: ignore[method-assign]
        # Another process fills the disk between the store's free-space check and its write.
        faulty.before_write = lambda key: filler.append(_fill(small_fs)) if not filler else None
        hs = [store.put(_t(i)) for i in range(2)]
        wait_for(lambda: faulty.failed_writes + len(real_errors) >= 1 and settled(store))
        assert real_errors and all(
            isinstance(e, OSError) and e.errno == errno.ENOSPC for e in real_errors
        ), real_errors
        assert store.tier_of(hs[0]) is Tier.HOST, "the tensor must stay where it is held"
        st = store.stats()
        assert st.write_errors >= 1 and not st.disk_available
        with pytest.raises(TierFullError, match="disk tier unavailable"):
            store.put(_t(9))
        # The other process deletes its file: the disk tier comes back and spilling resumes.
        filler[0].unlink()
        wait_for(lambda: store.stats().disk_available, what="disk tier back")
        hs.append(store.put(_t(2)))
        wait_for(lambda: settled(store) and store.tier_of(hs[0]) is Tier.DISK)
        for i, h in enumerate(hs):
            assert torch.equal(store.get(h), _t(i))
        audit(store)
    assert list(small_fs.iterdir()) == []
