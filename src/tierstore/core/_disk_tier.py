"""Opening the disk tier: the private spill directories, the engine over them, the capacity."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tierstore._spilldir import SpillDirectory, check_parent, sweep_stale
from tierstore.core import _disk_room
from tierstore.tiers import open_engine

if TYPE_CHECKING:
    from tierstore.config import StoreConfig
    from tierstore.tiers import DiskEngine

__all__ = ["DiskTier", "open_disk_tier"]

log = logging.getLogger("tierstore")


@dataclass(slots=True)
class DiskTier:
    """What a store spills into."""

    dirs: list[SpillDirectory]
    """The private spill directories (none without a disk tier)."""
    engine: DiskEngine | None
    """The engine over them, or None: the disk tier is off."""
    capacity: int
    """``disk_bytes``, capped at the free space found at start."""

    def remove(self) -> None:
        """Delete the spill directories (needs no loop: the exit hook calls it too)."""
        for d in self.dirs:
            d.remove()

    def forget(self) -> None:
        """In a forked child: let go of the parent's directories without touching them."""
        for d in self.dirs:
            d.forget()
        self.dirs = []


def open_disk_tier(config: StoreConfig) -> DiskTier:
    """Check the parents, sweep directories of dead processes, make this store's own, and
    open the engine over them (none when ``disk_bytes`` is 0).

    Raises:
        ConfigError: a parent is missing, not a directory, not writable, or too long a path.
        OSError: the engine cannot create its files.
    """
    for parent in config.disk_dirs:
        check_parent(parent)
        sweep_stale(parent)
    if config.disk_bytes == 0:
        return DiskTier([], None, 0)
    free = _disk_room.free_bytes(config.disk_dirs)
    cap = free if config.disk_bytes is None else min(config.disk_bytes, free)
    if config.disk_bytes is not None and config.disk_bytes > free:
        log.warning(
            "tierstore: TIERSTORE_DISK_BYTES=%d is more than the %d bytes free under %s; "
            "the disk tier is capped at the free space",
            config.disk_bytes,
            free,
            os.pathsep.join(map(str, config.disk_dirs)),
        )
    dirs: list[SpillDirectory] = []
    try:
        for p in config.disk_dirs:  # one by one: a failure removes those made before it
            dirs.append(SpillDirectory(p))
        engine = open_engine(tuple(d.path for d in dirs), config)
    except BaseException:
        for d in dirs:
            d.remove()
        raise
    return DiskTier(dirs, engine, cap)
