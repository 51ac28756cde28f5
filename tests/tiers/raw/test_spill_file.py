"""Spill files grow on demand, once for many waiting writers, and reuse freed extents."""

from __future__ import annotations

import asyncio
import errno
import os

import pytest

from tierstore.testing import CHUNK, random_bytes, random_bytes_at
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
