"""The raw engine: conformance, plus extents, striping, direct I/O and failure paths."""

from __future__ import annotations

import asyncio
import errno
import fcntl
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from tierstore.config import StoreConfig
from tierstore.errors import ConfigError, CorruptTensorError
from tierstore.tiers import _raw, open_engine
from tierstore.tiers._raw import PAGE, RawEngine, probe_direct_io

from .engine_conformance import (
    CHUNK,
    EngineConformance,
    MiB,
    make_dirs,
    random_bytes,
    random_bytes_at,
)
from .raw_files import stored_bytes

if TYPE_CHECKING:
    from collections.abc import Iterator

    from tierstore.tiers import DiskEngine


def _blob(engine: DiskEngine, key: int) -> _raw._Blob:
    assert isinstance(engine, RawEngine)
    return engine._blobs[key]


class TestRawConformance(EngineConformance):
    engine_class = RawEngine

    def backdoor_read(self, engine: DiskEngine, key: int) -> bytes:
        assert isinstance(engine, RawEngine)
        return stored_bytes(engine, key)

    def damage_byte(self, engine: DiskEngine, key: int) -> None:
        c = _blob(engine, key).chunks[-1]
        with open(c.file.path, "r+b") as f:
            f.seek(c.offset + c.lead + c.length // 2)
            byte = f.read(1)
            f.seek(c.offset + c.lead + c.length // 2)
            f.write(bytes([byte[0] ^ 0x01]))

    def truncate(self, engine: DiskEngine, key: int) -> None:
        c = _blob(engine, key).chunks[-1]
        os.truncate(c.file.path, c.offset + c.lead + c.length // 2)

    def dirs_holding(self, engine: DiskEngine, key: int) -> set[Path]:
        return {c.file.path.parent for c in _blob(engine, key).chunks}


class TestRawStripedConformance(TestRawConformance):
    """Everything again with two directories, so every size is striped."""

    n_dirs = 2


@pytest.fixture
def config() -> StoreConfig:
    return StoreConfig.from_env({}, io_chunk_bytes=CHUNK, io_threads=4)


@pytest.fixture
async def engine(tmp_path: Path, config: StoreConfig) -> RawEngine:
    e = RawEngine(make_dirs(tmp_path, 1), config)
    yield e  # type: ignore[misc]
    await e.close()


def test_open_engine_picks_raw_by_default(tmp_path: Path) -> None:
    engine = open_engine(make_dirs(tmp_path, 1), StoreConfig.from_env({}))
    assert isinstance(engine, RawEngine)
    engine._close_files()


async def test_offsets_and_extents_are_page_aligned(engine: RawEngine) -> None:
    for k, n in enumerate([1, 4095, 4097, 3 * CHUNK + 1]):
        await engine.write(k, random_bytes(n))
        for c in engine._blobs[k].chunks:
            assert c.offset % PAGE == 0
        for _, offset, nbytes in engine._blobs[k].extents:
            assert offset % PAGE == 0 and nbytes % PAGE == 0


async def test_true_size_and_padded_size_are_kept_apart(engine: RawEngine) -> None:
    # See Note: [True size and padded size]: the padding is zeros and is never returned.
    src = random_bytes(PAGE + 3, seed=9)
    await engine.write(1, src)
    c = engine._blobs[1].chunks[0]
    assert c.length == PAGE + 3
    with open(c.file.path, "rb") as f:
        f.seek(c.offset)
        on_disk = f.read(2 * PAGE)
    assert on_disk[: PAGE + 3] == src.numpy().tobytes()
    if c.file.direct:
        assert on_disk[PAGE + 3 :] == bytes(PAGE - 3)
    assert engine.footprint(PAGE + 3) == 2 * PAGE


async def test_freed_extent_is_reused_at_the_same_offset(engine: RawEngine) -> None:
    await engine.write(1, random_bytes_at(3 * CHUNK, lead=64))
    first = [c.offset for c in engine._blobs[1].chunks]
    size = os.path.getsize(engine._files[0].path)
    await engine.delete(1)
    await engine.write(2, random_bytes_at(3 * CHUNK, lead=64, seed=3))
    assert [c.offset for c in engine._blobs[2].chunks] == first
    assert os.path.getsize(engine._files[0].path) == size


async def test_one_tensor_is_striped_chunk_by_chunk(tmp_path: Path, config: StoreConfig) -> None:
    engine = RawEngine(make_dirs(tmp_path, 2), config)
    try:
        src = random_bytes(6 * CHUNK + 17, seed=4)
        await engine.write(1, src)
        chunks = engine._blobs[1].chunks
        dirs = [c.file.path.parent for c in chunks]
        assert dirs[0::2] == [dirs[0]] * len(dirs[0::2])
        assert dirs[1::2] == [dirs[1]] * len(dirs[1::2])
        assert dirs[0] != dirs[1]
        for c in chunks:  # each chunk's bytes really are in that directory's file
            with open(c.file.path, "rb") as f:
                f.seek(c.offset + c.lead)
                assert f.read(c.length) == src[c.start : c.start + c.length].numpy().tobytes()
    finally:
        await engine.close()


async def test_the_file_grows_when_full(engine: RawEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_raw, "_GROW_MIN", CHUNK)
    srcs = [random_bytes(CHUNK * 5, seed=k) for k in range(6)]
    for k, t in enumerate(srcs):
        await engine.write(k, t)
    assert engine._files[0].extents.size >= 30 * CHUNK
    for k, t in enumerate(srcs):
        out = torch.empty_like(t)
        await engine.read(k, out)
        assert torch.equal(out, t)


async def test_many_writers_finding_the_file_full_grow_it_once(
    engine: RawEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # See Note: [One growth for many waiting writers].
    monkeypatch.setattr(_raw, "_GROW_MIN", 4 * CHUNK)
    monkeypatch.setattr(_raw, "_GROW_MAX", 16 * CHUNK)
    srcs = [random_bytes(CHUNK, seed=k) for k in range(64)]
    await asyncio.gather(*(engine.write(k, t) for k, t in enumerate(srcs)))
    # Doubling from 4 chunks: 4, 8, 16, then steps of 16 up to the 64 needed.
    assert engine._files[0].extents.size == 64 * CHUNK
    for k, t in enumerate(srcs):
        out = torch.empty_like(t)
        await engine.read(k, out)
        assert torch.equal(out, t)


async def test_enospc_surfaces_from_write_and_loses_nothing(
    engine: RawEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_raw, "_GROW_MIN", 4 * CHUNK)
    kept = random_bytes(CHUNK, seed=1)
    await engine.write(1, kept)
    assert engine._files[0].extents.size == 4 * CHUNK
    calls = []

    def full(fd: int, offset: int, length: int) -> None:
        calls.append(length)
        raise OSError(errno.ENOSPC, "No space left on device")

    real_fallocate = os.posix_fallocate
    monkeypatch.setattr(os, "posix_fallocate", full)
    size_before = engine._files[0].extents.size
    big = 3 * CHUNK + PAGE + 1  # needs 3 chunks and 2 pages: more than is free, less than a step
    with pytest.raises(OSError) as info:
        await engine.write(2, random_bytes_at(big, lead=64))
    assert info.value.errno == errno.ENOSPC
    assert calls == [4 * CHUNK, 3 * CHUNK + 2 * PAGE]  # the growth step, then just what it needs
    assert 2 not in engine._blobs
    assert engine._files[0].extents.size == size_before
    out = torch.empty_like(kept)
    await engine.read(1, out)
    assert torch.equal(out, kept)
    monkeypatch.setattr(os, "posix_fallocate", real_fallocate)
    await engine.write(2, random_bytes_at(big, lead=64))
    assert engine._files[0].extents.size == 8 * CHUNK


async def test_a_failed_write_frees_its_extents(
    engine: RawEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    await engine.write(1, random_bytes(10))
    free = engine._files[0].extents.free_bytes
    real = os.pwrite
    seen = []

    def failing(fd: int, data: memoryview, offset: int) -> int:
        seen.append(offset)
        if len(seen) == 2:
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", failing)
    with pytest.raises(OSError) as info:
        await engine.write(2, random_bytes(4 * CHUNK))
    assert info.value.errno == errno.EIO
    assert 2 not in engine._blobs
    assert engine._files[0].extents.free_bytes == free


async def test_short_writes_and_reads_are_retried(
    engine: RawEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Force every transfer to move at most one page, as a signal or a full pipe could.
    real_pwrite, real_preadv = os.pwrite, os.preadv

    def short_pwrite(fd: int, data: memoryview, offset: int) -> int:
        return real_pwrite(fd, data[:PAGE], offset)

    def short_preadv(fd: int, bufs: list[memoryview], offset: int) -> int:
        return real_preadv(fd, [bufs[0][:PAGE]], offset)

    monkeypatch.setattr(os, "pwrite", short_pwrite)
    monkeypatch.setattr(os, "preadv", short_preadv)
    src = random_bytes(2 * CHUNK + 5, seed=8)
    await engine.write(1, src)
    out = torch.empty_like(src)
    await engine.read(1, out)
    assert torch.equal(out, src)


async def test_checksum_none_skips_verification(tmp_path: Path, config: StoreConfig) -> None:
    engine = RawEngine(make_dirs(tmp_path, 1), config.replace(checksum="none"))
    try:
        src = random_bytes(CHUNK, seed=2)
        await engine.write(1, src)
        c = engine._blobs[1].chunks[0]
        with open(c.file.path, "r+b") as f:
            f.seek(c.offset + c.lead)
            f.write(bytes([src[0].item() ^ 0xFF]))
        out = torch.empty_like(src)
        await engine.read(1, out)  # no checksum, so the damage comes back undetected
        assert out[0].item() == src[0].item() ^ 0xFF
        assert engine.describe()["checksum"] == "none"
    finally:
        await engine.close()


async def test_a_damaged_byte_in_an_aligned_read_is_detected(engine: RawEngine) -> None:
    # Page-aligned tensors skip the bounce buffer; the checksum must cover that path too.
    import mmap

    buf = mmap.mmap(-1, 2 * CHUNK)
    try:
        aligned = torch.frombuffer(buf, dtype=torch.uint8)
        assert aligned.data_ptr() % PAGE == 0
        aligned.copy_(random_bytes(2 * CHUNK, seed=3))
        await engine.write(1, aligned)
        c = engine._blobs[1].chunks[1]
        with open(c.file.path, "r+b") as f:
            f.seek(c.offset + 5)
            f.write(b"\x00\x01")
        with pytest.raises(CorruptTensorError, match="CRC32C"):
            await engine.read(1, aligned)
    finally:
        del aligned
        buf.close()


# -- direct I/O --------------------------------------------------------------------------------


def _has_o_direct(engine: RawEngine) -> bool:
    return bool(fcntl.fcntl(engine._files[0].fd, fcntl.F_GETFL) & os.O_DIRECT)


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
        out = torch.empty_like(src)
        await engine.read(1, out)
        assert torch.equal(out, src)
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
        assert not engine._files[0].direct
        src = random_bytes(5 * CHUNK + 3, seed=7)
        await engine.write(1, src)
        out = torch.empty_like(src)
        await engine.read(1, out)
        assert torch.equal(out, src)
    finally:
        await engine.close()


async def test_big_blob_round_trip_with_default_chunks(tmp_path: Path) -> None:
    engine = RawEngine(make_dirs(tmp_path, 1), StoreConfig.from_env({}))
    try:
        src = random_bytes(9 * MiB + 1, seed=11)
        await engine.write(1, src)
        out = torch.empty_like(src)
        await engine.read(1, out)
        assert torch.equal(out, src)
    finally:
        await engine.close()


def _resident_pages(path: Path) -> int:
    """Pages of ``path`` in the page cache: ``mincore`` on a read-only mapping of it."""
    import ctypes
    import ctypes.util
    import mmap

    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert address not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
        try:
            vec = (ctypes.c_ubyte * (-(-size // PAGE)))()
            assert libc.mincore(address, size, vec) == 0, ctypes.get_errno()
            return sum(v & 1 for v in vec)
        finally:
            libc.munmap(address, size)
    finally:
        os.close(fd)


async def test_buffered_spilling_leaves_nothing_in_the_page_cache(
    tmp_path: Path, config: StoreConfig
) -> None:
    # Where O_DIRECT is off or refused, spilled pages are written back and dropped, so
    # spilling still frees memory (see _drop_cached).
    from tierstore.bench._system import filesystem_of

    if filesystem_of(tmp_path).split()[0] in {"tmpfs", "ramfs"}:
        pytest.skip("a memory filesystem keeps every page resident by design")
    engine = RawEngine(make_dirs(tmp_path, 1), config.replace(direct_io="off"))
    try:
        src = random_bytes(4 * CHUNK + 3, seed=12)
        await engine.write(1, src)
        path = engine._files[0].path
        assert _resident_pages(path) == 0
        out = torch.empty_like(src)
        await engine.read(1, out)
        assert torch.equal(out, src)
        assert _resident_pages(path) == 0
        # The probe itself can see cached pages: reading through the page cache fills it.
        with open(path, "rb") as f:
            f.read(CHUNK)
        assert _resident_pages(path) > 0
    finally:
        await engine.close()
