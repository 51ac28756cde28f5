"""Security: private modes, no symlink or pre-creation attacks, no unpickling, no logged values.

The spill parent is often a shared, world-writable directory (/tmp, /var/tmp), so another local
user can plant names there before us. Invariant 8 of the design.
"""

from __future__ import annotations

import errno
import importlib.util
import logging
import os
import pickle
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import tierstore
import tierstore._spilldir as spilldir
from tierstore import SpillIOError, Tier, TieredStore
from tierstore._spilldir import PREFIX, sweep_stale
from tierstore.config import StoreConfig
from tierstore.core import _disk_room as disk_room
from tierstore.testing import backdoor_files, install_faults, settled, wait_for
from tierstore.tiers.raw import SPILL_FILE, RawEngine

MiB = 1 << 20
MakeStore = Callable[..., TieredStore]
FORMATS = ["raw"] + (["zarr"] if importlib.util.find_spec("tierstore.tiers._zarr") else [])


def _spill(store: TieredStore, t: torch.Tensor) -> Any:
    h = store.put(t)
    wait_for(lambda: store.tier_of(h) is Tier.DISK and settled(store))
    return h


@pytest.fixture
def open_umask() -> Iterator[None]:
    """A permissive umask, so modes come from the store's own open/mkdir calls."""
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


@pytest.mark.parametrize("fmt", FORMATS)
def test_spill_dir_is_0700_and_every_file_0600(
    make_store: MakeStore, open_umask: None, fmt: str
) -> None:
    store = make_store(device_bytes=0, host_bytes=0, disk_format=fmt)
    hs = [_spill(store, torch.randn(MiB // 4 + i)) for i in range(3)]
    (spill,) = store.spill_dirs
    assert stat.S_IMODE(os.lstat(spill).st_mode) == 0o700
    entries = list(Path(spill).rglob("*"))
    assert any(p.is_file() and p.name != ".lock" for p in entries), entries
    for p in entries:
        mode = stat.S_IMODE(os.lstat(p).st_mode)
        assert not p.is_symlink(), p
        assert mode == (0o700 if p.is_dir() else 0o600), (p, oct(mode))
        assert os.lstat(p).st_uid == os.getuid()
    del hs


def test_predictable_spill_dir_name_taken_by_a_symlink_is_not_followed(
    disk_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious").write_text("keep me")
    tokens = iter(["deadbeef", "deadbeef", "cafef00d"])
    fake_secrets = type("FakeSecrets", (), {"token_hex": staticmethod(lambda n: next(tokens))})
    monkeypatch.setattr(spilldir, "secrets", fake_secrets)  # only the spill dir's names
    # The attacker guessed our PID and random part and planted both a symlink and a directory.
    planted_link = disk_dir / f"{PREFIX}{os.getpid()}-deadbeef"
    planted_link.symlink_to(victim)
    with TieredStore(disk_dir=disk_dir, host_bytes=0, min_bytes=0) as store:
        (spill,) = store.spill_dirs
        assert Path(spill).name.endswith("cafef00d"), spill
        assert not Path(spill).is_symlink()
        h = _spill(store, torch.arange(1000.0))
        assert torch.equal(store.get(h), torch.arange(1000.0))
    assert sorted(p.name for p in victim.iterdir()) == ["precious"]
    assert (victim / "precious").read_text() == "keep me"
    assert planted_link.is_symlink()  # not ours: left alone, not followed
    planted_link.unlink()


@pytest.mark.parametrize("direct_io", ["off", "auto"])
@pytest.mark.parametrize("planted", ["link", "file"])
def test_a_name_planted_at_the_spill_file_is_refused_not_followed(
    tmp_path: Path, direct_io: str, planted: str
) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"keep me")
    spill = tmp_path / "spill"
    spill.mkdir(mode=0o700)
    target = spill / SPILL_FILE
    if planted == "link":
        target.symlink_to(victim)
    else:
        target.write_bytes(b"theirs")
    config = StoreConfig.from_env({}, disk_dir=tmp_path, direct_io=direct_io)
    with pytest.raises(FileExistsError):
        RawEngine((spill,), config)
    assert victim.read_bytes() == b"keep me", "the engine followed a planted symlink"
    if planted == "link":
        assert target.is_symlink(), "a link that is not ours was removed"
    else:
        assert target.read_bytes() == b"theirs", "a file that is not ours was written"


def test_stale_sweep_never_follows_a_symlink_named_like_a_spill_dir(
    disk_dir: Path, tmp_path: Path
) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious").write_text("keep me")
    link = disk_dir / f"{PREFIX}999999999-00000000"
    link.symlink_to(victim)
    assert sweep_stale(disk_dir) == []
    assert (victim / "precious").read_text() == "keep me"
    link.unlink()


class _Refused(AssertionError):
    pass


def _refuse(*args: Any, **kwargs: Any) -> Any:
    raise _Refused("something unpickled on tierstore's load path")


@pytest.mark.parametrize("fmt", FORMATS)
def test_nothing_on_the_load_path_unpickles(
    make_store: MakeStore, monkeypatch: pytest.MonkeyPatch, fmt: str
) -> None:
    store = make_store(device_bytes=0, host_bytes=0, disk_format=fmt)
    t = torch.randn(MiB // 4 + 3)
    h = _spill(store, t)
    unpickler = type("Unpickler", (pickle.Unpickler,), {"__init__": _refuse})
    monkeypatch.setattr(pickle, "load", _refuse)
    monkeypatch.setattr(pickle, "loads", _refuse)
    monkeypatch.setattr(pickle, "Unpickler", unpickler)
    monkeypatch.setattr(torch, "load", _refuse)
    monkeypatch.setattr(torch.serialization, "load", _refuse)
    monkeypatch.setattr(np, "load", _refuse)
    out = store.get(h)  # from disk
    assert torch.equal(out, t)
    assert store.stats().bytes_from_disk >= t.numel() * 4


def test_no_tensor_contents_are_ever_logged(
    make_store: MakeStore, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(disk_room, "RETRY_SECONDS", 0.01)
    marker = 271828.125  # exactly representable; any printed tensor would show it
    t = torch.full((MiB // 4,), marker)
    t[7] = -31415.5
    with caplog.at_level(logging.DEBUG, logger="tierstore"):
        store = make_store(device_bytes=0, host_bytes=MiB // 2, disk_bytes=4 * MiB)
        faulty = install_faults(store)
        faulty.fail_writes(errno.EIO, times=1)
        hs = []
        for _ in range(4):
            for _attempt in range(500):  # a put may meet the disk's short pause after EIO
                try:
                    hs.append(store.put(t.clone()))
                    break
                except tierstore.TierFullError:
                    time.sleep(0.005)
        wait_for(lambda: faulty.writes >= 2 and settled(store))
        faulty.fail_reads(errno.EIO, times=1)
        errors: list[str] = []
        for h in hs:
            try:
                store.get(h)
            except SpillIOError as exc:
                errors.append(str(exc))
        with pytest.raises(tierstore.TierFullError) as full:
            store.put(torch.full((4 * MiB,), marker))
        errors.append(str(full.value))
        # Corrupt what is on disk, so the corruption path logs too.
        for f in backdoor_files(store):
            with open(f, "r+b") as fh:
                fh.write(b"\xff" * 64)
        for h in hs:
            try:
                store.get(h)
            except tierstore.TierStoreError as exc:
                errors.append(str(exc))
        store.close()
    text = "\n".join([r.getMessage() for r in caplog.records] + [caplog.text, *errors])
    assert caplog.records, "expected the faults above to log something"
    assert any("failed" in r.getMessage() for r in caplog.records)
    assert len(hs) == 4
    for needle in ("271828", "31415", "2.7183e+05", "tensor(["):
        assert needle not in text, f"tensor contents leaked into logs or errors: {needle}"
