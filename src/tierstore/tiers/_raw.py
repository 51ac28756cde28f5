"""First, simple raw engine: one file per key, written and read with os.pwrite/os.preadv.

Correct but not yet tuned; the disk-speed work replaces it with preallocated extents and
O_DIRECT.
"""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from tierstore.errors import CorruptTensorError
from tierstore.tiers._engine import DiskEngine

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from tierstore.config import StoreConfig

__all__ = ["RawEngine"]


class RawEngine(DiskEngine):
    """One spill file per key, striped round-robin over the directories."""

    name = "raw"

    def __init__(self, directories: tuple[Path, ...], config: StoreConfig) -> None:
        super().__init__(directories, config)
        self._pool = ThreadPoolExecutor(config.io_threads, thread_name_prefix="tierstore-io")

    def _path(self, key: int) -> Path:
        return self.directories[key % len(self.directories)] / f"{key:016x}.bin"

    async def write(self, key: int, src: torch.Tensor) -> None:
        await asyncio.get_running_loop().run_in_executor(self._pool, _write, self._path(key), src)

    async def read(self, key: int, out: torch.Tensor) -> None:
        await asyncio.get_running_loop().run_in_executor(self._pool, _read, self._path(key), out)

    async def delete(self, key: int) -> None:
        self._path(key).unlink(missing_ok=True)

    async def close(self) -> None:
        self._pool.shutdown(wait=True)
        for d in self.directories:
            for p in d.glob("*.bin"):
                p.unlink(missing_ok=True)


def _write(path: Path, src: torch.Tensor) -> None:
    view = memoryview(src.numpy())  # type: ignore[arg-type]
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o600)
    try:
        done = 0
        while done < len(view):
            done += os.pwrite(fd, view[done:], done)
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    os.close(fd)


def _read(path: Path, out: torch.Tensor) -> None:
    view = memoryview(out.numpy())  # type: ignore[arg-type]
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        done = 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], done)
            if n == 0:
                raise CorruptTensorError(f"{path}: truncated at {done} of {len(view)} bytes")
            done += n
    finally:
        os.close(fd)
