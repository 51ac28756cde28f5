"""The raw engine's spill files read behind its back, for tests."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tierstore.tiers.raw._layout import Blob

if TYPE_CHECKING:
    import torch

    from tierstore.tiers import DiskEngine
    from tierstore.tiers.raw import RawEngine


def stored_bytes(engine: RawEngine, key: int) -> bytes:
    """The true bytes of ``key`` as they lie in the spill files, piece by piece.

    Each chunk's data starts ``lead`` bytes into its extent (Note: [A tensor's lead]).
    """
    parts = []
    for path, offset, length in engine.layout(key).pieces():
        with open(path, "rb") as f:
            f.seek(offset)
            parts.append(f.read(length))
    return b"".join(parts)


def blob_of(engine: DiskEngine, key: int) -> Blob:
    """The record of ``key``, a blob written alone (in chunks, not in a pack)."""
    from tierstore.tiers.raw import RawEngine

    assert isinstance(engine, RawEngine)
    blob = engine.layout(key)
    assert isinstance(blob, Blob)
    return blob


async def reads_back(engine: DiskEngine, key: int, src: torch.Tensor) -> bool:
    """Whether ``key`` read into a fresh tensor gives exactly the bytes of ``src``."""
    import torch

    out = torch.empty_like(src)
    await engine.read(key, out)
    return torch.equal(out, src)
