"""The raw engine: conformance, the blob records, checksums and failure paths."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from tierstore.config import StoreConfig
from tierstore.errors import CorruptTensorError
from tierstore.testing import CHUNK, EngineTests, MiB, make_dirs, random_bytes
from tierstore.tiers import open_engine
from tierstore.tiers.raw import RawEngine
from tierstore.tiers.raw._layout import PackedBlob
from tierstore.tiers.raw._syscalls import PAGE, pad

from .backdoor import blob_of as _blob
from .backdoor import reads_back, stored_bytes

if TYPE_CHECKING:
    from tierstore.tiers import DiskEngine


class TestRawEngine(EngineTests):
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


class TestRawEngineStriped(TestRawEngine):
    """Everything again with two directories: blobs of several chunks (past the suite's
    64 KiB chunk) are striped over both; smaller ones travel in packs, each pack in one
    directory, the directories taking turns."""

    n_dirs = 2


class TestRawEngineBuffered(TestRawEngine):
    """Everything again through the page cache (``direct_io="off"``), as on a filesystem
    without O_DIRECT: its own write and read paths, checksums included, which the runs above
    take only where O_DIRECT is refused."""

    @pytest.fixture
    def config(self) -> StoreConfig:
        return StoreConfig.from_env({}, io_chunk_bytes=CHUNK, io_threads=4, direct_io="off")


async def test_open_engine_picks_raw_by_default(tmp_path: Path) -> None:
    engine = open_engine(make_dirs(tmp_path, 1), StoreConfig.from_env({}))
    assert isinstance(engine, RawEngine)
    await engine.close()


async def test_offsets_and_extents_are_page_aligned(engine: RawEngine) -> None:
    for k, n in enumerate([1, 4095, 4097, 3 * CHUNK + 1]):
        await engine.write(k, random_bytes(n))
        blob = engine.layout(k)
        if isinstance(blob, PackedBlob):  # its one piece of a pack
            chunk_offsets, extents = [blob.offset], [(blob.offset, pad(blob.size))]
        else:
            chunk_offsets = [c.offset for c in blob.chunks]
            extents = [(offset, nbytes) for _, offset, nbytes in blob.extents]
        for offset in chunk_offsets:
            assert offset % PAGE == 0
        for offset, nbytes in extents:
            assert offset % PAGE == 0 and nbytes % PAGE == 0


async def test_true_size_and_padded_size_are_kept_apart(engine: RawEngine) -> None:
    # See Note: [True size and padded size]: the padding is zeros and is never returned.
    src = random_bytes(PAGE + 3, seed=9)
    await engine.write(1, src)
    ((path, offset, length),) = engine.layout(1).pieces()  # packed: its one piece
    assert length == PAGE + 3
    with open(path, "rb") as f:
        f.seek(offset)
        on_disk = f.read(2 * PAGE)
    assert on_disk[: PAGE + 3] == src.numpy().tobytes()
    if engine.files[0].direct:
        assert on_disk[PAGE + 3 :] == bytes(PAGE - 3)
    assert engine.footprint(PAGE + 3) == 2 * PAGE


async def test_a_failed_write_frees_its_extents(
    engine: RawEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    await engine.write(1, random_bytes(10))
    free = engine.files[0].extents.free_bytes
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
    assert not engine.holds(2)
    assert engine.files[0].extents.free_bytes == free


@pytest.mark.parametrize("nbytes", [10, 4 * CHUNK], ids=["packed", "several-chunks"])
async def test_a_buffered_write_that_fails_in_write_back_fails(
    tmp_path: Path, config: StoreConfig, monkeypatch: pytest.MonkeyPatch, nbytes: int
) -> None:
    """With buffered I/O a disk error shows only in the write-back (sync_file_range); the
    write must fail then, or the store trusts bytes the disk never took."""
    import ctypes

    from tierstore.tiers.raw import _syscalls

    engine = RawEngine(make_dirs(tmp_path, 1), config.replace(direct_io="off"))
    try:
        await engine.write(1, random_bytes(10))
        free = engine.files[0].extents.free_bytes

        def failing(fd: int, offset: int, n: int, flags: int) -> int:
            ctypes.set_errno(errno.EIO)
            return -1

        monkeypatch.setattr(_syscalls, "_SYNC_FILE_RANGE", failing)
        with pytest.raises(OSError) as info:
            await engine.write(2, random_bytes(nbytes))
        assert info.value.errno == errno.EIO
        assert not engine.holds(2)
        assert engine.files[0].extents.free_bytes == free
    finally:
        await engine.close()


class _ErrorSequence:
    """The kernel's write-back error reporting, as ``sync_file_range`` sees it: one error
    sequence per file, one cursor per open file description (here, per descriptor number,
    as the engine never duplicates one); a check reports what failed since its cursor.

    The first range checked is the one whose write-back fails; its check then waits until
    another thread's check has run, as happens when the I/O threads race.
    """

    def __init__(self) -> None:
        import threading

        self.errors = 0
        self.cursors: dict[int, int] = {}
        self.failed: list[tuple[int, int]] = []
        self.lock = threading.Lock()
        self.another_checked = threading.Event()

    def __call__(self, fd: int, offset: int, n: int, flags: int) -> int:
        import ctypes

        with self.lock:
            first = not self.failed
            if first:
                self.failed.append((offset, n))
                self.errors += 1
        if first:
            self.another_checked.wait(5)
        with self.lock:
            seen = self.cursors.get(fd, 0)
            self.cursors[fd] = self.errors
        if not first:
            self.another_checked.set()
        if seen != self.errors:
            ctypes.set_errno(errno.EIO)
            return -1
        return 0


async def test_a_failed_write_back_fails_its_write_whichever_thread_checks_first(
    tmp_path: Path, config: StoreConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Buffered writes: Linux reports a write-back error once per open file description. With
    one descriptor shared by the I/O threads, another thread's check took the error and the
    write whose pages had failed was trusted (Note: [Each thread checks write-back on its own
    descriptor])."""
    import asyncio

    from tierstore.tiers.raw import _syscalls

    kernel = _ErrorSequence()
    monkeypatch.setattr(_syscalls, "_SYNC_FILE_RANGE", kernel)
    settings = config.replace(direct_io="off", io_threads=4, io_chunk_bytes=2 * MiB)
    engine = RawEngine(make_dirs(tmp_path, 1), settings)
    try:
        # One chunk each, too big for a pack: each blob's write is checked alone.
        srcs = {k: random_bytes(MiB + PAGE, seed=k) for k in range(4)}
        outcomes = await asyncio.gather(
            *(engine.write(k, t) for k, t in srcs.items()), return_exceptions=True
        )
        assert kernel.another_checked.is_set(), "the checks did not race"
        ((bad, bad_n),) = kernel.failed
        for key, outcome in zip(srcs, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                assert isinstance(outcome, OSError) and outcome.errno == errno.EIO
                assert not engine.holds(key)
                continue
            for c in _blob(engine, key).chunks:
                end = c.offset + pad(c.lead + c.length)
                assert end <= bad or c.offset >= bad + bad_n, f"blob {key} trusted, unwritten"
    finally:
        await engine.close()


async def test_a_quota_on_the_growth_step_falls_back_to_the_exact_size(
    tmp_path: Path, config: StoreConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EDQUOT, like ENOSPC, on the file's growth step (up to 1 GiB) retries with just the
    blob's size before the directory counts as full."""
    engine = RawEngine(make_dirs(tmp_path, 1), config)
    try:
        real = os.posix_fallocate
        asked: list[int] = []

        def quota(fd: int, offset: int, length: int) -> None:
            asked.append(length)
            if length >= MiB:  # the growth step (64 MiB at first), not the blob's own size
                raise OSError(errno.EDQUOT, "Disk quota exceeded")
            real(fd, offset, length)

        monkeypatch.setattr(os, "posix_fallocate", quota)
        src = random_bytes(4 * CHUNK, seed=3)
        await engine.write(1, src)
        assert asked[0] >= MiB and asked[-1] < MiB
        out = torch.empty_like(src)
        await engine.read(1, out)
        assert torch.equal(out, src)
    finally:
        await engine.close()


def test_an_engine_that_cannot_map_its_buffers_leaves_nothing_open(
    tmp_path: Path, config: StoreConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tierstore.tiers.raw import _chunk_io

    made: list[_chunk_io.BounceBuffer] = []
    real = _chunk_io.BounceBuffer

    def third_fails(size: int) -> _chunk_io.BounceBuffer:
        if len(made) == 2:
            raise OSError(errno.ENOMEM, "Cannot allocate memory")
        made.append(real(size))
        return made[-1]

    monkeypatch.setattr(_chunk_io, "BounceBuffer", third_fails)
    dirs = make_dirs(tmp_path, 2)
    with pytest.raises(OSError, match="Cannot allocate memory"):
        RawEngine(dirs, config.replace(io_threads=4))
    open_files = {os.path.realpath(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")}
    assert not any(str(d) in path for d in dirs for path in open_files), open_files
    assert all(b._map.closed for b in made)


async def test_checksum_none_skips_verification(tmp_path: Path, config: StoreConfig) -> None:
    engine = RawEngine(make_dirs(tmp_path, 1), config.replace(checksum="none"))
    try:
        src = random_bytes(CHUNK, seed=2)
        await engine.write(1, src)
        ((path, offset, _),) = engine.layout(1).pieces()
        with open(path, "r+b") as f:
            f.seek(offset)
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
        c = _blob(engine, 1).chunks[1]
        with open(c.file.path, "r+b") as f:
            f.seek(c.offset + 5)
            f.write(b"\x00\x01")
        with pytest.raises(CorruptTensorError, match="CRC32C"):
            await engine.read(1, aligned)
    finally:
        del aligned
        buf.close()


async def test_big_blob_round_trip_with_default_chunks(tmp_path: Path) -> None:
    engine = RawEngine(make_dirs(tmp_path, 1), StoreConfig.from_env({}))
    try:
        src = random_bytes(9 * MiB + 1, seed=11)
        await engine.write(1, src)
        assert await reads_back(engine, 1, src)
    finally:
        await engine.close()
