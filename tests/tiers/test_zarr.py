"""The zarr engine: conformance, plus what a plain zarr reader sees."""

from __future__ import annotations

import asyncio
import json
import math
import os
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import torch
import zarr

from tierstore.config import StoreConfig
from tierstore.errors import CorruptTensorError
from tierstore.testing import CHUNK, EngineTests, make_dirs, random_bytes
from tierstore.tiers import open_engine
from tierstore.tiers._zarr import GROUP, ZarrEngine

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable
    from pathlib import Path

    from tierstore.tiers import DiskEngine


def _array_dir(engine: DiskEngine, key: int) -> Path:
    return engine.directories[key % len(engine.directories)] / GROUP / f"{key:016x}"


def _chunk_files(engine: DiskEngine, key: int) -> list[Path]:
    """The array's chunk files (``c.<i>.<j>...``, Note: [Chunk files side by side]), in
    chunk order."""
    files = _array_dir(engine, key).glob("c.*")
    return sorted(files, key=lambda p: [int(i) for i in p.name.split(".")[1:]])


def _bytes_taken(array_dir: Path) -> int:
    """Every block the array takes on disk, its directories' included (Note: [Chunk files
    side by side])."""
    taken = [array_dir, *array_dir.rglob("*")]
    return sum(max(p.stat().st_blocks * 512, -(-p.stat().st_size // 4096) * 4096) for p in taken)


class TestZarrEngine(EngineTests):
    engine_class = ZarrEngine

    def backdoor_read(self, engine: DiskEngine, key: int) -> bytes:
        array = zarr.open_array(str(_array_dir(engine, key)), mode="r")
        return np.ascontiguousarray(array[...]).tobytes()

    def damage_byte(self, engine: DiskEngine, key: int) -> None:
        path = _chunk_files(engine, key)[-1]
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))

    def truncate(self, engine: DiskEngine, key: int) -> None:
        path = _chunk_files(engine, key)[-1]
        os.truncate(path, path.stat().st_size // 2)

    def dirs_holding(self, engine: DiskEngine, key: int) -> set[Path]:
        return {d for d in engine.directories if (d / GROUP / f"{key:016x}").is_dir()}


@pytest.fixture
async def engine(tmp_path: Path) -> AsyncIterator[ZarrEngine]:
    e = ZarrEngine(make_dirs(tmp_path, 1), StoreConfig.from_env({}, io_chunk_bytes=CHUNK))
    yield e
    await e.close()


def test_open_engine_picks_zarr(tmp_path: Path) -> None:
    engine = open_engine(make_dirs(tmp_path, 1), StoreConfig.from_env({}, disk_format="zarr"))
    assert isinstance(engine, ZarrEngine)


async def test_a_typed_tensor_is_a_typed_array(engine: ZarrEngine) -> None:
    t = torch.randn(40, 3, 5)
    await engine.write(1, t.view(-1).view(torch.uint8), dtype=t.dtype, shape=tuple(t.shape))
    array = zarr.open_array(str(_array_dir(engine, 1)), mode="r")
    assert array.dtype == np.float32 and array.shape == (40, 3, 5)
    assert np.array_equal(array[...], t.numpy())
    assert array.attrs["torch_dtype"] == "torch.float32"
    assert array.metadata.codecs[-1].to_dict()["name"] == "crc32c"


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2, torch.float16]
)
async def test_dtypes_zarr_lacks_are_raw_bytes_and_bit_exact(
    engine: ZarrEngine, dtype: torch.dtype
) -> None:
    t = (torch.randn(33, 7) * 100).to(dtype)
    raw = t.view(-1).view(torch.uint8)
    await engine.write(1, raw, dtype=dtype, shape=tuple(t.shape))
    array = zarr.open_array(str(_array_dir(engine, 1)), mode="r")
    assert array.attrs["torch_dtype"] == str(dtype)
    assert array.attrs["shape"] == [33, 7]
    if dtype == torch.float16:
        assert array.dtype == np.float16
    else:
        assert array.dtype == np.uint8
    out = torch.empty_like(raw)
    await engine.read(1, out)
    assert torch.equal(out, raw)
    back = out.view(dtype).view(t.shape)
    assert torch.equal(back.view(torch.uint8), t.view(torch.uint8))


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [
        ((8 * CHUNK + 4096,), torch.uint8),  # flat bytes just over a chunk multiple
        ((2 * CHUNK // 4 + 1,), torch.float32),
        ((9, CHUNK // 8), torch.float32),  # 9 rows of half a chunk
        ((5, 3, CHUNK // 12 + 1), torch.float32),  # rows of odd size: stored flat
        ((3, 2 * CHUNK // 8), torch.float64),  # rows over a chunk: a chunk each
        ((17, 1000), torch.complex128),
        ((9, 2, 4, CHUNK // 64), torch.float32),  # rows of half a chunk, 4 dimensions
        ((CHUNK + 1,), torch.bfloat16),  # raw bytes
    ],
)
async def test_the_footprint_covers_what_the_files_take(
    engine: ZarrEngine, shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    """Note: [Edge chunks are written whole]: zarr pads the last chunk to the full chunk
    size, so chunks of ``io_chunk_bytes // row`` rows made a flat 8 chunks + 4 KiB tensor
    take 9 chunks, nearly a whole chunk more than the footprint counted. The directories
    count too (Note: [Chunk files side by side])."""
    t = (
        torch.randn(shape, dtype=torch.float64).to(dtype)
        if dtype != torch.uint8
        else (random_bytes(math.prod(shape), seed=3))
    )
    raw = t.contiguous().view(-1).view(torch.uint8)
    await engine.write(1, raw, dtype=dtype, shape=tuple(shape))
    array_dir = _array_dir(engine, 1)
    files = [p for p in array_dir.rglob("*") if p.is_file()]
    # Its directories' blocks count (Note: [Chunk files side by side]: zarr's default keys
    # nested each chunk of a 3-d array two directories deep).
    on_disk = _bytes_taken(array_dir)
    assert on_disk <= engine.footprint(raw.numel()), (on_disk, engine.footprint(raw.numel()))
    data = sum(p.stat().st_size for p in files if p.name != "zarr.json")
    assert data <= raw.numel() + 20 * len(files)  # data, checksums and < 16 B padding a chunk
    array = zarr.open_array(str(_array_dir(engine, 1)), mode="r")
    assert array.attrs["shape"] == list(shape)
    out = torch.empty_like(raw)
    await engine.read(1, out)
    assert torch.equal(out, raw)


async def test_the_footprint_counts_the_blocks_of_the_arrays_directory(tmp_path: Path) -> None:
    """Every chunk file of an array lies in the array's directory (Note: [Chunk files side by
    side]), and 256 of them fill more than a block of directory entries. Counted without the
    directory, the footprint of such an array came short of the blocks it takes, and the
    disk tier took more than ``disk_bytes``."""
    engine = ZarrEngine(make_dirs(tmp_path, 1), StoreConfig.from_env({}, io_chunk_bytes=4096))
    try:
        # Rows of 16 bytes, 256 to a chunk: each chunk file is a block and the 4 bytes of its
        # checksum, two blocks, and the last chunk is padded with 255 rows. The chunk files
        # and zarr.json take all but one block of what the footprint counts besides the
        # directory, whose entries (c.<i>.0.0.0) take two blocks or more.
        chunks = 256
        shape = (chunks * 256 - (chunks - 1), 1, 1, 1)
        t = torch.randn(shape, dtype=torch.complex128)
        raw = t.view(-1).view(torch.uint8)
        await engine.write(1, raw, dtype=t.dtype, shape=shape)
        assert len(_chunk_files(engine, 1)) == chunks
        on_disk = _bytes_taken(_array_dir(engine, 1))
        assert on_disk <= engine.footprint(raw.numel()), (on_disk, engine.footprint(raw.numel()))
        out = torch.empty_like(raw)
        await engine.read(1, out)
        assert torch.equal(out, raw)
    finally:
        await engine.close()


async def test_writes_running_when_the_engine_closes_do_not_report_stored(
    engine: ZarrEngine,
) -> None:
    """``close`` removes the groups once the threads are done; a write that was running
    returned None ("stored") for an array that no longer existed."""
    src = random_bytes(4 * CHUNK, seed=5)
    writes = [asyncio.ensure_future(engine.write(10 + i, src)) for i in range(4)]
    await asyncio.sleep(0)  # each write has handed its array to a thread
    await engine.close()
    outcomes = await asyncio.gather(*writes, return_exceptions=True)
    assert all(isinstance(o, RuntimeError) for o in outcomes), outcomes


async def test_an_array_left_by_a_write_cancelled_twice_is_replaced(engine: ZarrEngine) -> None:
    """A second cancel skips the removal of what a cancelled write made; the next write of
    that key raised zarr's ContainsArrayError, not an OSError the store understands."""
    src = random_bytes(3 * CHUNK, seed=6)
    engine._write(2, random_bytes(3 * CHUNK, seed=7), None, None, 0)  # the orphan
    await engine.write(2, src)
    out = torch.empty_like(src)
    await engine.read(2, out)
    assert torch.equal(out, src)


async def test_nan_payloads_survive(engine: ZarrEngine) -> None:
    bits = torch.tensor([0x7FC00001, 0xFFF00002, 0x7F800001], dtype=torch.int64).to(torch.int32)
    t = bits.view(torch.float32)
    raw = t.view(torch.uint8)
    await engine.write(1, raw, dtype=torch.float32, shape=(3,))
    out = torch.empty_like(raw)
    await engine.read(1, out)
    assert torch.equal(out, raw)


async def test_a_missing_chunk_file_is_detected(engine: ZarrEngine) -> None:
    src = random_bytes(3 * CHUNK, seed=1)
    await engine.write(1, src)
    _chunk_files(engine, 1)[1].unlink()
    with pytest.raises(CorruptTensorError, match="lost 1"):
        await engine.read(1, torch.empty_like(src))


def _set_byte_order(meta: dict[str, Any], order: str) -> None:
    for codec in meta["codecs"]:
        if codec["name"] == "bytes":
            codec["configuration"]["endian"] = order


def _set_dtype(meta: dict[str, Any], dtype: str) -> None:
    meta["data_type"] = dtype


@pytest.mark.parametrize("edit", [_set_byte_order, _set_dtype], ids=["byte order", "dtype"])
async def test_an_edited_zarr_json_is_detected(
    engine: ZarrEngine, edit: Callable[[dict[str, Any], str], None]
) -> None:
    """Note: [The metadata is checked too]: the checksums cover the chunks, not how to decode
    them. An edited byte order read intact chunks back as other values, no error; an edited
    dtype happens to give back the same bytes here, but any zarr reader sees another array,
    so it is refused too."""
    t = torch.randn(3 * CHUNK // 4)
    raw = t.view(torch.uint8)
    await engine.write(1, raw, dtype=torch.float32, shape=tuple(t.shape))
    path = _array_dir(engine, 1) / "zarr.json"
    meta = json.loads(path.read_text())
    edit(meta, "big" if edit is _set_byte_order else "int32")
    path.write_text(json.dumps(meta))
    with pytest.raises(CorruptTensorError, match=r"zarr\.json changed"):
        await engine.read(1, torch.empty_like(raw))


async def test_a_full_directory_is_skipped_until_it_has_room(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Note: [A full directory is skipped here too]: with the first of two directories full
    (ENOSPC part way through an array), every array goes to the second, with one warning and
    nothing left behind in the first; once the first has room, its own keys go there again."""
    import errno
    import logging

    from tierstore.tiers import _zarr

    engine = ZarrEngine(make_dirs(tmp_path, 2), StoreConfig.from_env({}, io_chunk_bytes=CHUNK))
    first = engine.directories[0] / GROUP
    full = {"yes": True}
    real_write, real_free = ZarrEngine._write, _zarr.free_space

    def write(self: ZarrEngine, key: int, src: torch.Tensor, *args: object) -> object:
        home = args[-1]
        if full["yes"] and home == 0:
            (first / f"{key:016x}").mkdir()  # what a write makes before the disk fills
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(self, key, src, *args)  # type: ignore[arg-type]

    def free_bytes(path: Path) -> int:
        return 0 if full["yes"] and path == first else real_free(path)

    monkeypatch.setattr(ZarrEngine, "_write", write)
    monkeypatch.setattr(_zarr, "free_space", free_bytes)
    srcs = {k: random_bytes(3 * CHUNK + k, seed=k) for k in range(8)}
    try:
        with caplog.at_level(logging.WARNING, logger="tierstore"):
            for k, t in srcs.items():
                await engine.write(k, t)
        warned = [r.getMessage() for r in caplog.records]
        assert len(warned) == 1 and f"spill directory {engine.directories[0]} is full" in warned[0]
        assert list(first.glob("0*")) == []  # the partial arrays were removed
        for k, t in srcs.items():
            out = torch.empty_like(t)
            await engine.read(k, out)
            assert torch.equal(out, t)
        await engine.delete(0)
        assert not (engine.directories[1] / GROUP / f"{0:016x}").exists()
        full["yes"] = False  # space came back
        await engine.write(10, random_bytes(100))
        assert (first / f"{10:016x}").is_dir()

        # Every directory full: the write fails with ENOSPC, and nothing is stored.
        def no_room(*args: object) -> None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(ZarrEngine, "_write", no_room)
        with pytest.raises(OSError) as info:
            await engine.write(11, random_bytes(100))
        assert info.value.errno == errno.ENOSPC
        with pytest.raises(KeyError):
            await engine.read(11, torch.empty(100, dtype=torch.uint8))
    finally:
        await engine.close()


@pytest.mark.parametrize("code", ["EDQUOT", "EIO"])
async def test_a_directory_over_its_quota_is_not_retried_at_every_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: str
) -> None:
    """EDQUOT: ``statvfs`` shows the filesystem free, so the directory marked full was tried
    again by every array keyed to it, each writing its chunks, failing and being removed. It
    is now skipped for QUOTA_RETRY_SECONDS, then tried once. A failing one (EIO) too: its
    error failed the write, though the other directory had room."""
    import errno
    import time

    from tierstore.tiers import _zarr

    engine = ZarrEngine(make_dirs(tmp_path, 2), StoreConfig.from_env({}, io_chunk_bytes=CHUNK))
    tried: list[int] = []
    real_write = ZarrEngine._write

    def write(self: ZarrEngine, key: int, src: torch.Tensor, *args: object) -> object:
        if args[-1] == 0:
            tried.append(key)
            number = getattr(errno, code)
            raise OSError(number, os.strerror(number))
        return real_write(self, key, src, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(ZarrEngine, "_write", write)
    monkeypatch.setattr(_zarr, "QUOTA_RETRY_SECONDS", 0.3)
    srcs = {k: random_bytes(3 * CHUNK + k, seed=k) for k in range(10)}
    try:
        for k, t in srcs.items():
            await engine.write(k, t)
        assert tried == [0], f"the directory over its quota was tried for keys {tried}"
        time.sleep(0.35)
        await engine.write(20, random_bytes(100))  # its home is directory 0: tried again
        assert tried == [0, 20]
        for k, t in srcs.items():
            out = torch.empty_like(t)
            await engine.read(k, out)
            assert torch.equal(out, t)
    finally:
        await engine.close()
