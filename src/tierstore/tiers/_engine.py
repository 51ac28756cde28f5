"""The disk engine contract, and the registry that finds an engine by its name.

An engine stores and loads byte blobs by integer key. It owns files inside the per-process
spill directories it is given (see ``_spilldir.py``) and nothing else. The store calls it from
its event loop; an engine does its blocking work on its own threads and must never block the
loop. Every engine passes the shared conformance suite, :class:`tierstore.testing.EngineTests`.

Note: [Engines register by name]
    A subclass of :class:`DiskEngine` that sets ``name`` registers itself under that name when
    its class is made: ``TIERSTORE_DISK_FORMAT`` then accepts the name, and the store opens
    the engine with it. The built-in engines are listed by module and class, and imported only
    when a store uses them (zarr is slow to import). A wrapper that is not an engine of its
    own (a fault injector) passes ``register=False``.
"""

from __future__ import annotations

import abc
import asyncio
import errno
import importlib
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from tierstore._fork_safe_lock import ForkSafeLock

if TYPE_CHECKING:
    from collections.abc import Sequence
    from pathlib import Path

    import torch

    from tierstore.config import StoreConfig

__all__ = [
    "DISK_FULL",
    "QUOTA_RETRY_SECONDS",
    "DiskEngine",
    "WriteRequest",
    "check_bytes",
    "engine_class",
    "engine_names",
    "free_space",
    "is_bytes",
    "open_engine",
]

DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
"""The errors of a filesystem (or a quota) without room: engines skip such a directory."""
QUOTA_RETRY_SECONDS = 10.0
"""How long an engine skips a directory over its user's quota before trying it again:
``statvfs`` does not see a quota, so the filesystem's free space cannot say when it is back."""


@dataclass(frozen=True, slots=True)
class WriteRequest:
    """One blob for :meth:`DiskEngine.write_many`: the arguments of one ``write``."""

    key: int
    src: torch.Tensor
    dtype: torch.dtype | None = None
    shape: tuple[int, ...] | None = None


class DiskEngine(abc.ABC):
    """Stores byte blobs on disk by integer key.

    Args:
        directories: the private spill directories (mode 0700, already created), one per
            configured ``TIERSTORE_DISK_DIR`` entry; an engine stripes across them.
        config: the store's configuration (chunk size, threads, direct I/O, checksum).

    Contract:
        * ``write(key, src, *, dtype=None, shape=None)``: ``src`` is a 1-D contiguous ``uint8``
          CPU tensor; the caller keeps it alive and unchanged until the coroutine returns. On
          return the bytes are stored. ``dtype``/``shape`` (optional) describe the original
          tensor for self-describing formats. On failure nothing stays allocated for ``key``
          and the error propagates (an ``OSError`` carries its ``errno``, so the store can tell
          ENOSPC from EIO).
        * ``read(key, out)``: fill ``out`` (1-D contiguous ``uint8`` CPU, exactly the written
          size) with the bytes. Raises ``CorruptTensorError`` when a checksum or size does not
          match, never returning wrong bytes silently. ``out`` may instead be a page-aligned
          buffer of the span ``read_window(key, nbytes)`` gives; the bytes then land at its
          lead and the rest of ``out`` is the engine's scratch.
        * ``delete(key)``: free the key's space. Never called while a read or write of the same
          key is in flight.
        * ``write_many(requests)`` / ``read_many(requests)``: several writes or reads at once,
          with one outcome per request (``None`` or the exception ``write``/``read`` would
          have raised). ``delete_many(keys)`` likewise frees several keys. The store hands
          over everything it has queued at once, so an engine can batch; the defaults run
          ``write``/``read``/``delete`` concurrently.
        * ``close()``: delete every file; the store removes the directories afterwards.
        Nothing on the load path may unpickle.
    """

    name: ClassVar[str]
    """The ``TIERSTORE_DISK_FORMAT`` value that selects this engine (Note: [Engines register
    by name])."""

    def __init_subclass__(cls, *, register: bool = True, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if register and "name" in cls.__dict__:
            _register(cls.name, cls)

    def __init__(self, directories: tuple[Path, ...], config: StoreConfig) -> None:
        self.directories = directories
        self.config = config

    def footprint(self, nbytes: int) -> int:
        """Bytes of disk a blob of ``nbytes`` occupies (padding and metadata included)."""
        return nbytes

    def reusable_bytes(self) -> int:
        """Bytes this engine already holds on disk that a new blob can reuse.

        The store checks the filesystem's free space before each spill; an engine that
        preallocates (the raw engine's extents) keeps space a deleted blob freed, which
        ``statvfs`` no longer shows as free. The store adds this to the free space.
        """
        return 0

    def placeable_bytes(self) -> int:
        """The biggest blob this engine can place in space it already holds (default:
        :meth:`reusable_bytes`).

        Less than :meth:`reusable_bytes` where that space is in pieces: a store whose write
        failed for want of space waits until the filesystem's free space plus this is enough,
        not plus scattered pieces no blob fits in.
        """
        return self.reusable_bytes()

    @abc.abstractmethod
    async def write(
        self,
        key: int,
        src: torch.Tensor,
        *,
        dtype: torch.dtype | None = None,
        shape: tuple[int, ...] | None = None,
    ) -> None:
        """Store ``src`` under ``key``.

        ``dtype`` and ``shape`` optionally describe the tensor whose bytes ``src`` holds; an
        engine that keeps a self-describing format (zarr) records them, the raw engine ignores
        them. They never change the bytes ``read`` returns.

        Raises:
            KeyError: ``key`` is stored, or a write of it has not ended yet (the store never
                writes a key twice; an engine refuses it rather than leak the first one's space).
        """

    def read_window(self, key: int, nbytes: int) -> tuple[int, int]:
        """``(lead, span)``: a read of ``key`` (``nbytes`` long) into a page-aligned ``out`` of
        ``span`` bytes puts the bytes at ``out[lead : lead + nbytes]``.

        An engine that reads straight into the caller's pages asks for the pages its layout
        needs (the raw engine: Note: [A tensor's lead]). The default, ``(0, nbytes)``, is the
        plain read.
        """
        return 0, nbytes

    @abc.abstractmethod
    async def read(self, key: int, out: torch.Tensor) -> None:
        """Load the bytes of ``key`` into ``out``."""

    async def write_many(self, requests: Sequence[WriteRequest]) -> list[BaseException | None]:
        """Store several blobs; one outcome per request, in order (``None``: stored).

        Every request has ended, stored or not, when this returns. When the caller is
        cancelled, the requests that had completed stay stored and the others store nothing.
        """
        results = await asyncio.gather(
            *(self.write(r.key, r.src, dtype=r.dtype, shape=r.shape) for r in requests),
            return_exceptions=True,
        )
        return [r if isinstance(r, BaseException) else None for r in results]

    async def read_many(
        self, requests: Sequence[tuple[int, torch.Tensor]]
    ) -> list[BaseException | None]:
        """Fill each ``(key, out)``; one outcome per request, in order (``None``: filled)."""
        results = await asyncio.gather(
            *(self.read(key, out) for key, out in requests), return_exceptions=True
        )
        return [r if isinstance(r, BaseException) else None for r in results]

    @abc.abstractmethod
    async def delete(self, key: int) -> None:
        """Free the space of ``key``."""

    async def delete_many(self, keys: Sequence[int]) -> list[BaseException | None]:
        """Free the space of several keys; one outcome per key, in order (``None``: freed)."""
        results = await asyncio.gather(*(self.delete(k) for k in keys), return_exceptions=True)
        return [r if isinstance(r, BaseException) else None for r in results]

    @abc.abstractmethod
    async def close(self) -> None:
        """Delete every file this engine made and stop its threads."""

    def forget_after_fork(self) -> None:
        """In a forked child: close what it holds open of the parent's files, touching none.

        An open descriptor keeps a file's space in use after the parent removes it, until
        the child exits (a data loader's worker lives an epoch). Default: nothing held open.
        """
        return None

    def describe(self) -> dict[str, object]:
        """What the engine detected (direct I/O, chunking), for ``python -m tierstore info``."""
        return {"format": self.name}


def check_bytes(t: torch.Tensor, name: str) -> None:
    """Refuse a ``src`` or ``out`` that is not what the contract takes.

    Raises:
        TypeError: ``t`` is not a 1-D contiguous ``uint8`` CPU tensor.
    """
    if not is_bytes(t):
        raise TypeError(
            f"{name} must be a 1-D contiguous uint8 CPU tensor, got {t.dtype} {tuple(t.shape)} "
            f"on {t.device}"
        )


def free_space(directory: Path) -> int:
    """Bytes the filesystem of ``directory`` has free for this user; 0 where it cannot say."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def is_bytes(t: torch.Tensor) -> bool:
    """Whether ``t`` is a 1-D contiguous ``uint8`` CPU tensor."""
    import torch

    return t.dtype == torch.uint8 and t.dim() == 1 and t.is_contiguous() and t.device.type == "cpu"


# ------------------------------------------------------------------ the registry

_BUILTIN = {
    "raw": "tierstore.tiers.raw._engine:RawEngine",
    "zarr": "tierstore.tiers._zarr:ZarrEngine",
}
# name -> "module:class" until first used, then the class.
_engines: dict[str, type[DiskEngine] | str] = dict(_BUILTIN)
_engines_lock = ForkSafeLock()


def _register(name: str, cls: type[DiskEngine]) -> None:
    if not name or name != name.strip().lower():
        raise ValueError(f"a disk engine's name must be lower case, got {name!r}")
    where = f"{cls.__module__}:{cls.__qualname__}"
    with _engines_lock:
        known = _engines.get(name)
        if known is not None and not isinstance(known, str):
            known = f"{known.__module__}:{known.__qualname__}"
        if known is not None and known != where:
            raise ValueError(
                f"a disk engine named {name!r} is already registered ({known}); "
                "give the new engine another name"
            )
        _engines[name] = cls


def engine_names() -> tuple[str, ...]:
    """The names ``TIERSTORE_DISK_FORMAT`` accepts, built-in engines first."""
    with _engines_lock:
        extra = sorted(n for n in _engines if n not in _BUILTIN)
    return (*_BUILTIN, *extra)


def engine_class(name: str) -> type[DiskEngine]:
    """The engine registered as ``name``, imported now if it is a built-in one not yet used.

    Raises:
        KeyError: no engine has that name.
    """
    with _engines_lock:
        found = _engines[name]
    if isinstance(found, str):
        module, _, attr = found.partition(":")
        cls: type[DiskEngine] = getattr(importlib.import_module(module), attr)
        with _engines_lock:
            _engines[name] = cls
        return cls
    return found


def open_engine(directories: tuple[Path, ...], config: StoreConfig) -> DiskEngine:
    """The engine ``config.disk_format`` names, over ``directories``."""
    return engine_class(config.disk_format)(directories, config)
