"""The engine contract's registry (Note: [Engines register by name]): a new engine is a
subclass, and it passes the public conformance class like the built-in ones."""

from __future__ import annotations

import asyncio
import contextlib
import os
import zlib
from typing import TYPE_CHECKING

import pytest
import torch

from tierstore import ConfigError, StoreConfig
from tierstore.errors import CorruptTensorError
from tierstore.testing import EngineTests
from tierstore.tiers import DiskEngine, engine_class, engine_names

if TYPE_CHECKING:
    from pathlib import Path


class OneFileEngine(DiskEngine):
    """One file per blob, as the simplest disk offloaders do: the whole of an engine."""

    name = "one-file-test"

    def __init__(self, directories: tuple[Path, ...], config: StoreConfig) -> None:
        super().__init__(directories, config)
        self._crcs: dict[int, tuple[int, int]] = {}
        self._writing: set[int] = set()

    def _path(self, key: int) -> Path:
        return self.directories[key % len(self.directories)] / f"{key:016x}.blob"

    def footprint(self, nbytes: int) -> int:
        return -(-nbytes // 4096) * 4096

    async def write(self, key: int, src: torch.Tensor, **description: object) -> None:
        # ``dtype`` and ``shape`` may come in ``description``; raw bytes need neither.
        if key in self._crcs or key in self._writing:
            raise KeyError(f"key {key} is already stored")
        data = src.numpy().tobytes()
        self._writing.add(key)
        try:
            job = asyncio.ensure_future(asyncio.to_thread(self._write_file, self._path(key), data))
            try:
                await asyncio.shield(job)
            except BaseException:
                await asyncio.wait([job])  # the thread finishes before its file is removed
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self._path(key))
                raise
            self._crcs[key] = (len(data), zlib.crc32(data))
        finally:
            self._writing.discard(key)

    @staticmethod
    def _write_file(path: Path, data: bytes) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)

    async def read(self, key: int, out: torch.Tensor) -> None:
        size, crc = self._crcs[key]
        if out.numel() != size:
            raise CorruptTensorError(f"key {key}: {size} bytes, {out.numel()} asked for")
        data = await asyncio.to_thread(self._path(key).read_bytes)
        if len(data) != size or zlib.crc32(data) != crc:
            raise CorruptTensorError(f"key {key}: the file changed behind the engine's back")
        out.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8) if size else out)

    async def delete(self, key: int) -> None:
        if self._crcs.pop(key, None) is not None:
            await asyncio.to_thread(os.unlink, self._path(key))

    async def close(self) -> None:
        for key in list(self._crcs):
            await self.delete(key)


class TestOneFileEngine(EngineTests):
    engine_class = OneFileEngine

    def backdoor_read(self, engine: DiskEngine, key: int) -> bytes:
        assert isinstance(engine, OneFileEngine)
        return engine._path(key).read_bytes()

    def damage_byte(self, engine: DiskEngine, key: int) -> None:
        assert isinstance(engine, OneFileEngine)
        path = engine._path(key)
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))

    def truncate(self, engine: DiskEngine, key: int) -> None:
        assert isinstance(engine, OneFileEngine)
        path = engine._path(key)
        os.truncate(path, path.stat().st_size // 2)

    def dirs_holding(self, engine: DiskEngine, key: int) -> set[Path]:
        assert isinstance(engine, OneFileEngine)
        return {engine._path(key).parent}


def test_the_configuration_offers_every_registered_engine() -> None:
    assert engine_names()[:2] == ("raw", "zarr")
    assert "one-file-test" in engine_names()
    with pytest.raises(ConfigError, match=r"TIERSTORE_DISK_FORMAT.*one-file-test"):
        StoreConfig.from_env({"TIERSTORE_DISK_FORMAT": "nonesuch"})


def test_built_in_engines_are_imported_only_when_used() -> None:
    from tierstore.tiers._zarr import ZarrEngine
    from tierstore.tiers.raw import RawEngine

    assert engine_class("raw") is RawEngine
    assert engine_class("zarr") is ZarrEngine


def test_a_name_is_taken_once_and_in_lower_case() -> None:
    with pytest.raises(ValueError, match="already registered"):
        type("Another", (OneFileEngine,), {"name": "raw"})
    with pytest.raises(ValueError, match="lower case"):
        type("Shouting", (OneFileEngine,), {"name": "LOUD"})


def test_a_wrapper_does_not_register() -> None:
    class Wrapper(DiskEngine, register=False):
        name = "wrapper-test"

    assert "wrapper-test" not in engine_names()
    with pytest.raises(KeyError):
        engine_class("wrapper-test")
