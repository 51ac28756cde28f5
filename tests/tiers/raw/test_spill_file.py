"""Spill files grow on demand, once for many waiting writers, and reuse freed extents."""

from __future__ import annotations

import asyncio
import errno
import os
from pathlib import Path

import pytest

from tierstore.config import StoreConfig
from tierstore.testing import CHUNK, make_dirs, random_bytes, random_bytes_at
from tierstore.tiers.raw import RawEngine
from tierstore.tiers.raw import _spill_file as spill_file
from tierstore.tiers.raw._syscalls import PAGE

from .backdoor import blob_of as _blob
from .backdoor import reads_back


async def test_freed_extent_is_reused_at_the_same_offset(engine: RawEngine) -> None:
    await engine.write(1, random_bytes_at(3 * CHUNK, lead=64))
    first = [c.offset for c in _blob(engine, 1).chunks]
    size = os.path.getsize(engine.files[0].path)
    await engine.delete(1)
    await engine.write(2, random_bytes_at(3 * CHUNK, lead=64, seed=3))
    assert [c.offset for c in _blob(engine, 2).chunks] == first
    assert os.path.getsize(engine.files[0].path) == size


async def test_the_file_grows_when_full(engine: RawEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spill_file, "GROW_MIN", CHUNK)
    srcs = [random_bytes(CHUNK * 5, seed=k) for k in range(6)]
    for k, t in enumerate(srcs):
        await engine.write(k, t)
    assert engine.files[0].extents.size >= 30 * CHUNK
    assert all([await reads_back(engine, k, t) for k, t in enumerate(srcs)])


async def test_many_writers_finding_the_file_full_grow_it_once(
    engine: RawEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # See Note: [One growth for many waiting writers].
    monkeypatch.setattr(spill_file, "GROW_MIN", 4 * CHUNK)
    monkeypatch.setattr(spill_file, "GROW_MAX", 16 * CHUNK)
    srcs = [random_bytes(CHUNK, seed=k) for k in range(64)]
    await asyncio.gather(*(engine.write(k, t) for k, t in enumerate(srcs)))
    # Doubling from 4 chunks: 4, 8, 16, then steps of 16 up to the 64 needed.
    assert engine.files[0].extents.size == 64 * CHUNK
    assert all([await reads_back(engine, k, t) for k, t in enumerate(srcs)])


async def test_enospc_surfaces_from_write_and_loses_nothing(
    engine: RawEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(spill_file, "GROW_MIN", 4 * CHUNK)
    kept = random_bytes(CHUNK, seed=1)
    await engine.write(1, kept)
    assert engine.files[0].extents.size == 4 * CHUNK
    calls = []

    def full(fd: int, offset: int, length: int) -> None:
        calls.append(length)
        raise OSError(errno.ENOSPC, "No space left on device")

    real_fallocate = os.posix_fallocate
    monkeypatch.setattr(os, "posix_fallocate", full)
    size_before = engine.files[0].extents.size
    big = 3 * CHUNK + PAGE + 1  # needs 3 chunks and 2 pages: more than is free, less than a step
    with pytest.raises(OSError) as info:
        await engine.write(2, random_bytes_at(big, lead=64))
    assert info.value.errno == errno.ENOSPC
    assert calls == [4 * CHUNK, 3 * CHUNK + 2 * PAGE]  # the growth step, then just what it needs
    assert not engine.holds(2)
    assert engine.files[0].extents.size == size_before
    assert await reads_back(engine, 1, kept)
    monkeypatch.setattr(os, "posix_fallocate", real_fallocate)
    await engine.write(2, random_bytes_at(big, lead=64))
    assert engine.files[0].extents.size == 8 * CHUNK


@pytest.mark.parametrize("dirs", [1, 2])
async def test_a_capped_disk_tier_reserves_no_more_than_its_capacity(
    tmp_path: Path, dirs: int
) -> None:
    """Growth doubled from 64 MiB whatever ``disk_bytes`` said: a store capped at 2 MiB
    reserved a 64 MiB file, space other processes on the disk could not use. Each file now
    reserves ahead only up to its share, and past it grows by exactly what a blob needs."""
    cap = 8 * CHUNK
    config = StoreConfig.from_env({}, io_chunk_bytes=CHUNK, io_threads=4, disk_bytes=cap)
    engine = RawEngine(make_dirs(tmp_path, dirs), config)
    try:
        srcs = {k: random_bytes(CHUNK, seed=k) for k in range(8)}
        for k, t in srcs.items():
            await engine.write(k, t)
        for f in engine.files:
            assert f.extents.size == cap // dirs
            assert os.stat(f.path).st_blocks * 512 <= cap // dirs
        # Two one-chunk holes, then a blob of three chunks that fits in neither.
        for k in (1, 3):
            await engine.delete(k)
            del srcs[k]
        srcs[9] = random_bytes(3 * CHUNK, seed=9)
        await engine.write(9, srcs[9])
        # (a page more where the source starts inside a page: Note: [A tensor's lead])
        assert cap < sum(f.extents.size for f in engine.files) <= cap + 3 * CHUNK + PAGE
        assert all([await reads_back(engine, k, t) for k, t in srcs.items()])
    finally:
        await engine.close()


async def test_a_descriptor_closed_twice_closes_nothing_the_second_time(
    engine: RawEngine,
) -> None:
    """A forked child forgets the spill files of a close its parent had under way, which may
    have closed them already: the number, reused meanwhile, named another file (a pipe to
    a data loader's worker), which the second close shut."""
    await engine.write(1, random_bytes(CHUNK))
    f = engine.files[0]
    engine.files[0].writeback_fd()  # a per-thread descriptor too
    number = f.fd
    f.close_descriptor()
    read_end, write_end = os.pipe()
    try:
        assert number in (read_end, write_end)  # the lowest free number, reused at once
        f.close_descriptor()
        os.write(write_end, b"x")
        assert os.read(read_end, 1) == b"x"
    finally:
        os.close(read_end)
        os.close(write_end)
    await engine.close()
