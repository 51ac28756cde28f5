"""The tiers below the device: the disk engines and their registry, the host pools, and the
device runtime seam."""

from __future__ import annotations

from tierstore.tiers._engine import (
    DiskEngine,
    WriteRequest,
    engine_class,
    engine_names,
    open_engine,
)

__all__ = ["DiskEngine", "WriteRequest", "engine_class", "engine_names", "open_engine"]
