"""The zarr disk engine (``TIERSTORE_DISK_FORMAT=zarr``): one zarr v3 array per spilled tensor.

Each spill directory holds one zarr v3 group, ``spill.zarr``; tensor ``key`` becomes the array
``spill.zarr/<key as 16 hex digits>`` in the group of directory ``key % len(directories)``, or
of the next one with room when that one is full (Note: [A full directory is skipped here too]).
Arrays are uncompressed, so any zarr v3 reader can open a spill while the process runs:

* When the store passes the tensor's ``dtype`` and ``shape`` and zarr has that dtype, the
  array has them. Otherwise (bfloat16, float8, ... or no dtype given) the array holds the raw
  bytes as ``uint8``. Either way the attributes keep ``torch_dtype``, ``shape`` and ``nbytes``.
* With ``checksum="crc32c"`` the chunks carry zarr's own ``crc32c`` codec (part of the v3
  spec), so a reader also checks them; a mismatch here raises ``CorruptTensorError``.
* Chunks hold about ``io_chunk_bytes`` each, split along the first axis.

Files are made 0600 and directories 0700 (zarr itself would follow the umask). The raw engine
is faster (docs/disk-engine.md, "Zarr engine"); use this one when a spill must be readable by
other tools.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import math
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from tierstore.errors import CorruptTensorError
from tierstore.tiers._engine import DISK_FULL, QUOTA_RETRY_SECONDS, DiskEngine, free_space
from tierstore.tiers._on_thread import on_thread

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from tierstore.config import StoreConfig

__all__ = ["GROUP", "ZarrEngine", "numpy_dtype"]

log = logging.getLogger("tierstore")

GROUP = "spill.zarr"
"""Name of the zarr group inside each private spill directory."""

_NUMPY_NAMES = (
    "bool",
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "float32",
    "float64",
    "complex64",
    "complex128",
)


def numpy_dtype(dtype: torch.dtype | None) -> np.dtype[Any] | None:
    """The numpy dtype zarr stores for ``dtype``, or ``None`` when zarr has no such dtype."""
    if dtype is None:
        return None
    name = str(dtype).removeprefix("torch.")
    return np.dtype(name) if name in _NUMPY_NAMES else None


def _key_name(key: int) -> str:
    return f"{key:016x}"


class ZarrEngine(DiskEngine):
    """Spill each blob as an uncompressed zarr v3 array (see the module docstring).

    Args:
        directories: private spill directories; arrays are spread over them by key.
        config: ``io_threads`` (default 8) threads run zarr; ``io_chunk_bytes`` (default
            8 MiB) sizes the chunks; ``checksum`` (default ``crc32c``) adds the crc32c codec.

    Raises:
        OSError: a group cannot be created.
    """

    name = "zarr"

    def __init__(self, directories: tuple[Path, ...], config: StoreConfig) -> None:
        import zarr

        super().__init__(directories, config)
        if not directories:
            raise ValueError("ZarrEngine needs at least one directory")
        self._roots = [d / GROUP for d in directories]
        for root in self._roots:
            zarr.open_group(str(root), mode="w-", zarr_format=3)
            _make_private(root)
        self._stored: dict[int, tuple[int, int, Any]] = {}
        self._writing: set[int] = set()
        """Each stored key's bytes, the directory (index) its array is in, and the array's
        metadata as written (Note: [The metadata is checked too])."""
        self._full: dict[int, float | None] = {}
        """Directories marked full, with when a quota (EDQUOT) marked them (None: ENOSPC)."""
        self._warned_full: set[int] = set()
        self._pool = ThreadPoolExecutor(config.io_threads, thread_name_prefix="tierstore-zarr")
        self._closed = False

    def _path(self, key: int, home: int) -> Path:
        return self._roots[home] / _key_name(key)

    def _homes_to_try(self, key: int, nbytes: int) -> list[int]:
        """The directories worth trying for ``key``, its own first.

        Note: [A full directory is skipped here too]
            As in the raw engine (Note: [A full directory is skipped]): a write that fails
            for want of space (ENOSPC, EDQUOT) marks its directory full, with one warning,
            and the array is written in the next directory instead; only when every one is
            full does the write fail. A full directory is tried again once its filesystem
            has room for the array; one over its quota, after ``QUOTA_RETRY_SECONDS``
            (``statvfs`` does not see a quota: tried again at once, every array keyed to it
            wrote its chunks, failed and was removed).
        """
        n = len(self._roots)
        order = []
        now = time.monotonic()
        for i in ((key + j) % n for j in range(n)):
            if i in self._full:
                since = self._full[i]
                if (
                    free_space(self._roots[i]) >= self.footprint(nbytes)
                    if since is None
                    else now - since >= QUOTA_RETRY_SECONDS
                ):
                    del self._full[i]
                    log.info("tierstore: spill directory %s has room again", self.directories[i])
            if i not in self._full:
                order.append(i)
        # All full: try them all anyway (the space may be back); the error then says so.
        return order or [(key + j) % n for j in range(n)]

    def _mark_full(self, home: int, error: OSError) -> None:
        """Skip ``home``: until its filesystem has room after ENOSPC, for
        ``QUOTA_RETRY_SECONDS`` after EDQUOT or an error a full disk does not explain."""
        self._full[home] = None if error.errno == errno.ENOSPC else time.monotonic()
        if len(self._roots) > 1 and home not in self._warned_full:
            self._warned_full.add(home)
            log.warning(
                "tierstore: spill directory %s %s (%s); spilling to the other directories "
                "until it has room again (warned once)",
                self.directories[home],
                "is full" if error.errno in DISK_FULL else "failed",
                error.strerror or error,
            )

    def footprint(self, nbytes: int) -> int:
        """Chunk files padded to filesystem blocks, their 4-byte checksums, the padding of the
        last chunk (at most ``_WASTE_PER_CHUNK`` per chunk: Note: [Edge chunks are written
        whole]), the metadata, and the array's directory (a block per 64 chunk files: every
        chunk file lies in it, Note: [Chunk files side by side])."""
        chunks = max(1, math.ceil(nbytes / self.config.io_chunk_bytes))
        per_chunk = 4 + _WASTE_PER_CHUNK
        directory = 4096 * (1 + chunks // 64)
        return -(-(nbytes + per_chunk * chunks) // 4096) * 4096 + 4096 * chunks + 4096 + directory

    async def write(
        self,
        key: int,
        src: torch.Tensor,
        *,
        dtype: torch.dtype | None = None,
        shape: tuple[int, ...] | None = None,
    ) -> None:
        """Store ``src`` as the array ``key``; typed when ``dtype`` is one zarr has."""
        self._check_open()
        if key in self._stored or key in self._writing:
            # A second write of a key in flight would remove the first one's array on failing.
            raise KeyError(f"key {key} is already stored; delete it first")
        self._writing.add(key)
        try:
            await self._write_new(key, src, dtype, shape)
        finally:
            self._writing.discard(key)

    async def _write_new(
        self, key: int, src: torch.Tensor, dtype: torch.dtype | None, shape: tuple[int, ...] | None
    ) -> None:
        loop = asyncio.get_running_loop()
        homes = self._homes_to_try(key, src.numel())
        for n, home in enumerate(homes):
            # Note: [A finished transfer holds no memory]
            fut = on_thread(self._pool, self._write, key, src, dtype, shape, home)
            try:
                metadata = await asyncio.shield(fut)
            except BaseException as exc:
                # Cancelled or failed: let the thread finish before removing what it made.
                await asyncio.wait([fut])
                await loop.run_in_executor(self._pool, _remove, self._path(key, home))
                if isinstance(exc, OSError):
                    # Full, or failing (Note: [A failing directory is skipped] in the raw
                    # engine's striping): the next directory takes the array.
                    self._mark_full(home, exc)
                    if n + 1 < len(homes):
                        continue
                raise
            # A close that ran meanwhile removed the groups, this array with them.
            self._check_open()
            self._stored[key] = (src.numel(), home, metadata)
            return

    async def read(self, key: int, out: torch.Tensor) -> None:
        """Fill ``out`` with the bytes of ``key``.

        Raises:
            KeyError: nothing is stored under ``key``.
            CorruptTensorError: a size, a chunk or a checksum does not match.
        """
        self._check_open()
        size, home, metadata = self._stored[key]
        if out.numel() != size:
            raise CorruptTensorError(
                f"key {key}: {size} bytes were spilled but {out.numel()} were asked for"
            )
        path = self._path(key, home)
        await on_thread(self._pool, self._read, path, out, metadata)

    async def delete(self, key: int) -> None:
        """Remove the array of ``key`` (a missing key is ignored)."""
        stored = self._stored.pop(key, None)
        if stored is not None:
            path = self._path(key, stored[1])
            await asyncio.get_running_loop().run_in_executor(self._pool, _remove, path)

    async def close(self) -> None:
        """Wait for the threads and remove the groups (idempotent)."""
        if self._closed:
            return
        self._closed = True
        await asyncio.get_running_loop().run_in_executor(None, self._pool.shutdown, True)
        self._stored.clear()
        for root in self._roots:
            _remove(root)

    def describe(self) -> dict[str, object]:
        """Groups, chunk size and checksum codec, for ``tierstore info``."""
        import zarr

        return {
            "format": self.name,
            "groups": [str(r) for r in self._roots],
            "zarr": zarr.__version__,
            "io_threads": self.config.io_threads,
            "chunk_bytes": self.config.io_chunk_bytes,
            "checksum": "zarr crc32c codec" if self.config.checksum == "crc32c" else "none",
        }

    # -- blocking work on the engine's threads ---------------------------------------------

    def _write(
        self,
        key: int,
        src: torch.Tensor,
        dtype: torch.dtype | None,
        shape: tuple[int, ...] | None,
        home: int,
    ) -> Any:
        """Write the array; returns its metadata (``ArrayV3Metadata``)."""
        import zarr
        from zarr.codecs import Crc32cCodec
        from zarr.core.array_spec import ArrayConfigParams

        data: np.ndarray[Any, Any] = src.numpy()  # Note: [A spill's source cannot be freed]
        typed = numpy_dtype(dtype)
        if (
            typed is not None
            and shape is not None
            and math.prod(shape) * typed.itemsize == data.nbytes
        ):
            data = data.view(typed).reshape(shape)
        chunks = _chunk_shape(data.shape, data.dtype.itemsize, self.config.io_chunk_bytes)
        if _too_padded(data.shape, chunks, data.dtype.itemsize):
            # Note: [Edge chunks are written whole]
            data = data.reshape(-1)
            chunks = _chunk_shape(data.shape, data.dtype.itemsize, self.config.io_chunk_bytes)
        path = self._path(key, home)
        group = zarr.open_group(str(path.parent), mode="r+", zarr_format=3)
        array = group.create_array(
            _key_name(key),
            # What a write cancelled twice left (its removal was cancelled too) is replaced.
            overwrite=True,
            shape=data.shape,
            dtype=data.dtype,
            chunks=chunks,
            filters=None,
            compressors=[Crc32cCodec()] if self.config.checksum == "crc32c" else None,
            fill_value=0,
            # Note: [Chunk files side by side]
            chunk_key_encoding={"name": "default", "separator": "."},
            attributes={
                "torch_dtype": str(dtype) if dtype is not None else "torch.uint8",
                "shape": list(shape) if shape is not None else [int(src.numel())],
                "nbytes": int(src.numel()),
            },
            config=ArrayConfigParams(order="C", write_empty_chunks=True),
        )
        if data.size:
            array[...] = data
        _make_private(path)
        return array.metadata

    def _read(self, path: Path, out: torch.Tensor, metadata: Any) -> None:
        """Fill ``out`` from the array at ``path``, written with ``metadata``.

        Note: [The metadata is checked too]
            The ``crc32c`` codec covers each chunk's bytes, not ``zarr.json``, which says how
            to decode them: an edited byte order decoded intact chunks into other values, and
            ``get`` returned them without an error. The metadata read back must equal what the
            write made, whatever was edited.
        """
        import zarr

        try:
            array = zarr.open_array(str(path), mode="r", zarr_format=3)
            if array.metadata != metadata:
                raise CorruptTensorError(
                    f"spilled array {str(path)!r} is damaged: its zarr.json changed since it "
                    "was written"
                )
            if array.size and array.nchunks_initialized != array.nchunks:
                # zarr fills a missing chunk with the fill value; for us that is lost data.
                raise CorruptTensorError(
                    f"spilled array {str(path)!r} lost {array.nchunks - array.nchunks_initialized}"
                    f" of its {array.nchunks} chunk files"
                )
            data = np.ascontiguousarray(array[...]).reshape(-1).view(np.uint8)
        except CorruptTensorError:
            raise
        except (ValueError, OSError, KeyError, TypeError) as e:
            # zarr reports a bad checksum or a short chunk as ValueError, a missing file as
            # FileNotFoundError or its own errors; every one means the spill is damaged.
            raise CorruptTensorError(f"spilled array {str(path)!r} is damaged: {e}") from e
        if data.nbytes != out.numel():
            raise CorruptTensorError(
                f"spilled array {str(path)!r} holds {data.nbytes} bytes, {out.numel()} expected"
            )
        out.numpy()[:] = data

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the disk engine is closed")


_WASTE_PER_CHUNK = 16
"""The most bytes of padding per chunk an array may have (Note: [Edge chunks are written
whole]): one element of the widest dtype."""


def _chunk_shape(shape: tuple[int, ...], itemsize: int, chunk_bytes: int) -> tuple[int, ...]:
    """Chunks of at most about ``chunk_bytes``, split along the first axis only, into as few
    chunks as that allows, of rows as even as can be (Note: [Edge chunks are written whole]).

    Note: [Edge chunks are written whole]
        zarr writes the last chunk along an axis at the full chunk size, padded with the
        fill value, so rows cut into chunks of ``chunk_bytes // row`` rows wasted up to a
        whole chunk: a flat 8 MiB + 4 KiB tensor took 16 MiB of disk against the 8 MiB
        :meth:`ZarrEngine.footprint` counted, and the disk tier could hold nearly twice
        ``disk_bytes``. Rows are therefore split evenly over the fewest chunks, so the last
        one is short by less than one row a chunk; where that is more than
        ``_WASTE_PER_CHUNK`` bytes a chunk (rows of many elements), the array is stored flat,
        its shape in the attributes, where it is less than one element a chunk.
    """
    if not shape:
        return ()
    rows = shape[0]
    row = max(1, math.prod(shape[1:]) * itemsize)
    if rows * row <= chunk_bytes or row >= chunk_bytes:
        first = max(1, min(rows, chunk_bytes // row))
    else:
        count = math.ceil(rows * row / chunk_bytes)
        first = math.ceil(rows / count)
    return (first, *(max(1, s) for s in shape[1:]))


def _too_padded(shape: tuple[int, ...], chunks: tuple[int, ...], itemsize: int) -> bool:
    """Whether zarr would pad the last chunk along the first axis by more than
    ``_WASTE_PER_CHUNK`` bytes a chunk (Note: [Edge chunks are written whole])."""
    if not shape or not shape[0]:
        return False
    rows, first = shape[0], chunks[0]
    count = math.ceil(rows / first)
    waste = (count * first - rows) * math.prod(shape[1:]) * itemsize
    return waste > _WASTE_PER_CHUNK * count


# Note: [Chunk files side by side]
#     zarr's default chunk keys nest chunk files in a directory per index: an array of
#     three dimensions chunked along the first put each chunk in ``c/<i>/0/``, two
#     directories of a filesystem block each per chunk that ``footprint`` did not count.
#     Keys joined by "." (``c.<i>.0.0``) put every chunk file in the array's own directory,
#     whose blocks ``footprint`` counts.


def _make_private(path: Path) -> None:
    """0700 directories and 0600 files under ``path`` (zarr creates them by the umask)."""
    for root, dirs, files in os.walk(path):
        os.chmod(root, 0o700)
        for d in dirs:
            os.chmod(os.path.join(root, d), 0o700)
        for f in files:
            os.chmod(os.path.join(root, f), 0o600)


def _remove(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(path)
