"""The conformance suite every disk engine passes, as an importable class.

A test module subclasses :class:`EngineTests`, names the engine class, and implements the
backdoors: reading a key's bytes straight from the files, damaging them, and listing the
directories that hold them. The backdoors never go through the engine's ``read``, so a test
catches an engine whose reads agree with its writes while the files hold something else::

    from tierstore.testing import EngineTests

    class TestMyEngine(EngineTests):
        engine_class = MyEngine

        def backdoor_read(self, engine, key): ...
        def damage_byte(self, engine, key): ...
        def truncate(self, engine, key): ...
        def dirs_holding(self, engine, key): ...

Sizes sit at the page edges (1, 4095, 4096, 4097) and past several chunks; the suite also
checks concurrency, reuse of freed space, removal at close, private file modes, damage and
truncation, striping over two directories, the engine's registration by name, and a store
spilling through it.
"""

from __future__ import annotations

import abc
import asyncio
import os
import stat
from typing import TYPE_CHECKING, ClassVar

import pytest
import torch

from tierstore.config import StoreConfig
from tierstore.errors import CorruptTensorError
from tierstore.tiers import DiskEngine, engine_class, engine_names

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable
    from pathlib import Path


__all__ = [
    "CHUNK",
    "SIZES",
    "EngineTests",
    "KiB",
    "MiB",
    "make_dirs",
    "random_bytes",
    "random_bytes_at",
]

KiB = 1 << 10
MiB = 1 << 20
CHUNK = 64 * KiB
"""Chunk size in the tests: small, so a few MiB already take many chunks."""

SIZES = [0, 1, 4095, 4096, 4097, 64 * KiB, 3 * MiB + 7]


def random_bytes(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def random_bytes_at(n: int, lead: int, seed: int = 0) -> torch.Tensor:
    """``random_bytes`` starting ``lead`` bytes past a page, whatever malloc returned.

    Where a big blob starts in its page decides the raw engine's layout (Note: [A tensor's
    lead]); tests that check offsets or sizes fix it.
    """
    buf = torch.empty(n + 2 * 4096, dtype=torch.uint8)
    at = (lead - buf.data_ptr()) % 4096
    out = buf[at : at + n]
    out.copy_(random_bytes(n, seed))
    return out


def _filled_at(n: int, lead: int) -> torch.Tensor:
    """``n`` bytes of 0xA5 starting ``lead`` bytes past a page (0: page-aligned)."""
    buf = torch.full((n + 2 * 4096,), 0xA5, dtype=torch.uint8)
    at = (lead - buf.data_ptr()) % 4096
    return buf[at : at + n]


def make_dirs(tmp_path: Path, n: int) -> tuple[Path, ...]:
    dirs = []
    for i in range(n):
        d = tmp_path / f"spill{i}"
        d.mkdir(mode=0o700)
        dirs.append(d)
    return tuple(dirs)


class EngineTests(abc.ABC):
    """The behaviour :class:`~tierstore.tiers.DiskEngine` promises, checked for one engine.

    Subclass it as ``Test<Engine>`` with ``engine_class`` set and the four backdoors
    implemented; ``n_dirs`` (default 1) is how many spill directories the ``engine`` fixture
    gets. Override the ``config`` fixture to test other settings.
    """

    engine_class: ClassVar[type[DiskEngine]]
    n_dirs: ClassVar[int] = 1

    # -- backdoors each engine's test module implements ---------------------------------------

    @abc.abstractmethod
    def backdoor_read(self, engine: DiskEngine, key: int) -> bytes:
        """The bytes of ``key`` read from the files without the engine."""

    @abc.abstractmethod
    def damage_byte(self, engine: DiskEngine, key: int) -> None:
        """Flip one byte of ``key``'s data in its file."""

    @abc.abstractmethod
    def truncate(self, engine: DiskEngine, key: int) -> None:
        """Cut the file holding the end of ``key``'s data short."""

    @abc.abstractmethod
    def dirs_holding(self, engine: DiskEngine, key: int) -> set[Path]:
        """The directories whose files hold some of ``key``'s bytes."""

    # -- fixtures ----------------------------------------------------------------------------

    @pytest.fixture
    def config(self) -> StoreConfig:
        return StoreConfig.from_env({}, io_chunk_bytes=CHUNK, io_threads=4)

    @pytest.fixture
    async def engine(self, tmp_path: Path, config: StoreConfig) -> AsyncIterator[DiskEngine]:
        engine = self.engine_class(make_dirs(tmp_path, self.n_dirs), config)
        yield engine
        await engine.close()

    async def striped(self, tmp_path: Path, config: StoreConfig) -> DiskEngine:
        return self.engine_class(make_dirs(tmp_path, 2), config)

    # -- round trips -------------------------------------------------------------------------

    @pytest.mark.parametrize("size", SIZES)
    async def test_round_trip_is_bit_exact(self, engine: DiskEngine, size: int) -> None:
        src = random_bytes(size, seed=size)
        await engine.write(7, src)
        assert self.backdoor_read(engine, 7) == src.numpy().tobytes()
        out = torch.full((size,), 0xA5, dtype=torch.uint8)
        await engine.read(7, out)
        assert torch.equal(out, src)

    async def test_read_into_unaligned_view(self, engine: DiskEngine) -> None:
        # A tensor that starts one byte into its storage can never be page-aligned.
        src = random_bytes(CHUNK * 3 + 5, seed=1)[1:]
        await engine.write(1, src)
        out = torch.zeros(src.numel() + 1, dtype=torch.uint8)[1:]
        await engine.read(1, out)
        assert torch.equal(out, src)

    @pytest.mark.parametrize("size", [4096 + 100, CHUNK, 3 * CHUNK + 5, MiB + 3])
    @pytest.mark.parametrize("leads", [(0, 1), (1, 0), (0, 0), (1, 1)])
    async def test_one_key_read_twice_at_once_fills_both(
        self, engine: DiskEngine, size: int, leads: tuple[int, int]
    ) -> None:
        """Two reads of one key in one turn of the loop, into page-aligned and unaligned
        buffers: read together with their neighbours, the second got bytes the first left in
        a bounce buffer, and a checksum error on an intact file."""
        src = random_bytes(size, seed=size)
        await engine.write(3, random_bytes(size, seed=1))  # a neighbour before it on disk
        await engine.write(4, src)
        a, b = (_filled_at(size, lead) for lead in leads)
        assert await engine.read_many([(4, a), (4, b)]) == [None, None]
        assert torch.equal(a, src) and torch.equal(b, src)
        c, d = (_filled_at(size, lead) for lead in leads)
        await asyncio.gather(engine.read(4, c), engine.read(4, d))
        assert torch.equal(c, src) and torch.equal(d, src)

    async def test_source_may_change_after_write_returns(self, engine: DiskEngine) -> None:
        src = random_bytes(5 * CHUNK + 3, seed=2)
        expected = src.clone()
        await engine.write(1, src)
        src.zero_()
        out = torch.empty_like(src)
        await engine.read(1, out)
        assert torch.equal(out, expected)

    async def test_many_concurrent_writes_and_reads(self, engine: DiskEngine) -> None:
        sizes = [(i * 7919) % (3 * CHUNK) + i for i in range(48)]
        srcs = {k: random_bytes(n, seed=k) for k, n in enumerate(sizes)}
        await asyncio.gather(*(engine.write(k, t) for k, t in srcs.items()))
        outs = {k: torch.empty_like(t) for k, t in srcs.items()}
        await asyncio.gather(*(engine.read(k, outs[k]) for k in reversed(srcs)))
        for k, t in srcs.items():
            assert torch.equal(outs[k], t), k
            assert self.backdoor_read(engine, k) == t.numpy().tobytes()

    async def test_a_cancelled_write_stores_nothing(self, engine: DiskEngine) -> None:
        src = random_bytes(6 * CHUNK + 1, seed=3)
        # Room made first, so that the cancel finds the chunks with the I/O threads, not the
        # write waiting for its file to grow.
        await engine.write(4, src)
        await engine.delete(4)
        reusable = engine.reusable_bytes()
        task = asyncio.create_task(engine.write(5, src))
        await asyncio.sleep(0)  # let the write start and hand work to its threads
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        with pytest.raises(KeyError):
            await engine.read(5, torch.empty_like(src))
        assert engine.reusable_bytes() == reusable, "the cancelled write kept its space"
        await engine.write(5, src)  # the key is free again
        out = torch.empty_like(src)
        await engine.read(5, out)
        assert torch.equal(out, src)

    async def test_writing_a_stored_key_again_is_refused(self, engine: DiskEngine) -> None:
        await engine.write(3, random_bytes(10))
        with pytest.raises(KeyError):
            await engine.write(3, random_bytes(10, seed=1))

    @pytest.mark.parametrize("size", [100, 3 * MiB + 7])
    async def test_two_writes_of_one_key_at_once_store_one_and_keep_no_space(
        self, engine: DiskEngine, size: int
    ) -> None:
        held = _file_bytes(engine.directories) - engine.reusable_bytes()
        first, second = random_bytes(size, seed=1), random_bytes(size, seed=2)
        outcomes = await asyncio.gather(
            engine.write(9, first), engine.write(9, second), return_exceptions=True
        )
        assert [type(o) for o in outcomes].count(KeyError) == 1, outcomes
        out = torch.empty(size, dtype=torch.uint8)
        await engine.read(9, out)
        assert torch.equal(out, first if outcomes[0] is None else second)
        await engine.delete(9)
        # The refused write's bytes must not stay placed under no key.
        assert _file_bytes(engine.directories) - engine.reusable_bytes() == held

    async def test_reading_an_unknown_key_raises_key_error(self, engine: DiskEngine) -> None:
        with pytest.raises(KeyError):
            await engine.read(12345, torch.empty(1, dtype=torch.uint8))

    async def test_reading_into_the_wrong_size_is_refused(self, engine: DiskEngine) -> None:
        await engine.write(3, random_bytes(100))
        with pytest.raises(CorruptTensorError):
            await engine.read(3, torch.empty(99, dtype=torch.uint8))

    # -- space -------------------------------------------------------------------------------

    async def test_delete_frees_space_for_the_next_blob(self, engine: DiskEngine) -> None:
        # Both at one lead: one that started later in its page would need one more page
        # than the space freed, whatever malloc's heap held (it failed in one test order).
        await engine.write(1, random_bytes_at(MiB, 64, seed=1))
        used = _file_bytes(engine.directories)
        reusable = engine.reusable_bytes()
        await engine.delete(1)
        # An engine that preallocates keeps the freed space in its files: it must say so, or
        # the store would count that space as used (see DiskEngine.reusable_bytes).
        preallocates = type(engine).reusable_bytes is not DiskEngine.reusable_bytes
        if preallocates:
            assert engine.reusable_bytes() >= reusable + MiB
        with pytest.raises(KeyError):
            await engine.read(1, torch.empty(MiB, dtype=torch.uint8))
        src = random_bytes_at(MiB, 64, seed=2)
        await engine.write(2, src)
        assert _file_bytes(engine.directories) == used
        if preallocates:
            assert engine.reusable_bytes() == reusable  # the new blob took the freed space
        assert self.backdoor_read(engine, 2) == src.numpy().tobytes()

    async def test_delete_of_an_unknown_key_is_ignored(self, engine: DiskEngine) -> None:
        await engine.delete(999)

    def test_footprint_covers_the_bytes(self, engine: DiskEngine) -> None:
        for n in SIZES:
            assert engine.footprint(n) >= n
        assert engine.footprint(4097) >= 8192

    async def test_close_removes_every_file(self, engine: DiskEngine) -> None:
        for k, n in enumerate(SIZES):
            await engine.write(k, random_bytes(n))
        await engine.close()
        for d in engine.directories:
            assert list(d.iterdir()) == []
        await engine.close()  # idempotent

    async def test_files_are_private(self, engine: DiskEngine) -> None:
        await engine.write(1, random_bytes(3 * CHUNK))
        found = 0
        for d in engine.directories:
            for root, dirs, files in os.walk(d):
                for name in dirs:
                    assert stat.S_IMODE(os.stat(os.path.join(root, name)).st_mode) == 0o700
                for name in files:
                    found += 1
                    assert stat.S_IMODE(os.stat(os.path.join(root, name)).st_mode) == 0o600
        assert found

    # -- damage ------------------------------------------------------------------------------

    async def test_a_damaged_byte_is_detected(self, engine: DiskEngine) -> None:
        await self._damage_is_detected(engine, self.damage_byte, seed=5)

    async def test_a_truncated_file_is_detected(self, engine: DiskEngine) -> None:
        await self._damage_is_detected(engine, self.truncate, seed=6)

    async def _damage_is_detected(
        self, engine: DiskEngine, damage: Callable[[DiskEngine, int], None], seed: int
    ) -> None:
        src = random_bytes(2 * CHUNK + 100, seed=seed)
        await engine.write(4, src)
        damage(engine, 4)
        with pytest.raises(CorruptTensorError):
            await engine.read(4, torch.empty_like(src))

    # -- striping ----------------------------------------------------------------------------

    async def test_two_directories_both_hold_data(
        self, tmp_path: Path, config: StoreConfig
    ) -> None:
        engine = await self.striped(tmp_path, config)
        try:
            srcs = {k: random_bytes(4 * CHUNK + k, seed=k) for k in range(4)}
            for k, t in srcs.items():
                await engine.write(k, t)
            holding = set().union(*(self.dirs_holding(engine, k) for k in srcs))
            assert holding == set(engine.directories)
            for k, t in srcs.items():
                assert self.backdoor_read(engine, k) == t.numpy().tobytes()
                out = torch.empty_like(t)
                await engine.read(k, out)
                assert torch.equal(out, t)
        finally:
            await engine.close()
        for d in engine.directories:
            assert list(d.iterdir()) == []

    # -- registration and use by a store ---------------------------------------------------

    def test_the_engine_is_found_by_its_name(self) -> None:
        # Note: [Engines register by name].
        name = self.engine_class.name
        assert name in engine_names()
        assert engine_class(name) is self.engine_class
        assert StoreConfig.from_env({}, disk_format=name).disk_format == name

    def test_a_store_spills_through_it_and_reads_back(self, tmp_path: Path) -> None:
        from tierstore import Tier, TieredStore
        from tierstore.testing._internals import settled, wait_for

        srcs = [random_bytes(n, seed=n).view(-1) for n in (4097, 3 * CHUNK + 5)]
        with TieredStore(
            disk_dir=tmp_path,
            disk_format=self.engine_class.name,
            device_bytes=0,
            host_bytes=0,
            min_bytes=0,
            io_chunk_bytes=CHUNK,
        ) as store:
            hs = [store.put(t) for t in srcs]
            wait_for(lambda: settled(store), what="the spills")
            for h, t in zip(hs, srcs, strict=True):
                assert store.tier_of(h) is Tier.DISK
                assert torch.equal(store.get(h), t)
        assert list(tmp_path.iterdir()) == []


def _file_bytes(directories: tuple[Path, ...]) -> int:
    total = 0
    for d in directories:
        for root, _, files in os.walk(d):
            total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    return total
