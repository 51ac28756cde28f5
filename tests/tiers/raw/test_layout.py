"""The raw engine moves a tensor 64 bytes past a page straight from and to its pages.

See Note: [A tensor's lead]. The memory here sits between two ``PROT_NONE``
guard pages, so a transfer that reaches past the pages holding the tensor fails (EFAULT) and a
copy past them crashes, instead of going unnoticed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from typing import TYPE_CHECKING

import pytest
import torch

from tierstore.config import StoreConfig
from tierstore.errors import CorruptTensorError
from tierstore.testing import CHUNK, make_dirs, random_bytes
from tierstore.tiers.raw import RawEngine
from tierstore.tiers.raw import _syscalls as syscalls
from tierstore.tiers.raw._syscalls import PAGE

from .backdoor import stored_bytes

if TYPE_CHECKING:
    from collections.abc import AsyncIterator
    from pathlib import Path

_PROT_NONE = 0

SIZE = 3 * CHUNK + 100
"""Several chunks and a tail that ends inside a page."""

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


class _Guarded:
    """``npages`` of memory with an inaccessible page on each side."""

    def __init__(self, npages: int) -> None:
        self.map = mmap.mmap(-1, (npages + 2) * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.map.write(b"\xaa" * len(self.map))
        start = ctypes.addressof(ctypes.c_char.from_buffer(self.map))
        for guard in (start, start + (npages + 1) * PAGE):
            if _libc.mprotect(guard, PAGE, _PROT_NONE) != 0:
                raise OSError(ctypes.get_errno(), "mprotect")

    def tensor(self, offset: int, nbytes: int) -> torch.Tensor:
        """``nbytes`` starting ``offset`` bytes into the first usable page."""
        return torch.frombuffer(self.map, dtype=torch.uint8, count=nbytes, offset=PAGE + offset)

    def around(self, offset: int, nbytes: int) -> bytes:
        """The bytes sharing a page with ``tensor(offset, nbytes)`` but outside it."""
        end = PAGE + offset + nbytes
        return self.map[PAGE : PAGE + offset] + self.map[end : -(-end // PAGE) * PAGE]


def _guarded(offset: int, nbytes: int) -> _Guarded:
    return _Guarded(-(-(offset + nbytes) // PAGE))


@pytest.fixture
async def engine(tmp_path: Path) -> AsyncIterator[RawEngine]:
    e = RawEngine(make_dirs(tmp_path, 1), StoreConfig.from_env({}, io_chunk_bytes=CHUNK))
    if not all(e.describe()["direct_io"].values()):  # type: ignore[union-attr]
        await e.close()
        pytest.skip(f"{tmp_path} refuses O_DIRECT: buffered I/O takes any address, no lead")
    yield e
    await e.close()


async def _write(engine: RawEngine, offset: int, seed: int = 0) -> torch.Tensor:
    """Write ``SIZE`` random bytes from ``offset`` past a guarded page under key 1."""
    memory = _guarded(offset, SIZE)
    src = memory.tensor(offset, SIZE)
    src.copy_(random_bytes(SIZE, seed=seed))
    await engine.write(1, src)
    return src.clone()


async def test_a_tensor_64_bytes_past_a_page_is_written_from_its_own_pages(
    engine: RawEngine, copies: list[int]
) -> None:
    src = await _write(engine, 64)
    blob = engine.layout(1)
    assert blob.lead == 64
    assert copies == []  # no bounce buffer, and the guard pages were never touched
    assert stored_bytes(engine, 1) == src.numpy().tobytes()
    assert [(c.start, c.length, c.lead) for c in blob.chunks] == [
        (0, CHUNK - 64, 64),
        (CHUNK - 64, CHUNK, 0),
        (2 * CHUNK - 64, CHUNK, 0),
        (3 * CHUNK - 64, 164, 0),
    ]
    assert sum(nbytes for _, _, nbytes in blob.extents) == 3 * CHUNK + PAGE
    assert sum(nbytes for _, _, nbytes in blob.extents) <= engine.footprint(SIZE)


async def test_read_window_gives_the_lead_and_a_read_lands_there_without_a_copy(
    engine: RawEngine, copies: list[int]
) -> None:
    src = await _write(engine, 64, seed=1)
    lead, span = engine.read_window(1, SIZE)
    assert (lead, span) == (64, -(-(64 + SIZE) // PAGE) * PAGE)
    out = _Guarded(span // PAGE).tensor(0, span)
    await engine.read(1, out)
    assert copies == []
    assert torch.equal(out[lead : lead + SIZE], src)


async def test_a_window_that_is_not_page_aligned_still_gets_the_bytes_at_the_lead(
    engine: RawEngine,
) -> None:
    # The span's size asks for the window, but the pages around the chunks are not all
    # inside ``out``: those chunks go through the bounce buffers, and nothing outside moves.
    src = await _write(engine, 64, seed=7)
    lead, span = engine.read_window(1, SIZE)
    memory = _guarded(64, span)
    neighbours = memory.around(64, span)
    out = memory.tensor(64, span)
    await engine.read(1, out)
    assert torch.equal(out[lead : lead + SIZE], src)
    assert memory.around(64, span) == neighbours


@pytest.mark.parametrize("offset", [0, 64, 128, 4032])
async def test_a_read_of_exactly_the_size_writes_nothing_outside_out(
    engine: RawEngine, copies: list[int], offset: int
) -> None:
    src = await _write(engine, 64, seed=2)
    memory = _guarded(offset, SIZE)
    neighbours = memory.around(offset, SIZE)
    out = memory.tensor(offset, SIZE)
    await engine.read(1, out)
    assert torch.equal(out, src)
    assert memory.around(offset, SIZE) == neighbours
    if offset == 64:
        # Chunks whose pages lie inside ``out`` went straight in: only the first and the
        # last, which share their pages with the neighbours, were copied.
        assert sorted(copies) == [164, CHUNK - 64]


async def test_damage_in_the_lead_is_not_data_and_damage_after_it_is_caught(
    engine: RawEngine,
) -> None:
    src = await _write(engine, 64, seed=3)
    c = engine.layout(1).chunks[0]
    with open(c.file.path, "r+b") as f:
        f.seek(c.offset + 10)
        f.write(b"\xff\x00")
    out = torch.empty(SIZE, dtype=torch.uint8)
    await engine.read(1, out)
    assert torch.equal(out, src)
    with open(c.file.path, "r+b") as f:
        f.seek(c.offset + c.lead)
        f.write(bytes([src[0].item() ^ 0x01]))
    with pytest.raises(CorruptTensorError, match=f"chunk 0 .* at offset {c.offset + c.lead}"):
        await engine.read(1, out)


async def test_an_address_not_64_bytes_past_a_page_goes_through_the_bounce_buffers(
    engine: RawEngine, copies: list[int]
) -> None:
    src = await _write(engine, 65, seed=4)
    assert engine.layout(1).lead == 0
    assert sum(copies) == SIZE
    out = torch.empty(SIZE, dtype=torch.uint8)
    await engine.read(1, out)
    assert torch.equal(out, src)


async def test_a_wrong_size_out_is_refused(engine: RawEngine) -> None:
    await _write(engine, 64, seed=5)
    _, span = engine.read_window(1, SIZE)
    for n in (SIZE - 1, SIZE + 1, span - 1, span + PAGE):
        with pytest.raises(CorruptTensorError, match=f"{SIZE} bytes were spilled but {n}"):
            await engine.read(1, torch.empty(n, dtype=torch.uint8))


async def test_small_blobs_and_unknown_keys_read_plainly(engine: RawEngine) -> None:
    await engine.write(2, random_bytes(4097))  # a pack: assembled in a bounce buffer anyway
    assert engine.read_window(2, 4097) == (0, 4097)
    assert engine.read_window(3, 123) == (0, 123)


async def test_buffered_io_keeps_no_lead(tmp_path: Path) -> None:
    config = StoreConfig.from_env({}, io_chunk_bytes=CHUNK, direct_io="off")
    engine = RawEngine(make_dirs(tmp_path, 1), config)
    try:
        src = await _write(engine, 64, seed=6)
        assert engine.layout(1).lead == 0
        assert engine.read_window(1, SIZE) == (0, SIZE)
        out = torch.empty(SIZE, dtype=torch.uint8)
        await engine.read(1, out)
        assert torch.equal(out, src)
    finally:
        await engine.close()


def test_the_guard_pages_really_guard(tmp_path: Path) -> None:
    # The tests above lean on this: O_DIRECT from a guard page fails instead of reading it.
    memory = _Guarded(1)
    beyond = ctypes.addressof(ctypes.c_char.from_buffer(memory.map)) + 2 * PAGE
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        with pytest.raises(OSError, match="Bad address"):
            os.pwrite(fd, syscalls.memory(beyond, PAGE), 0)
    finally:
        os.close(fd)
