"""Opening the disk tier: the private spill directories, the engine over them, the capacity."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tierstore._spilldir import SpillDirectory, check_parent, sweep_stale, warn_if_in_ram
from tierstore._stats import format_size
from tierstore.config import MAX_SIZE
from tierstore.core import _disk_room
from tierstore.tiers import open_engine

if TYPE_CHECKING:
    from tierstore.config import StoreConfig
    from tierstore.tiers import DiskEngine

__all__ = ["DiskTier", "disk_capacity", "open_disk_tier"]

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
        self.dirs = []

    def forget(self) -> None:
        """In a forked child: let go of the parent's directories without touching them."""
        for d in self.dirs:
            d.forget()
        self.dirs = []


def disk_capacity(config: StoreConfig) -> tuple[int, int]:
    """The disk tier's capacity a store opened now would have, and the free space it is
    capped at: ``disk_bytes`` (all the free space when None), never more than what is free
    for this user under the spill directories; 0 when ``disk_bytes`` is 0.

    ``python -m tierstore info`` shows it too, so the two agree.
    """
    if config.disk_bytes == 0:
        return 0, 0
    free = _disk_room.free_bytes(config.disk_dirs)
    return (free if config.disk_bytes is None else min(config.disk_bytes, free)), free


def open_disk_tier(config: StoreConfig) -> DiskTier:
    """Check the parents, sweep directories of dead processes, make this store's own, and
    open the engine over them (none when ``disk_bytes`` is 0). A parent on tmpfs or ramfs
    is warned about, once per directory.

    Raises:
        ConfigError: a parent is missing, not a directory, not writable, or too long a path.
        OSError: the engine cannot create its files.
    """
    for parent in config.disk_dirs:
        check_parent(parent)
        sweep_stale(parent)
    if config.disk_bytes == 0:
        return DiskTier([], None, 0)
    for parent in config.disk_dirs:
        warn_if_in_ram(parent)
    cap, free = disk_capacity(config)
    # "unlimited" asks for what the default gives: all the free space, no warning.
    if config.disk_bytes is not None and free < config.disk_bytes < MAX_SIZE:
        log.warning(
            "tierstore: disk_bytes/TIERSTORE_DISK_BYTES=%s is more than the %s free under %s; "
            "the disk tier is capped at the free space",
            format_size(config.disk_bytes),
            format_size(free),
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
