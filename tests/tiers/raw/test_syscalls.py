"""Short transfers are retried; buffered spilling leaves nothing in the page cache."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tierstore.testing import CHUNK, make_dirs, random_bytes
from tierstore.tiers.raw import RawEngine
from tierstore.tiers.raw._syscalls import PAGE

from .backdoor import reads_back

if TYPE_CHECKING:
    from tierstore.config import StoreConfig


async def test_short_writes_and_reads_are_retried(
    engine: RawEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Force every transfer to move at most one page, as a signal or a full pipe could.
    real_pwrite, real_preadv = os.pwrite, os.preadv

    def short_pwrite(fd: int, data: memoryview, offset: int) -> int:
        return real_pwrite(fd, data[:PAGE], offset)

    def short_preadv(fd: int, bufs: list[memoryview], offset: int) -> int:
        return real_preadv(fd, [bufs[0][:PAGE]], offset)

    monkeypatch.setattr(os, "pwrite", short_pwrite)
    monkeypatch.setattr(os, "preadv", short_preadv)
    src = random_bytes(2 * CHUNK + 5, seed=8)
    await engine.write(1, src)
    assert await reads_back(engine, 1, src)


def _resident_pages(path: Path) -> int:
    """Pages of ``path`` in the page cache: ``mincore`` on a read-only mapping of it."""
    import ctypes
    import ctypes.util
    import mmap

    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert address not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
        try:
            vec = (ctypes.c_ubyte * (-(-size // PAGE)))()
            assert libc.mincore(address, size, vec) == 0, ctypes.get_errno()
            return sum(v & 1 for v in vec)
        finally:
            libc.munmap(address, size)
    finally:
        os.close(fd)


async def test_buffered_spilling_leaves_nothing_in_the_page_cache(
    tmp_path: Path, config: StoreConfig
) -> None:
    # Where O_DIRECT is off or refused, spilled pages are written back and dropped, so
    # spilling still frees memory (see drop_cached).
    from tierstore.bench._system import filesystem_of

    if filesystem_of(tmp_path).split()[0] in {"tmpfs", "ramfs"}:
        pytest.skip("a memory filesystem keeps every page resident by design")
    engine = RawEngine(make_dirs(tmp_path, 1), config.replace(direct_io="off"))
    try:
        src = random_bytes(4 * CHUNK + 3, seed=12)
        await engine.write(1, src)
        path = engine.files[0].path
        assert _resident_pages(path) == 0
        assert await reads_back(engine, 1, src)
        assert _resident_pages(path) == 0
        # The probe itself can see cached pages: reading through the page cache fills it.
        with open(path, "rb") as f:
            f.read(CHUNK)
        assert _resident_pages(path) > 0
    finally:
        await engine.close()
