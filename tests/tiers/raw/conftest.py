"""The raw engine on one private directory, with small chunks."""

from __future__ import annotations

from pathlib import Path

import pytest

from tierstore.config import StoreConfig
from tierstore.testing import CHUNK, make_dirs
from tierstore.tiers.raw import RawEngine


@pytest.fixture
def config() -> StoreConfig:
    return StoreConfig.from_env({}, io_chunk_bytes=CHUNK, io_threads=4)


@pytest.fixture
async def engine(tmp_path: Path, config: StoreConfig) -> RawEngine:
    e = RawEngine(make_dirs(tmp_path, 1), config)
    yield e  # type: ignore[misc]
    await e.close()
