"""``python -m tierstore info``: the resolved configuration and what this machine offers.

Example:
    $ TIERSTORE_DISK_DIR=/nvme0:/nvme1 python -m tierstore info
    $ python -m tierstore info --json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from tierstore._spilldir import in_ram_message
from tierstore._stats import format_size

if TYPE_CHECKING:
    from tierstore.config import StoreConfig

__all__ = ["collect_info", "main"]


def _pinning() -> tuple[bool, str]:
    from tierstore.tiers import _accelerator

    if _accelerator.accelerator_type() is None:
        return False, "no accelerator; the host tier uses pageable memory"
    try:
        t = _accelerator.pinned_empty(1 << 20)
    except RuntimeError as e:
        return False, f"pinning failed: {e}"
    return bool(t.is_pinned()), "ok"


def _directory(path: Path) -> dict[str, object]:
    from tierstore._spilldir import ram_filesystem
    from tierstore.bench._system import filesystem_of
    from tierstore.tiers.raw import probe_direct_io

    usage = shutil.disk_usage(path)
    probe = probe_direct_io(path)
    return {
        "path": str(path),
        "exists": True,
        "filesystem": filesystem_of(path),
        "free_bytes": usage.free,
        "total_bytes": usage.total,
        "o_direct": probe.supported,
        "o_direct_reason": probe.reason,
        # tmpfs or ramfs: the "disk" tier would be RAM (None on a real filesystem).
        "in_ram": ram_filesystem(path),
    }


def _capacities(config: StoreConfig, memory: int, ranks: int) -> dict[str, object]:
    """The capacities a store opened now would have, and where each comes from."""
    from tierstore.core._disk_tier import disk_capacity

    disk, free = disk_capacity(config)
    if "TIERSTORE_HOST_BYTES" in os.environ:
        host_from = "TIERSTORE_HOST_BYTES"
    else:
        share = f" / {ranks} ranks (LOCAL_WORLD_SIZE)" if ranks > 1 else ""
        host_from = f"a quarter of {format_size(memory)} of memory{share}"
    if config.disk_bytes == 0:
        disk_from = "off (TIERSTORE_DISK_BYTES=0)"
    elif config.disk_bytes is None:
        disk_from = "the free space under the spill directories"
    elif config.disk_bytes > free:
        disk_from = (
            f"TIERSTORE_DISK_BYTES={format_size(config.disk_bytes)}, capped at the "
            f"{format_size(free)} free"
        )
    else:
        disk_from = "TIERSTORE_DISK_BYTES"
    return {
        "device_bytes": config.device_bytes,
        "host_bytes": config.host_bytes,
        "host_from": host_from,
        "disk_bytes": disk,
        "disk_free_bytes": free,
        "disk_from": disk_from,
    }


def _version_of(package: str) -> str:
    """An installed distribution's version, or "not installed"."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


def collect_info() -> dict[str, object]:
    """Everything ``info`` prints, as a JSON-ready dict.

    Raises:
        ConfigError: a ``TIERSTORE_*`` variable is invalid, or a spill directory cannot be
            used (missing, not a directory, not writable): the error a store would raise.
    """
    import numpy
    import torch
    import zarr

    import tierstore
    from tierstore._spilldir import check_parent
    from tierstore.config import (
        StoreConfig,
        _default_host_bytes,
        _local_ranks,
        _physical_memory_bytes,
    )
    from tierstore.tiers import _accelerator
    from tierstore.tiers._checksum import IMPLEMENTATION

    config = StoreConfig.from_env()
    for parent in config.disk_dirs:
        check_parent(parent)  # as a store checks it when it opens
    memory, ranks = _physical_memory_bytes(), _local_ranks()
    pinned, why = _pinning()
    kind = _accelerator.accelerator_type()
    return {
        "versions": {
            "tierstore": tierstore.__version__,
            "python": platform.python_version(),
            "torch": torch.__version__,
            "zarr": zarr.__version__,
            "numpy": numpy.__version__,
            "isal": _version_of("isal"),
        },
        "config": {
            f.name: (
                [str(p) for p in getattr(config, f.name)]
                if f.name == "disk_dirs"
                else getattr(config, f.name)
            )
            for f in dataclasses.fields(config)
        },
        # What the default host tier is made of: each of the LOCAL_WORLD_SIZE ranks on this
        # machine gets its share of a quarter of memory.
        "host_default": {
            "memory_bytes": memory,
            "local_world_size": ranks,
            "host_bytes": _default_host_bytes(),
        },
        # What a store opened now gets: per store, and so per rank under torchrun.
        "capacities": _capacities(config, memory, ranks),
        # Named "cuda" for the scripts that read it; "type" says which accelerator it is.
        "cuda": {
            "available": kind is not None,
            "type": kind,
            "devices": _accelerator.device_names(),
            "pinning": pinned,
            "pinning_detail": why,
        },
        "checksum": IMPLEMENTATION if config.checksum == "crc32c" else "none",
        "disk_dirs": [_directory(d) for d in config.disk_dirs],
        "engine": _engine(config),
    }


def _engine(config: StoreConfig) -> dict[str, object] | None:
    """What the disk engine detected when opened as a store opens it, in spill directories
    of its own that are removed at once (None when the disk tier is off; ``{"error": ...}``
    when it cannot open, so that the rest of the report still prints)."""
    import asyncio
    import concurrent.futures

    from tierstore.core._disk_tier import open_disk_tier
    from tierstore.errors import ConfigError

    try:
        tier = open_disk_tier(config)
    except (ConfigError, OSError) as exc:
        return {"error": str(exc)}
    try:
        if tier.engine is None:
            return None
        engine = tier.engine
        try:
            return engine.describe()
        finally:
            # On a thread of its own: collect_info may be called inside a running event loop
            # (a notebook), where asyncio.run refuses to start.
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                pool.submit(lambda: asyncio.run(engine.close())).result()
    finally:
        tier.remove()


def _print(info: dict[str, object]) -> None:
    versions = info["versions"]
    assert isinstance(versions, dict)
    print(", ".join(f"{k} {v}" for k, v in versions.items()))
    print("configuration (TIERSTORE_* and defaults):")
    config = info["config"]
    assert isinstance(config, dict)
    for k, v in config.items():
        shown = f"{v} ({format_size(v)})" if k.endswith("_bytes") and isinstance(v, int) else v
        if k == "disk_bytes" and v is None:
            shown = "unset: the free space (see below)"
        print(f"  {k:<20} {shown}")
    host = info["host_default"]
    assert isinstance(host, dict)
    ranks = host["local_world_size"]
    per_rank = f" / {ranks} ranks on this machine (LOCAL_WORLD_SIZE)" if ranks > 1 else ""
    print(
        f"default host tier: a quarter of {format_size(host['memory_bytes'])} of memory"
        f"{per_rank} = {format_size(host['host_bytes'])} per store"
    )
    caps = info["capacities"]
    assert isinstance(caps, dict)
    print("capacities of a store opened now (per store, so per rank):")
    print(f"  device {format_size(caps['device_bytes'])}")
    print(f"  host   {format_size(caps['host_bytes'])} ({caps['host_from']})")
    print(f"  disk   {format_size(caps['disk_bytes'])} ({caps['disk_from']})")
    cuda = info["cuda"]
    assert isinstance(cuda, dict)
    print(f"accelerator: {cuda['type'] or 'none'} {cuda['devices'] or ''}".rstrip())
    print(f"CUDA available: {'yes' if cuda['type'] == 'cuda' else 'no'}")
    print(f"pinned host memory: {'yes' if cuda['pinning'] else 'no'} ({cuda['pinning_detail']})")
    print(f"checksum: {info['checksum']}")
    dirs = info["disk_dirs"]
    assert isinstance(dirs, list)
    for d in dirs:
        direct = "yes" if d["o_direct"] else f"no ({d['o_direct_reason']})"
        print(
            f"spill directory {d['path']}: {d['filesystem']}, "
            f"{format_size(d['free_bytes'])} free of {format_size(d['total_bytes'])}, "
            f"O_DIRECT {direct}"
        )
        if d["in_ram"]:
            print(f"  warning: {in_ram_message(Path(d['path']), d['in_ram'])}")
    engine = info["engine"]
    if not isinstance(engine, dict):
        print("disk engine: none (the disk tier is off: TIERSTORE_DISK_BYTES=0)")
        return
    if "error" in engine:
        print(f"disk engine: cannot open ({engine['error']})")
        return
    # The engine's directories were its own, made for this report and removed already.
    shown = {k: v for k, v in engine.items() if k not in _TEMPORARY_PATHS}
    details = ", ".join(
        f"{k} {format_size(v) if k.endswith('_bytes') and isinstance(v, int) else v}"
        for k, v in shown.items()
        if k != "format"
    )
    print(f"disk engine: {engine.get('format')} ({details})")


_TEMPORARY_PATHS = ("directories", "groups", "direct_io", "direct_io_reason")


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``tierstore`` and ``python -m tierstore``: 0, or 2 for a configuration
    a store would refuse (the disk engine's directories included)."""
    parser = argparse.ArgumentParser(prog="tierstore")
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="print the configuration and what was detected")
    info.add_argument("--json", action="store_true", help="print JSON instead of text")
    args = parser.parse_args(argv)
    from tierstore.errors import ConfigError

    try:
        facts = collect_info()
    except ConfigError as e:
        print(f"configuration error: {e}", file=sys.stderr)
        return 2
    try:
        if args.json:
            print(json.dumps(facts, indent=2))
        else:
            _print(facts)
        sys.stdout.flush()
    except BrokenPipeError:  # ``tierstore info | head``: the reader has what it wanted
        # The interpreter flushes stdout again at exit, and would report the pipe then.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    engine = facts["engine"]
    # A store would refuse to open there: the report printed, the exit says so too.
    return 2 if isinstance(engine, dict) and "error" in engine else 0


if __name__ == "__main__":
    raise SystemExit(main())
