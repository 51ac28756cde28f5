"""One big blob is striped chunk by chunk over the spill directories."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tierstore.testing import CHUNK, make_dirs, random_bytes
from tierstore.tiers.raw import RawEngine

from .backdoor import blob_of as _blob

if TYPE_CHECKING:
    from tierstore.config import StoreConfig


async def test_one_tensor_is_striped_chunk_by_chunk(tmp_path: Path, config: StoreConfig) -> None:
    engine = RawEngine(make_dirs(tmp_path, 2), config)
    try:
        src = random_bytes(6 * CHUNK + 17, seed=4)
        await engine.write(1, src)
        chunks = _blob(engine, 1).chunks
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


async def test_an_empty_blob_leaves_a_full_directory_marked_full(
    tmp_path: Path, config: StoreConfig
) -> None:
    """Placing 0 bytes asked every full directory whether it had room for 0 bytes: each said
    yes, was marked as having room again, and the next real blob failed a growth there."""
    engine = RawEngine(make_dirs(tmp_path, 2), config)
    try:
        full = engine.files[1]
        full.full = True
        full.free_space = lambda: 0  # type: ignore[method-assign]
        await engine.write(1, torch.empty(0, dtype=torch.uint8))
        assert full.full
        assert engine.holds(1)
        out = torch.empty(0, dtype=torch.uint8)
        await engine.read(1, out)
    finally:
        await engine.close()
