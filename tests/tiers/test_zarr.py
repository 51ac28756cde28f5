"""The zarr engine: conformance, plus what a plain zarr reader sees."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

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
    from collections.abc import AsyncIterator
    from pathlib import Path

    from tierstore.tiers import DiskEngine


def _array_dir(engine: DiskEngine, key: int) -> Path:
    return engine.directories[key % len(engine.directories)] / GROUP / f"{key:016x}"


def _chunk_files(engine: DiskEngine, key: int) -> list[Path]:
    return sorted(p for p in (_array_dir(engine, key) / "c").rglob("*") if p.is_file())


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
