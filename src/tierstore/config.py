"""Store configuration: one frozen dataclass, read from ``TIERSTORE_*`` variables in one place.

Example:
    >>> cfg = StoreConfig.from_env(host_bytes="64MiB")
    >>> cfg.host_bytes
    67108864

Keyword overrides win over the environment; both go through the same parser, so a bad value
raises the same :class:`~tierstore.errors.ConfigError` naming where it came from.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
import re
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from tierstore.errors import ConfigError
from tierstore.tiers._engine import engine_names

__all__ = [
    "ALIASES",
    "ENV_PREFIX",
    "MAX_SIZE",
    "MAX_TIMEOUT",
    "StoreConfig",
    "check_timeout",
    "parse_size",
    "unknown_setting",
]

ENV_PREFIX = "TIERSTORE_"

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

# Sizes beyond a signed 64-bit byte count cannot be a real capacity; treat them as typos.
MAX_SIZE = (1 << 63) - 1

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": KiB,
    "mib": MiB,
    "gib": GiB,
    "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"\s*([+-]?)\s*([0-9]*)(?:\.([0-9]*))?\s*([A-Za-z]*)\s*", flags=re.ASCII)
# More digits than this cannot be a real size (2**63 has 19); refusing them early also keeps
# int() away from its 4300-digit limit.
_MAX_DIGITS = 40
_INT_RE = re.compile(r"\s*[+-]?[0-9]+\s*", flags=re.ASCII)

ALIASES: Mapping[str, str] = {"disk_dir": "disk_dirs"}
"""Keywords accepted for a field under another name: ``disk_dir=`` is ``disk_dirs``."""

DirectIO = Literal["auto", "on", "off"]
Checksum = Literal["crc32c", "none"]


def parse_size(value: str | int, *, name: str) -> int:
    """Parse a byte size such as ``4096``, ``"64MiB"``, ``"1.5 GB"`` or ``"unlimited"``.

    Units are KB/MB/GB/TB (powers of 10) and KiB/MiB/GiB/TiB (powers of 2), case-insensitive.
    Decimals are exact (``"4.1GB"`` is 4100000000 bytes) and only ASCII digits count.
    ``"unlimited"`` (or ``"inf"``) means the largest representable size.

    Args:
        value: the text or integer to parse.
        name: the variable or keyword it came from, quoted in errors.

    Raises:
        ConfigError: negative, fractional bytes (``"1.9999999999999999999GiB"`` too), unknown
            unit, not ASCII digits, or more than 2**63-1 bytes.
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(f"{name}={value!r}: expected a byte size such as 4096 or '64MiB'")
    if isinstance(value, int):
        size = value
    else:
        if value.strip().lower() in {"unlimited", "inf", "infinity"}:
            return MAX_SIZE
        size = _parse_size_text(value, name=name)
    if size < 0:
        raise ConfigError(f"{name}={value!r}: a size cannot be negative")
    if size > MAX_SIZE:
        raise ConfigError(f"{name}={value!r}: larger than 2**63-1 bytes; check the unit")
    return size


def _parse_size_text(text: str, *, name: str) -> int:
    """The bytes ``text`` names, computed exactly: decimals never go through a float.

    A float would reject ``4.1GB`` (4.1e9 is not exactly 4100000000.0 after the product) and
    round ``1.9999999999999999999GiB`` up to 2 GiB, so the digits are read as an integer
    numerator over a power of ten.
    """
    m = _SIZE_RE.fullmatch(text)
    if m is None or not (m.group(2) or m.group(3)):
        raise ConfigError(
            f"{name}={text!r}: not a byte size; use an integer number of bytes, a number "
            "with a unit KB/MB/GB/TB (powers of 10) or KiB/MiB/GiB/TiB (powers of 2), or "
            "'unlimited'"
        )
    sign, whole, fraction, unit = m.groups()
    fraction = fraction or ""
    if sign == "-":
        raise ConfigError(f"{name}={text!r}: a size cannot be negative")
    factor = _UNITS.get(unit.lower())
    if factor is None:
        raise ConfigError(
            f"{name}={text!r}: unknown unit {unit!r}; use B, KB, MB, GB, TB, KiB, MiB, GiB or TiB"
        )
    if len(whole.lstrip("0")) > _MAX_DIGITS:
        raise ConfigError(f"{name}={text!r}: larger than 2**63-1 bytes; check the unit")
    fraction = fraction.rstrip("0")
    if len(fraction) > _MAX_DIGITS:
        raise ConfigError(f"{name}={text!r}: a size must be a whole number of bytes")
    numerator = int(whole + fraction or "0") * factor
    denominator = int(10 ** len(fraction))
    if numerator % denominator:
        raise ConfigError(f"{name}={text!r}: a size must be a whole number of bytes")
    return numerator // denominator


MAX_TIMEOUT = 1e9
"""The longest timeout in seconds (about 31 years): waits far beyond it overflow the clocks
that threads and event loops wait on. ``None`` waits forever instead."""


def check_timeout(value: object, *, name: str, allow_none: bool = True) -> float | None:
    """``value`` as seconds to wait: a positive, finite number, or ``None`` (forever).

    Args:
        value: what the caller passed.
        name: the keyword it came from, quoted in errors.
        allow_none: whether ``None`` (wait forever) is allowed.

    Raises:
        ConfigError: not a number (``"30"`` too), not positive, ``nan``, infinite or above
            :data:`MAX_TIMEOUT`.
    """
    if value is None and allow_none:
        return None
    forever = "; pass None to wait forever" if allow_none else ""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(f"{name}={value!r}: expected a number of seconds{forever}")
    try:
        seconds = float(value)
    except OverflowError:  # an int too big for a float
        seconds = math.inf if value > 0 else -math.inf  # type: ignore[operator]
    if math.isnan(seconds) or seconds <= 0:
        raise ConfigError(f"{name}={value!r}: must be a positive number of seconds{forever}")
    if seconds > MAX_TIMEOUT:
        raise ConfigError(f"{name}={value!r}: must be at most {MAX_TIMEOUT:.0e} seconds{forever}")
    return seconds


def _parse_int(value: str | int, *, name: str, low: int, high: int) -> int:
    # Only ASCII digits: int() would also take "\u0668" (an Arabic-Indic eight) and "1_6".
    if isinstance(value, bool) or not (
        isinstance(value, int) or (isinstance(value, str) and _INT_RE.fullmatch(value))
    ):
        raise ConfigError(f"{name}={value!r}: expected an integer from {low} to {high}")
    if isinstance(value, str) and len(value.strip().lstrip("+-").lstrip("0")) > _MAX_DIGITS:
        raise ConfigError(f"{name}={value!r}: must be from {low} to {high}")
    number = int(value)
    if not low <= number <= high:
        raise ConfigError(f"{name}={value!r}: must be from {low} to {high}")
    return number


def _parse_choice(value: str, *, name: str, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value.strip().lower() not in choices:
        raise ConfigError(f"{name}={value!r}: must be one of {', '.join(choices)}")
    return value.strip().lower()


def _parse_dirs(
    value: str | os.PathLike[str] | tuple[str | os.PathLike[str], ...] | list[str], *, name: str
) -> tuple[Path, ...]:
    """The spill directories ``value`` names.

    Only the environment variable is split on ``os.pathsep``: a variable holds one string. A
    keyword names one path, which may contain ``:``, or several as a list or tuple.
    """
    parts: list[str | os.PathLike[str]]
    if isinstance(value, str) and name == ENV_PREFIX + "DISK_DIR":
        parts = [p for p in value.split(os.pathsep) if p]
    elif isinstance(value, (str, os.PathLike)):
        parts = [value] if os.fspath(value) else []
    elif isinstance(value, (tuple, list)):
        parts = list(value)
        bad = [p for p in parts if not isinstance(p, (str, os.PathLike)) or not os.fspath(p)]
        if bad:
            raise ConfigError(f"{name}={value!r}: {bad[0]!r} is not a directory path")
    else:
        raise ConfigError(f"{name}={value!r}: expected a directory or a list of directories")
    if not parts:
        raise ConfigError(
            f"{name}={value!r}: names no directory; give a directory (several separated by "
            f"{os.pathsep!r} are striped), or unset it for the default"
        )
    dirs = tuple(Path(os.path.expanduser(os.fspath(p))).absolute() for p in parts)
    # The same directory spelled two ways (``..``, a symbolic link) is still one directory.
    if len({os.path.realpath(d) for d in dirs}) != len(dirs):
        raise ConfigError(f"{name}={value!r}: lists the same directory twice")
    return dirs


def _physical_memory_bytes(
    proc_cgroup: Path = Path("/proc/self/cgroup"), mount: Path = Path("/sys/fs/cgroup")
) -> int:
    """Physical memory, or the memory limit of this process's cgroup when it is confined to
    less: the smallest ``memory.max`` (cgroup v2) or ``memory.limit_in_bytes`` (v1) of the
    cgroup ``proc_cgroup`` names and of each of its ancestors up to ``mount``. Slurm, systemd
    and containers without their own cgroup namespace set the limit there, not at the root.
    """
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        # A cgroup's name is any bytes: undecodable ones name no limit file, and raise nothing.
        lines = proc_cgroup.read_bytes().decode("utf-8", "surrogateescape").splitlines()
    except OSError:
        lines = []
    places = [(mount, "memory.max"), (mount / "memory", "memory.limit_in_bytes")]
    for line in lines:
        _, controllers, path = line.split(":", 2) if line.count(":") >= 2 else ("", "", "")
        if not controllers:
            base, name = mount, "memory.max"  # v2: "0::/path"
        elif "memory" in controllers.split(","):
            base, name = mount / "memory", "memory.limit_in_bytes"
        else:
            continue
        if ".." in Path(path).parts:  # a cgroup outside this namespace's root
            continue
        here = base / path.lstrip("/")
        while here != base and base in here.parents:
            places.append((here, name))
            here = here.parent
    for directory, name in places:
        try:
            text = (directory / name).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


def _default_disk_dir() -> tuple[Path, ...]:
    # /var/tmp survives on disk where /tmp is often a tmpfs, and spilling to a tmpfs would
    # put the "disk" tier back into RAM.
    var_tmp = Path("/var/tmp")
    if var_tmp.is_dir() and os.access(var_tmp, os.W_OK | os.X_OK):
        return (var_tmp,)
    return (Path(tempfile.gettempdir()),)


def _local_ranks() -> int:
    """Processes of this job on this machine: ``LOCAL_WORLD_SIZE`` (torchrun sets it), else 1.

    Any value but a positive integer counts as 1: the variable is the launcher's, and it only
    divides a default.
    """
    text = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
    return int(text) if text.isascii() and text.isdigit() and int(text) > 0 else 1


def _default_host_bytes() -> int:
    # A quarter of RAM leaves room for the model, the data loader and the page cache; on a GPU
    # machine it is also the size of the pinned pool, which the OS cannot swap or reclaim.
    # Each rank torchrun starts on the machine opens its own store: they share that quarter,
    # so that 8 ranks do not claim twice the machine's memory between them.
    return _physical_memory_bytes() // 4 // _local_ranks()


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """Every knob of a store. Build it with :meth:`from_env`; see ``docs/configuration.md``."""

    device_bytes: int = 0
    """Bytes of stored tensors allowed to stay on their accelerator; the newest stay."""
    host_bytes: int = dataclasses.field(default_factory=_default_host_bytes)
    """Host tier capacity (on a GPU machine, the pinned pool). Default: a quarter of physical
    memory (or of the cgroup limit), divided by ``LOCAL_WORLD_SIZE`` when it is set."""
    disk_bytes: int | None = None
    """Disk tier capacity; ``None`` means the free space under the spill directories."""
    disk_dirs: tuple[Path, ...] = dataclasses.field(default_factory=_default_disk_dir)
    """Parent directories of the private per-process spill directories; several are striped."""
    min_bytes: int = MiB
    """Tensors smaller than this stay where they are."""
    prefetch_bytes: int = 256 * MiB
    """How many bytes ahead of backward the store brings tensors back; a tensor bigger than
    this is brought back alone once nothing else is (0 turns prefetching off)."""
    max_inflight_bytes: int = 256 * MiB
    """Bytes being moved down at once before :meth:`put` waits (the save semaphore)."""
    io_threads: int = 8
    """Threads issuing disk I/O: 8 requests of 8 MiB in flight read into freshly allocated
    tensors faster than 4 (docs/disk-engine.md, "Defaults")."""
    io_chunk_bytes: int = 8 * MiB
    """Size of one disk request; a multiple of 4096."""
    direct_io: DirectIO = "auto"
    """O_DIRECT: ``auto`` uses it where the filesystem accepts it."""
    disk_format: str = "raw"
    """The disk engine, by its registered name: ``raw`` extents, ``zarr`` (one zarr v3 array
    per tensor), or an engine of your own (Note: [Engines register by name])."""
    checksum: Checksum = "crc32c"
    """Checksum of spilled bytes, verified on every read."""

    def __post_init__(self) -> None:
        """Check and normalize every field, as :meth:`from_env` does.

        A config built directly was used as given: ``checksum="CRC32C"`` turned checksums off
        (the engine compares with ``"crc32c"``), a negative ``host_bytes`` ran, and
        ``io_chunk_bytes=1000`` failed every spill with EINVAL.

        Raises:
            ConfigError: a bad value, named with its field.
        """
        for f in dataclasses.fields(self):
            value = _parse_field(f.name, f.name, getattr(self, f.name))
            object.__setattr__(self, f.name, value)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, /, **overrides: object) -> StoreConfig:
        """Read every ``TIERSTORE_*`` variable, then apply keyword overrides.

        Args:
            env: the environment to read (positional only); ``os.environ`` by default.
            **overrides: field names of this class with a value (text or number); they win.
                ``None`` is no override (the environment or the default stands), except for
                ``disk_bytes``, where it means no cap.

        Raises:
            ConfigError: an unknown keyword, or a bad value, named with the variable.
        """
        env = os.environ if env is None else env
        raw: dict[str, tuple[str, object]] = {}
        fields = {f.name for f in dataclasses.fields(cls)}
        env_names = {"disk_dirs": ENV_PREFIX + "DISK_DIR"}
        for field in fields:
            var = env_names.get(field, ENV_PREFIX + field.upper())
            if var in env:
                raw[field] = (var, env[var])
        known_vars = {env_names.get(f, ENV_PREFIX + f.upper()) for f in fields}
        for var in env:
            if var.startswith(ENV_PREFIX) and var not in known_vars:
                raise ConfigError(
                    f"{var}={env[var]!r}: unknown variable; known ones are "
                    f"{', '.join(sorted(known_vars))}"
                )
        for key, value in overrides.items():
            field = ALIASES.get(key, key)
            if field not in fields:
                raise unknown_setting(key, value)
            if value is not None or field == "disk_bytes":
                raw[field] = (key, value)
        return cls._parse(raw)

    @classmethod
    def _parse(cls, raw: Mapping[str, tuple[str, object]]) -> StoreConfig:
        values: dict[str, object] = {}
        for field, (name, value) in raw.items():
            values[field] = _parse_field(field, name, value)
        return cls(**values)  # type: ignore[arg-type]

    def replace(self, **changes: object) -> StoreConfig:
        """A copy with some fields changed, parsed and checked like :meth:`from_env` overrides
        (``None`` changes nothing, except for ``disk_bytes``, where it means no cap)."""
        raw = {f.name: (f.name, getattr(self, f.name)) for f in dataclasses.fields(self)}
        for key, value in changes.items():
            field = ALIASES.get(key, key)
            if field not in raw:
                raise unknown_setting(key, value)
            if value is not None or field == "disk_bytes":
                raw[field] = (key, value)
        return StoreConfig._parse(raw)


def unknown_setting(key: str, value: object, also: tuple[str, ...] = ()) -> ConfigError:
    """The error for keyword ``key``, which names no setting: it lists every keyword that
    does (the fields, their aliases, and ``also``, the caller's own keywords)."""
    known = {f.name for f in dataclasses.fields(StoreConfig)} | set(ALIASES) | set(also)
    names = ", ".join(sorted(known))
    return ConfigError(f"{key}={value!r}: unknown setting; known ones are {names}")


def _parse_field(field: str, name: str, value: object) -> object:
    if field in {"device_bytes", "host_bytes", "min_bytes", "prefetch_bytes"}:
        return parse_size(value, name=name)  # type: ignore[arg-type]
    if field == "disk_bytes":
        return None if value is None else parse_size(value, name=name)  # type: ignore[arg-type]
    if field == "max_inflight_bytes":
        size = parse_size(value, name=name)  # type: ignore[arg-type]
        if size == 0:
            raise ConfigError(f"{name}={value!r}: must be positive, or nothing could ever move")
        return size
    if field == "io_chunk_bytes":
        size = parse_size(value, name=name)  # type: ignore[arg-type]
        if not 4096 <= size <= GiB:
            raise ConfigError(f"{name}={value!r}: must be from 4KiB to 1GiB")
        if size % 4096:
            raise ConfigError(
                f"{name}={value!r}: must be a multiple of 4096 (O_DIRECT transfers whole pages)"
            )
        return size
    if field == "io_threads":
        return _parse_int(value, name=name, low=1, high=256)  # type: ignore[arg-type]
    if field == "direct_io":
        return _parse_choice(value, name=name, choices=("auto", "on", "off"))  # type: ignore[arg-type]
    if field == "disk_format":
        return _parse_choice(value, name=name, choices=engine_names())  # type: ignore[arg-type]
    if field == "checksum":
        return _parse_choice(value, name=name, choices=("crc32c", "none"))  # type: ignore[arg-type]
    if field == "disk_dirs":
        return _parse_dirs(value, name=name)  # type: ignore[arg-type]
    raise AssertionError(field)
