"""Tier backends: the disk engines (raw extents, zarr) and the host pool."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tierstore.tiers._engine import DiskEngine, WriteRequest

if TYPE_CHECKING:
    from pathlib import Path

    from tierstore.config import StoreConfig

__all__ = ["DiskEngine", "WriteRequest", "open_engine"]


def open_engine(directories: tuple[Path, ...], config: StoreConfig) -> DiskEngine:
    """The engine ``config.disk_format`` names, over ``directories``."""
    if config.disk_format == "zarr":
        from tierstore.tiers._zarr import ZarrEngine

        return ZarrEngine(directories, config)
    from tierstore.tiers._raw import RawEngine

    return RawEngine(directories, config)
