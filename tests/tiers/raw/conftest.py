"""The raw engine on one private directory, with small chunks; the bytes it copies."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tierstore.config import StoreConfig
from tierstore.testing import CHUNK, make_dirs
from tierstore.tiers.raw import RawEngine
from tierstore.tiers.raw import _chunk_io as chunk_io


@pytest.fixture
def config() -> StoreConfig:
    return StoreConfig.from_env({}, io_chunk_bytes=CHUNK, io_threads=4)


@pytest.fixture
async def engine(tmp_path: Path, config: StoreConfig) -> RawEngine:
    e = RawEngine(make_dirs(tmp_path, 1), config)
    yield e  # type: ignore[misc]
    await e.close()


@pytest.fixture
def copies(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Bytes the engine copies through its bounce buffers."""
    counted: list[int] = []
    real = chunk_io.memmove

    def counting(dst: int, src: int, nbytes: int) -> None:
        counted.append(nbytes)
        real(dst, src, nbytes)

    monkeypatch.setattr(chunk_io, "memmove", counting)
    yield counted
