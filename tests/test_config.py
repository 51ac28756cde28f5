"""StoreConfig: units, overrides, and a clear ConfigError for every bad value."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tierstore import ConfigError, StoreConfig
from tierstore.config import parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4096", 4096),
        ("0", 0),
        ("1KB", 1000),
        ("1kb", 1000),
        ("2 MB", 2_000_000),
        ("1GB", 10**9),
        ("1KiB", 1024),
        ("64MiB", 64 << 20),
        ("64mib", 64 << 20),
        ("1.5GiB", 3 << 29),
        ("3TiB", 3 << 40),
        ("7B", 7),
        ("unlimited", (1 << 63) - 1),
        (123, 123),
    ],
)
def test_sizes_accept_units(text: str | int, expected: int) -> None:
    assert parse_size(text, name="X") == expected


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("-1", "negative"),
        ("-5MiB", "negative"),
        ("12 furlongs", "unknown unit 'furlongs'"),
        ("MiB", "or 'unlimited'"),
        ("", "not a byte size"),
        ("1.5B", "whole number"),
        ("99999999999TiB", "larger than 2**63-1"),
        ("0x10", "not a byte size"),
        ("1e9", "not a byte size"),
    ],
)
def test_bad_sizes_name_the_variable_and_value(text: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        StoreConfig.from_env({"TIERSTORE_HOST_BYTES": text})
    msg = str(info.value)
    assert msg.startswith(f"TIERSTORE_HOST_BYTES={text!r}")
    assert fragment in msg


# One bad value for every TIERSTORE_* variable, each named in the error.
BAD_VALUES = {
    "TIERSTORE_DEVICE_BYTES": "lots",
    "TIERSTORE_HOST_BYTES": "-64MiB",
    "TIERSTORE_DISK_BYTES": "10 parsecs",
    "TIERSTORE_DISK_DIR": "",
    "TIERSTORE_MIN_BYTES": "1.25",
    "TIERSTORE_PREFETCH_BYTES": "99999999999999TiB",
    "TIERSTORE_MAX_INFLIGHT_BYTES": "0",
    "TIERSTORE_IO_THREADS": "zero",
    "TIERSTORE_IO_CHUNK_BYTES": "5000",
    "TIERSTORE_DIRECT_IO": "sometimes",
    "TIERSTORE_DISK_FORMAT": "hdf5",
    "TIERSTORE_CHECKSUM": "md5",
}


@pytest.mark.parametrize(("var", "value"), sorted(BAD_VALUES.items()))
def test_every_variable_rejects_a_bad_value(var: str, value: str) -> None:
    with pytest.raises(ConfigError, match=var) as info:
        StoreConfig.from_env({var: value})
    assert repr(value) in str(info.value) or value in str(info.value)
    assert isinstance(info.value, ValueError)


def test_every_field_has_a_variable_tested() -> None:
    names = {
        "TIERSTORE_DISK_DIR" if f.name == "disk_dirs" else f"TIERSTORE_{f.name.upper()}"
        for f in dataclasses.fields(StoreConfig)
    }
    assert names == set(BAD_VALUES)


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("TIERSTORE_IO_THREADS", "0"),
        ("TIERSTORE_IO_THREADS", "100000"),
        ("TIERSTORE_IO_CHUNK_BYTES", "2GiB"),
        ("TIERSTORE_IO_CHUNK_BYTES", "1KiB"),
    ],
)
def test_numbers_out_of_range(var: str, value: str) -> None:
    with pytest.raises(ConfigError, match=var):
        StoreConfig.from_env({var: value})


def test_none_is_no_override_whichever_way_the_config_is_made() -> None:
    base = StoreConfig.from_env({"TIERSTORE_HOST_BYTES": "64MiB"}, disk_bytes="1GiB")
    assert (
        StoreConfig.from_env({"TIERSTORE_HOST_BYTES": "64MiB"}, host_bytes=None).host_bytes
        == 64 << 20
    )
    assert base.replace(host_bytes=None, min_bytes=None) == base
    assert base.replace(disk_bytes=None).disk_bytes is None  # no cap


def test_a_bad_keyword_is_named_as_the_keyword() -> None:
    with pytest.raises(ConfigError, match=r"io_chunk_bytes=5000: must be a multiple of 4096"):
        StoreConfig.from_env({}, io_chunk_bytes=5000)
    with pytest.raises(ConfigError, match=r"io_chunk_bytes=5000: must be a multiple of 4096"):
        StoreConfig.from_env({}).replace(io_chunk_bytes=5000)


def test_environment_read_and_overrides_win(tmp_path: Path) -> None:
    env = {
        "TIERSTORE_DEVICE_BYTES": "1MiB",
        "TIERSTORE_HOST_BYTES": "64MiB",
        "TIERSTORE_DISK_BYTES": "1GB",
        "TIERSTORE_DISK_DIR": f"{tmp_path}/a:{tmp_path}/b",
        "TIERSTORE_MIN_BYTES": "4KiB",
        "TIERSTORE_PREFETCH_BYTES": "32MiB",
        "TIERSTORE_MAX_INFLIGHT_BYTES": "16MiB",
        "TIERSTORE_IO_THREADS": "8",
        "TIERSTORE_IO_CHUNK_BYTES": "4MiB",
        "TIERSTORE_DIRECT_IO": "OFF",
        "TIERSTORE_DISK_FORMAT": "zarr",
        "TIERSTORE_CHECKSUM": "none",
    }
    cfg = StoreConfig.from_env(env)
    assert cfg.device_bytes == 1 << 20
    assert cfg.host_bytes == 64 << 20
    assert cfg.disk_bytes == 10**9
    assert cfg.disk_dirs == (tmp_path / "a", tmp_path / "b")
    assert cfg.min_bytes == 4096
    assert cfg.prefetch_bytes == 32 << 20
    assert cfg.max_inflight_bytes == 16 << 20
    assert cfg.io_threads == 8
    assert cfg.io_chunk_bytes == 4 << 20
    assert cfg.direct_io == "off"
    assert cfg.disk_format == "zarr"
    assert cfg.checksum == "none"

    over = StoreConfig.from_env(env, host_bytes="1GiB", io_threads=2, disk_dir=str(tmp_path))
    assert over.host_bytes == 1 << 30
    assert over.io_threads == 2
    assert over.disk_dirs == (tmp_path,)
    assert over.device_bytes == 1 << 20  # untouched variables still come from the environment


def test_bad_override_names_the_keyword() -> None:
    with pytest.raises(ConfigError, match=r"host_bytes='lots'"):
        StoreConfig.from_env({}, host_bytes="lots")
    with pytest.raises(ConfigError, match="unknown setting"):
        StoreConfig.from_env({}, hostbytes="1GiB")


def test_unknown_variable_is_a_typo_not_silence() -> None:
    with pytest.raises(ConfigError, match="TIERSTORE_HOST_BYTE="):
        StoreConfig.from_env({"TIERSTORE_HOST_BYTE": "1GiB"})


def test_defaults_are_sane() -> None:
    cfg = StoreConfig.from_env({})
    assert cfg.device_bytes == 0
    assert cfg.host_bytes > 0
    assert cfg.disk_bytes is None
    assert cfg.min_bytes == 1 << 20
    assert cfg.io_chunk_bytes % 4096 == 0
    assert cfg.direct_io == "auto" and cfg.disk_format == "raw"
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.host_bytes = 1  # type: ignore[misc]


def test_replace_parses_like_overrides() -> None:
    cfg = StoreConfig.from_env({}).replace(host_bytes="2KiB")
    assert cfg.host_bytes == 2048
    with pytest.raises(ConfigError, match="io_threads"):
        cfg.replace(io_threads=-1)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4.1GB", 4_100_000_000),
        ("8.2MB", 8_200_000),
        ("16.1KB", 16_100),
        ("0.3KB", 300),
        ("1.25GiB", 5 << 28),
        ("2.000000000000000000001KB", None),
        ("1.9999999999999999999GiB", None),  # a float reads it as 2 GiB
        ("0.1B", None),
        (".5KiB", 512),
        ("5.", 5),
        ("1." + "0" * 30 + "KB", 1000),
    ],
)
def test_decimal_sizes_are_exact(text: str, expected: int | None) -> None:
    """Decimals are read exactly, never through a float that rounds them."""
    if expected is None:
        with pytest.raises(ConfigError, match="whole number of bytes") as info:
            parse_size(text, name="TIERSTORE_HOST_BYTES")
        assert str(info.value).startswith(f"TIERSTORE_HOST_BYTES={text!r}")
    else:
        assert parse_size(text, name="X") == expected


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("TIERSTORE_IO_THREADS", "\u0668"),  # an Arabic-Indic eight
        ("TIERSTORE_IO_THREADS", "1_6"),
        ("TIERSTORE_IO_THREADS", "\uff18"),  # a fullwidth eight
        ("TIERSTORE_IO_THREADS", "9" * 5000),  # past int()'s own 4300-digit limit
        ("TIERSTORE_HOST_BYTES", "1_024"),
        ("TIERSTORE_HOST_BYTES", "\u0668MiB"),
        ("TIERSTORE_HOST_BYTES", "1" + "0" * 5000),
    ],
)
def test_numbers_take_only_ascii_digits(var: str, value: str) -> None:
    with pytest.raises(ConfigError) as info:
        StoreConfig.from_env({var: value})
    assert str(info.value).startswith(f"{var}={value!r}")


def test_integers_with_ascii_digits_and_spaces_are_fine() -> None:
    assert StoreConfig.from_env({"TIERSTORE_IO_THREADS": " 16 "}).io_threads == 16
    assert StoreConfig.from_env({}, io_threads="+4").io_threads == 4


def test_a_disk_dir_keyword_is_one_path_even_with_a_colon(tmp_path: Path) -> None:
    """Only the environment variable is split on ':'; a keyword string is one path."""
    odd = tmp_path / "has:colon"
    cfg = StoreConfig.from_env({}, disk_dir=str(odd))
    assert cfg.disk_dirs == (odd,)
    assert StoreConfig.from_env({}, disk_dir=odd).disk_dirs == (odd,)
    many = StoreConfig.from_env({}, disk_dir=[str(odd), tmp_path / "b"])
    assert many.disk_dirs == (odd, tmp_path / "b")
    env = StoreConfig.from_env({"TIERSTORE_DISK_DIR": f"{tmp_path}/a:{tmp_path}/b"})
    assert env.disk_dirs == (tmp_path / "a", tmp_path / "b")
    for bad in ([str(odd), 3], [""], ""):
        with pytest.raises(ConfigError, match="disk_dir="):
            StoreConfig.from_env({}, disk_dir=bad)


def _known_ones(err: ConfigError) -> set[str]:
    return set(str(err).split("known ones are ", 1)[1].split(", "))


@pytest.mark.parametrize("cls", ["TieredStore", "AsyncTieredStore"])
def test_the_unknown_keyword_error_lists_every_keyword_the_store_accepts(cls: str) -> None:
    import inspect

    import tierstore

    store_class = getattr(tierstore, cls)
    params = inspect.signature(store_class).parameters.values()
    named = {p.name for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD}
    # **overrides are StoreConfig's fields, under their names or an alias (disk_dir=).
    fields = {f.name for f in dataclasses.fields(StoreConfig)}
    with pytest.raises(ConfigError, match="hostbytes='1GiB': unknown setting") as info:
        store_class(hostbytes="1GiB")
    known = _known_ones(info.value)
    assert known == named | fields | {"disk_dir"}
    for name in known - named:  # each one the overrides take is accepted by the config
        assert name in fields or StoreConfig.from_env({}, **{name: "/var/tmp"})


def test_config_errors_list_the_aliases_too() -> None:
    fields = {f.name for f in dataclasses.fields(StoreConfig)}
    with pytest.raises(ConfigError) as info:
        StoreConfig.from_env({}, hostbytes="1GiB")
    assert _known_ones(info.value) == fields | {"disk_dir"}
    with pytest.raises(ConfigError) as info:
        StoreConfig.from_env({}).replace(hostbytes="1GiB")
    assert _known_ones(info.value) == fields | {"disk_dir"}


@pytest.mark.parametrize(
    ("field", "value", "fragment"),
    [
        ("host_bytes", -(1 << 20), "cannot be negative"),
        ("io_chunk_bytes", 1000, "from 4KiB to 1GiB"),
        ("io_threads", 0, "from 1 to 256"),
        ("checksum", "md5", "must be one of crc32c, none"),
        ("direct_io", "yes", "must be one of auto, on, off"),
        ("disk_dirs", (), "names no directory; give a directory"),
        ("max_inflight_bytes", 0, "must be positive"),
    ],
)
def test_a_config_built_directly_is_checked(field: str, value: object, fragment: str) -> None:
    """A ``StoreConfig(...)`` was used as given: no check named the bad value."""
    with pytest.raises(ConfigError, match=fragment) as info:
        StoreConfig(**{field: value})  # type: ignore[arg-type]
    assert str(info.value).startswith(f"{field}=")


def test_a_config_built_directly_is_normalized_as_from_env_would() -> None:
    """``checksum="CRC32C"`` built directly turned checksums off: the engine compares with
    ``"crc32c"``, and a corrupted spill came back as other values."""
    built = StoreConfig(
        checksum="CRC32C",  # type: ignore[arg-type]
        direct_io="ON",  # type: ignore[arg-type]
        host_bytes="64MiB",  # type: ignore[arg-type]
        disk_dirs=("/tmp",),  # type: ignore[arg-type]
    )
    parsed = StoreConfig.from_env(
        {}, checksum="CRC32C", direct_io="ON", host_bytes="64MiB", disk_dirs=["/tmp"]
    )
    assert built == parsed
    assert (built.checksum, built.direct_io, built.host_bytes) == ("crc32c", "on", 64 << 20)
    assert built.disk_dirs == (Path("/tmp"),)


def test_one_directory_spelled_two_ways_is_refused(tmp_path: Path) -> None:
    """``/var/../var/tmp`` beside ``/var/tmp``, or a link beside its target, was taken as two
    directories: two stripes on one disk."""
    d = tmp_path / "spill"
    d.mkdir()
    (tmp_path / "link").symlink_to(d)
    for other in (tmp_path / "x" / ".." / "spill", tmp_path / "link"):
        (tmp_path / "x").mkdir(exist_ok=True)
        with pytest.raises(ConfigError, match="the same directory twice"):
            StoreConfig.from_env({"TIERSTORE_DISK_DIR": f"{d}:{other}"})
    assert len(StoreConfig.from_env({"TIERSTORE_DISK_DIR": f"{d}:{tmp_path}"}).disk_dirs) == 2


@pytest.mark.parametrize("version", ["v2", "v1"])
def test_the_host_default_follows_the_limit_of_the_process_own_cgroup(
    tmp_path: Path, version: str
) -> None:
    """Only the root cgroup's limit was read, which never carries one: under Slurm, systemd
    or a container sharing the host's cgroup namespace, the default host tier was a quarter
    of the node's memory, not of the job's limit."""
    from tierstore.config import _physical_memory_bytes

    mount = tmp_path / "cgroup"
    base = mount if version == "v2" else mount / "memory"
    name = "memory.max" if version == "v2" else "memory.limit_in_bytes"
    job, step = base / "job_7", base / "job_7" / "step_0"
    step.mkdir(parents=True)
    (job / name).write_text("1073741824\n")  # the job's limit, on the parent
    (step / name).write_text("max\n" if version == "v2" else "9223372036854771712\n")
    proc = tmp_path / "cgroup.txt"
    proc.write_text("0::/job_7/step_0\n" if version == "v2" else "4:memory:/job_7/step_0\n")
    assert _physical_memory_bytes(proc, mount) == 1 << 30
    (job / name).write_text("max\n" if version == "v2" else "9223372036854771712\n")
    assert _physical_memory_bytes(proc, mount) == _physical_memory_bytes(tmp_path / "no", mount)
    assert _physical_memory_bytes(tmp_path / "no", mount) > 1 << 30


def test_odd_cgroup_names_and_paths_leave_the_host_default_alone(tmp_path: Path) -> None:
    """A cgroup named with bytes that are not UTF-8 made every store fail to open; a path
    above the namespace's root (``0::/../x``) read limit files outside the cgroup mount."""
    from tierstore.config import _physical_memory_bytes

    mount = tmp_path / "sys" / "fs" / "cgroup"
    mount.mkdir(parents=True)
    (tmp_path / "sys" / "fs" / "memory.max").write_text("12345\n")
    free = _physical_memory_bytes(tmp_path / "none", mount)
    proc = tmp_path / "cgroup.txt"
    for content in (b"0::/\xff\xfe/x\n", b"0::/../x\n", b"garbage\n:\n1:\n"):
        proc.write_bytes(content)
        assert _physical_memory_bytes(proc, mount) == free
