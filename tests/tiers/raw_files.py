"""The raw engine's spill files read behind its back, for tests."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tierstore.tiers._raw import RawEngine


def stored_bytes(engine: RawEngine, key: int) -> bytes:
    """The true bytes of ``key`` as they lie in the spill files, chunk by chunk.

    Each chunk's data starts ``lead`` bytes into its extent (Note: [A tensor's lead]).
    """
    parts = []
    for c in engine._blobs[key].chunks:
        with open(c.file.path, "rb") as f:
            f.seek(c.offset + c.lead)
            parts.append(f.read(c.length))
    return b"".join(parts)
