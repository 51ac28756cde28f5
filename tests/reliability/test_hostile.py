"""Hostile input: odd tensors, bad spill directories, junk in the environment.

Each case ends in a clear ``TierStoreError`` subclass or a documented pass-through
(``docs/reliability.md`` lists which). ``tests/test_store.py`` already covers COO sparse,
meta, quantized, nested and non-tensors; ``tests/test_config.py`` the parser itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import tierstore
from tierstore import ConfigError, TieredStore, UnsupportedTensorError
from tierstore.testing import audit, internals, settled, wait_for

MiB = 1 << 20
MakeStore = Callable[..., TieredStore]
SRC = str(Path(__file__).resolve().parents[2] / "src")


# --------------------------------------------------------------------------- tensors


class LoggedTensor(torch.Tensor):
    """A plain Python subclass, as libraries make for tracing and logging."""


def _fake_tensor() -> torch.Tensor:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return torch.empty(4, 4)


HOSTILE: dict[str, tuple[Callable[[], object], str]] = {
    "sparse_csr": (lambda: torch.eye(4).to_sparse_csr(), "sparse_csr"),
    "sparse_csc": (lambda: torch.eye(4).to_sparse_csc(), "sparse_csc"),
    "sparse_bsr": (lambda: torch.eye(4).to_sparse_bsr((2, 2)), "sparse_bsr"),
    "subclass": (lambda: torch.ones(4).as_subclass(LoggedTensor), "LoggedTensor"),
    "fake_tensor": (_fake_tensor, "FakeTensor"),
    "meta_huge": (lambda: torch.empty(1 << 50, device="meta"), "meta"),
    "numpy_array": (lambda: torch.ones(3).numpy(), "ndarray"),
    "none": (lambda: None, "NoneType"),
    # Forward-mode AD's zeros: its disk write failed and paused the disk tier.
    "zerotensor": (lambda: torch._efficientzerotensor(1 << 20), "ZeroTensor"),
}
if hasattr(torch.Tensor, "to_mkldnn") and torch.backends.mkldnn.is_available():
    HOSTILE["mkldnn"] = (lambda: torch.ones(4, 4).to_mkldnn(), "mkldnn")


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_unstorable_tensors_raise_a_clear_error(make_store: MakeStore, name: str) -> None:
    make, fragment = HOSTILE[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch calls several of these layouts beta
        obj = make()
    store = make_store()
    with pytest.raises(UnsupportedTensorError, match=fragment) as info:
        store.put(obj)  # type: ignore[arg-type]
    assert isinstance(info.value, TypeError)
    assert store.stats().live_entries == 0 and store.stats().puts == 0
    audit(store)


@pytest.mark.parametrize("tier", ["host", "disk"])
@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(64, 33, dtype=torch.complex64).conj(),  # lazy conjugate bit
        lambda: torch.randn(64, 33, dtype=torch.complex64).conj().imag,
        lambda: torch._neg_view(torch.randn(64, 33)),  # lazy negative bit
        lambda: torch.randn(64, 33).t()[3:, ::2],
        lambda: torch.randn(1, 5000).expand(8, 5000),  # stride 0: 8 rows share one storage
        lambda: torch.randn(70, 70).diagonal(),
    ],
    ids=["conj", "conj-imag", "neg-view", "transposed-slice", "expanded", "diagonal"],
)
def test_lazy_views_come_back_with_their_values(
    make_store: MakeStore, make: Callable[[], torch.Tensor], tier: str
) -> None:
    t = make()
    expected = t.resolve_conj().resolve_neg().clone()
    store = make_store(device_bytes=0, host_bytes=1 << 40 if tier == "host" else 0)
    h = store.put(t)
    if tier == "disk":
        wait_for(lambda: store.tier_of(h) is tierstore.Tier.DISK)
    out = store.get(h)
    assert out.shape == t.shape and out.dtype == t.dtype
    assert torch.equal(out.resolve_conj().resolve_neg(), expected)


def test_autograd_and_inference_tensors_pass_through_as_plain_data(make_store: MakeStore) -> None:
    store = make_store(device_bytes=0, host_bytes=0)
    x = torch.randn(1000, requires_grad=True)
    y = x * 2  # a non-leaf with a grad_fn
    with torch.inference_mode():
        z = torch.randn(1000)
    hs = [store.put(y), store.put(z)]
    wait_for(lambda: all(store.tier_of(h) is tierstore.Tier.DISK for h in hs))
    out_y, out_z = (store.get(h) for h in hs)
    assert not out_y.requires_grad and out_y.grad_fn is None
    assert torch.equal(out_y, y.detach()) and torch.equal(out_z, z)


COPY_FAILS = """
    import gc, json, resource, torch, tierstore
    from tierstore.testing import audit, internals

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()

    def address_space():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[0]) * resource.getpagesize()

    store = tierstore.TieredStore(disk_dir={disk_dir!r}, min_bytes=0)
    base = torch.ones(64 << 20)  # 256 MiB
    view = base[::2]  # 128 MiB, not contiguous: the store keeps a compact copy of it
    with_base = rss()
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    # Too little address space left for the 128 MiB copy, enough for everything else.
    resource.setrlimit(resource.RLIMIT_AS, (address_space() + (48 << 20), hard))
    try:
        store.put(view)
    except Exception as exc:
        err = exc  # kept, as a notebook keeps the last exception
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    del view, base
    gc.collect()
    st = store.stats()
    audit(store)
    print(json.dumps({{
        "types": [c.__name__ for c in type(err).__mro__],
        "message": str(err),
        "freed": with_base - rss(),
        "live": st.live_entries, "puts": st.puts, "device": st.device.bytes,
        "device_peak": st.device.peak_bytes, "host": st.host.bytes,
        "states": internals(store).states(),
    }}))
    store.close()
"""


def test_a_view_whose_copy_cannot_be_allocated_is_refused_and_nothing_is_kept(
    disk_dir: Path,
) -> None:
    """Note: [A failed host copy keeps nothing]: a real allocation failure, under RLIMIT_AS."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(COPY_FAILS.format(disk_dir=str(disk_dir)))],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": SRC},
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["types"][:3] == ["TierFullError", "TierStoreError", "MemoryError"], out
    assert "134217728-byte float32 view" in out["message"]
    assert "Nothing was stored" in out["message"]
    assert (out["live"], out["puts"], out["device"], out["host"], out["states"]) == (
        0,
        0,
        0,
        0,
        [],
    )
    assert out["device_peak"] == 0  # the put undone leaves no peak either
    # The 256 MiB base left RSS although the error, and its traceback, are still alive.
    assert out["freed"] > 200 << 20, out
    assert list(disk_dir.iterdir()) == []


def test_an_older_view_whose_copy_fails_stays_on_its_device_until_memory_returns(
    make_store: MakeStore, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from tierstore.core import _moves as moves

    store = make_store(device_bytes=8 * 4000, host_bytes=1 << 30)
    base = torch.randn(8000)
    old = store.put(base[::2])  # 16000 bytes, room on the device: no copy yet
    real_compact = moves.compact
    out_of_memory = True

    def compact(t: torch.Tensor) -> torch.Tensor:
        if out_of_memory and not t.is_contiguous():
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory")
        return real_compact(t)

    monkeypatch.setattr(moves, "compact", compact)
    with caplog.at_level(logging.WARNING, logger="tierstore"):
        new = [store.put(torch.randn(4000)) for _ in range(3)]  # push the old one down
    assert store.state_of(old) is tierstore.TensorState.DEVICE  # kept, not lost
    assert sum("copying tensor #1" in r.getMessage() for r in caplog.records) == 1
    assert [store.state_of(h) for h in new] == [tierstore.TensorState.DEVICE] * 3
    out_of_memory = False
    new.append(store.put(torch.randn(4000)))  # the next put tries again
    assert store.state_of(old) is tierstore.TensorState.HOST
    assert torch.equal(store.get(old), base[::2])
    audit(store)


# --------------------------------------------------------------------------- disk directory


def test_disk_dir_missing_file_or_dangling_link_via_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    f = tmp_path / "a-file"
    f.write_text("x")
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    for value, fragment in [
        (str(tmp_path / "missing"), "does not exist"),
        (str(f), "not a directory; point it at a directory"),
        (str(dangling), "does not exist"),
        (os.pathsep.join([str(tmp_path), str(tmp_path)]), "same directory twice"),
    ]:
        monkeypatch.setenv("TIERSTORE_DISK_DIR", value)
        with pytest.raises(ConfigError, match="TIERSTORE_DISK_DIR") as info:
            TieredStore()
        assert fragment in str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "dangling"]


def test_unwritable_or_unreachable_disk_dir_is_refused_for_a_normal_user(
    tmp_path: Path,
) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to switch to an unprivileged user for the check")
    # pytest's tmp_path lives under a 0700 directory of root's: unreachable for nobody.
    unreachable = tmp_path / "unreachable"
    unreachable.mkdir()
    shared = Path(tempfile.mkdtemp(prefix="hostile-", dir="/tmp"))
    try:
        os.chmod(shared, 0o755)
        locked = shared / "locked"
        locked.mkdir(mode=0o755)  # reachable, but owned by root: nobody may not write here
        code = f"""
            import os
            import tierstore, tierstore.tiers.raw  # import first: the interpreter is under /root
            os.setgid(65534); os.setuid(65534)  # nobody
            for d in ({str(locked)!r}, {str(unreachable)!r}):
                try:
                    tierstore.TieredStore(disk_dir=d)
                except tierstore.ConfigError as exc:
                    print("CONFIG_ERROR", exc)
                else:
                    print("ACCEPTED", d)
        """
        proc = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": SRC, "HOME": "/nonexistent"},
            timeout=120,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        lines = proc.stdout.splitlines()
        assert len(lines) == 2 and all(x.startswith("CONFIG_ERROR") for x in lines), proc.stdout
        assert "TIERSTORE_DISK_DIR" in lines[0] and "not writable" in lines[0]
        assert "TIERSTORE_DISK_DIR" in lines[1] and "cannot be accessed" in lines[1]
        assert list(locked.iterdir()) == [] and list(unreachable.iterdir()) == []
    finally:
        shutil.rmtree(shared)


def test_root_is_not_stopped_by_permission_bits(tmp_path: Path) -> None:
    """Documented: as root a 0555 directory is writable, and the store uses it."""
    if os.geteuid() != 0:
        pytest.skip("only root bypasses permission bits")
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o555)
    with TieredStore(disk_dir=ro, host_bytes=0, min_bytes=0) as store:
        h = store.put(torch.arange(10.0))
        wait_for(lambda: store.tier_of(h) is tierstore.Tier.DISK)
        assert torch.equal(store.get(h), torch.arange(10.0))
    assert list(ro.iterdir()) == []


def _no_direct_fs(tmp_path: Path) -> Path:
    """A mounted ramfs: it refuses O_DIRECT (tmpfs accepts it since Linux 6.6)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a ramfs needs root")
    mnt = tmp_path / "ramfs"
    mnt.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "ramfs", "ramfs", str(mnt)], capture_output=True, text=True, check=False
    )
    if proc.returncode:
        pytest.skip(f"mount refused here: {proc.stderr.strip()}")
    try:
        fd = os.open(mnt / "probe", os.O_CREAT | os.O_RDWR | getattr(os, "O_DIRECT", 0), 0o600)
    except OSError:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(mnt / "probe")  # ramfs creates the file before refusing the flag
        return mnt
    os.close(fd)
    os.unlink(mnt / "probe")
    _umount(mnt)
    pytest.skip("this kernel's ramfs accepts O_DIRECT; no filesystem without it to test on")


def _umount(mnt: Path) -> None:
    if subprocess.run(["umount", str(mnt)], check=False).returncode:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_filesystem_without_o_direct_falls_back_in_auto_mode(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    mnt = _no_direct_fs(tmp_path)
    try:
        with caplog.at_level(logging.WARNING, logger="tierstore"):
            store = TieredStore(disk_dir=mnt, host_bytes=0, min_bytes=0, direct_io="auto")
        try:
            engine = internals(store).engine
            assert engine is not None
            assert "O_DIRECT is refused" in caplog.text
            assert engine.describe()["direct_io"] == {str(store.spill_dirs[0]): False}
            # The buffered fallback moves real bytes (straight through the engine: ramfs
            # reports no free space, so the store's disk tier itself has capacity 0).
            src = torch.randint(0, 256, (MiB + 4097,), dtype=torch.uint8)
            out = torch.empty_like(src)
            loop = internals(store).loop
            asyncio.run_coroutine_threadsafe(engine.write(10**9, src), loop).result(30)
            asyncio.run_coroutine_threadsafe(engine.read(10**9, out), loop).result(30)
            assert torch.equal(out, src)
            asyncio.run_coroutine_threadsafe(engine.delete(10**9), loop).result(30)
            assert store.stats().disk.capacity == 0
            with pytest.raises(tierstore.TierFullError, match="no tier has room"):
                store.put(torch.ones(1000))
        finally:
            store.close()
        assert list(mnt.iterdir()) == []
    finally:
        _umount(mnt)


def test_filesystem_without_o_direct_is_refused_when_direct_io_is_on(tmp_path: Path) -> None:
    mnt = _no_direct_fs(tmp_path)
    try:
        with pytest.raises(ConfigError, match="O_DIRECT"):
            TieredStore(disk_dir=mnt, direct_io="on")
        assert list(mnt.iterdir()) == [], "a refused store left its directory behind"
    finally:
        _umount(mnt)


def _mount(mnt: Path, *args: str) -> None:
    """``mount *args mnt`` as root, or skip the test saying why."""
    if os.geteuid() != 0:
        pytest.skip("mounting a test filesystem needs root")
    mnt.mkdir(exist_ok=True)
    proc = subprocess.run(["mount", *args, str(mnt)], capture_output=True, text=True, check=False)
    if proc.returncode:
        pytest.skip(f"mount refused here: {proc.stderr.strip()}")


def _loop_mounted(image: Path, size: int, mkfs: list[str], mnt: Path) -> Path:
    """A ``size``-byte image made with ``mkfs`` (its command and options) and loop-mounted on
    ``mnt``, as root, or skip the test saying why."""
    if shutil.which(mkfs[0]) is None:
        pytest.skip(f"{mkfs[0]} is not installed")
    with open(image, "wb") as f:
        f.truncate(size)
    made = subprocess.run(
        [*mkfs, "-q", "-F", str(image)], capture_output=True, text=True, check=False
    )
    if made.returncode:
        pytest.skip(f"{mkfs[0]} failed: {made.stderr.strip()}")
    _mount(mnt, "-o", "loop", str(image))
    return mnt


def _ext2(tmp_path: Path) -> Path:
    """A loop-mounted ext2: it takes O_DIRECT but has no fallocate, which glibc then emulates
    by writing a byte into each block, and O_DIRECT refuses that (EINVAL)."""
    mnt = _loop_mounted(
        tmp_path / "ext2.img", 96 * MiB, ["mkfs.ext2", "-m", "0"], tmp_path / "ext2"
    )
    fd = os.open(mnt / "probe", os.O_CREAT | os.O_RDWR | os.O_DIRECT, 0o600)
    try:
        os.posix_fallocate(fd, 0, 8192)
    except OSError:
        return mnt
    finally:
        os.close(fd)
        os.unlink(mnt / "probe")
    _umount(mnt)
    pytest.skip("this kernel's ext2 grows an O_DIRECT file with fallocate; nothing to test")


def test_a_filesystem_without_fallocate_spills_buffered_in_auto_mode(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    mnt = _ext2(tmp_path)
    try:
        with caplog.at_level(logging.WARNING, logger="tierstore"):
            store = TieredStore(disk_dir=mnt, host_bytes=0, min_bytes=0, io_chunk_bytes="2MiB")
        try:
            warned = [r.getMessage() for r in caplog.records if "O_DIRECT" in r.getMessage()]
            assert len(warned) == 1 and "posix_fallocate" in warned[0], warned
            tensors = [torch.randn(n) for n in (MiB + 5, 1000, 3 * MiB // 4)]  # 4 MiB, 4 KB, 3 MiB
            hs = [store.put(t) for t in tensors]
            wait_for(lambda: all(store.tier_of(h) is tierstore.Tier.DISK for h in hs))
            for h, t in zip(hs, tensors, strict=True):
                assert torch.equal(store.get(h), t)
            st = store.stats()
            assert st.write_errors == 0 and st.disk_available, st
        finally:
            store.close()
        assert list(mnt.iterdir()) == [mnt / "lost+found"]
    finally:
        _umount(mnt)


def _failing_disk(tmp_path: Path) -> tuple[Path, Path]:
    """A loop-mounted ext4 over a 256 MiB image in a 40 MiB tmpfs: once the tmpfs is full,
    writing back the page cache fails (ENOSPC from the loop device), the error a buffered
    write meets only in ``sync_file_range``. Returns (the ext4, the tmpfs)."""
    backing = tmp_path / "backing"
    _mount(backing, "-t", "tmpfs", "-o", "size=40m", "tmpfs")
    # Inode tables and journal written now, so that the tmpfs fills with data, later.
    mkfs = ["mkfs.ext4", "-E", "lazy_itable_init=0,lazy_journal_init=0"]
    try:
        return _loop_mounted(backing / "ext4.img", 256 * MiB, mkfs, tmp_path / "ext4"), backing
    except BaseException:
        _umount(backing)
        raise


def test_buffered_spills_on_a_failing_disk_never_come_back_wrong(tmp_path: Path) -> None:
    """A real disk error in write-back, met by eight I/O threads at once. A spill whose
    write-back failed keeps its tensor in memory; one the kernel fails after the check (ext4
    converting the extent it wrote, on a disk this full) is caught by its checksum at get.
    No tensor comes back with other values. Before each thread checked write-back on its own
    descriptor, 2 to 11 of these 64 tensors were lost a run (since, at most one, in two runs
    of five)."""
    mnt, backing = _failing_disk(tmp_path)
    try:
        store = TieredStore(
            disk_dir=mnt,
            direct_io="off",
            host_bytes=0,
            min_bytes=0,
            io_threads=8,
            io_chunk_bytes="2MiB",
        )
        try:
            tensors = [  # 64 blobs of 1 MiB + 4 KiB: one chunk each
                torch.randn(MiB // 4 + 1024, generator=torch.Generator().manual_seed(i))
                for i in range(64)
            ]
            handles = [store.put(t) for t in tensors]
            wait_for(lambda: settled(store), timeout=60)
            st = store.stats()
            assert st.write_errors > 0, f"no write-back failed: nothing was tested ({st})"
            for h, t in zip(handles, tensors, strict=True):
                with contextlib.suppress(tierstore.CorruptTensorError):
                    assert torch.equal(store.get(h), t)
        finally:
            store.close()
    finally:
        _umount(mnt)
        _umount(backing)


def test_a_filesystem_without_fallocate_is_refused_when_direct_io_is_on(tmp_path: Path) -> None:
    mnt = _ext2(tmp_path)
    try:
        with pytest.raises(ConfigError, match=r"refuses O_DIRECT.*posix_fallocate"):
            TieredStore(disk_dir=mnt, direct_io="on")
        assert list(mnt.iterdir()) == [mnt / "lost+found"]
    finally:
        _umount(mnt)


def test_the_probe_grows_its_file_as_the_engine_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without root: posix_fallocate refusing O_DIRECT files (EINVAL), as on ext2."""
    import errno
    import fcntl

    from tierstore.tiers.raw import probe_direct_io

    real_fallocate = os.posix_fallocate

    def fallocate(fd: int, offset: int, length: int) -> None:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        real_fallocate(fd, offset, length)

    if not probe_direct_io(tmp_path).supported:
        pytest.skip(f"{tmp_path} refuses O_DIRECT already")
    monkeypatch.setattr(os, "posix_fallocate", fallocate)
    probe = probe_direct_io(tmp_path)
    assert not probe.supported
    assert probe.reason == "growing it with posix_fallocate: Invalid argument (errno 22)"
    assert list(tmp_path.iterdir()) == []
    with TieredStore(disk_dir=tmp_path, host_bytes=0, min_bytes=0) as store:
        t = torch.randn(3 * MiB)
        h = store.put(t)
        wait_for(lambda: store.tier_of(h) is tierstore.Tier.DISK)
        assert torch.equal(store.get(h), t)
        assert store.stats().write_errors == 0


def _fill(directory: Path) -> Path:
    """Fill the filesystem under ``directory`` until ENOSPC, as another program would."""
    import errno

    filler = directory / "filler"
    with open(filler, "wb", buffering=0) as f:
        for block in (b"\0" * MiB, b"\0" * 4096):
            while True:
                try:
                    f.write(block)
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC
                    break
    return filler


def test_striped_directories_with_one_full_spill_to_the_other(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Note: [A full directory is skipped]: no write error, one warning, every tensor on disk."""
    full, roomy = tmp_path / "full", tmp_path / "roomy"
    _mount(full, "-t", "tmpfs", "-o", "size=16m", "tmpfs")
    try:
        _mount(roomy, "-t", "tmpfs", "-o", "size=160m", "tmpfs")
        try:
            filler = _fill(full)
            with caplog.at_level(logging.WARNING, logger="tierstore"):
                store = TieredStore(
                    disk_dir=[full, roomy], host_bytes=0, min_bytes=0, io_chunk_bytes="1MiB"
                )
                try:
                    # 2.5 MiB tensors (three chunks each, striped) and 64 KiB ones (packs).
                    tensors = [torch.randn(5 * MiB // 8 + i) for i in range(16)]
                    tensors += [torch.randn(16384 + i) for i in range(24)]
                    hs = [store.put(t) for t in tensors]  # no TierFullError
                    wait_for(lambda: all(store.tier_of(h) is tierstore.Tier.DISK for h in hs))
                    st = store.stats()
                    assert st.write_errors == 0 and st.disk_available, st
                    for h, t in zip(hs, tensors, strict=True):
                        assert torch.equal(store.get(h), t)
                    # The two tmpfs mounts draw the warning every spill directory in RAM
                    # draws; the one about the full directory must come once.
                    warned = [
                        r.getMessage()
                        for r in caplog.records
                        if "which keeps its files in memory" not in r.getMessage()
                    ]
                    assert len(warned) == 1, warned
                    assert f"spill directory {full}" in warned[0] and "is full" in warned[0]
                    # Room again in the full one: its chunks go there again.
                    filler.unlink()
                    more = [torch.randn(5 * MiB // 8 + i) for i in range(4)]
                    hs += [store.put(t) for t in more]
                    # (The gets above prefetched older ones back: only the new ones are asked.)
                    wait_for(lambda: all(store.tier_of(h) is tierstore.Tier.DISK for h in hs[-4:]))
                    (spill_full, _) = store.spill_dirs
                    assert (Path(spill_full) / "spill.raw").stat().st_size > 0
                    for h, t in zip(hs[-4:], more, strict=True):
                        assert torch.equal(store.get(h), t)
                    assert store.stats().write_errors == 0
                finally:
                    store.close()
            assert list(full.iterdir()) == [] and list(roomy.iterdir()) == []
        finally:
            _umount(roomy)
    finally:
        _umount(full)


def test_a_full_striped_directory_is_skipped_without_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The same with ENOSPC injected: growing the first directory's spill file fails."""
    import errno

    from tierstore.tiers.raw._spill_file import SpillFile

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    real_fallocate, real_free = os.posix_fallocate, SpillFile.free_space
    full = {"a": True}

    def fallocate(fd: int, offset: int, length: int) -> None:
        if full["a"] and os.readlink(f"/proc/self/fd/{fd}").startswith(f"{a}/"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fallocate(fd, offset, length)

    def free_space(self: Any) -> int:
        inside_a = str(self.path).startswith(f"{a}/")
        return 0 if full["a"] and inside_a else real_free(self)

    monkeypatch.setattr(os, "posix_fallocate", fallocate)
    monkeypatch.setattr(SpillFile, "free_space", free_space)
    with caplog.at_level(logging.WARNING, logger="tierstore"):
        store = TieredStore(disk_dir=[a, b], host_bytes=0, min_bytes=0, io_chunk_bytes="1MiB")
        try:
            tensors = [torch.randn(5 * MiB // 8 + i) for i in range(6)]
            tensors += [torch.randn(16384 + i) for i in range(6)]
            hs = [store.put(t) for t in tensors]
            wait_for(lambda: all(store.tier_of(h) is tierstore.Tier.DISK for h in hs))
            assert store.stats().write_errors == 0
            assert [r.getMessage().split(" is full")[0] for r in caplog.records] == [
                f"tierstore: spill directory {store.spill_dirs[0]}"
            ]
            spill_a = Path(store.spill_dirs[0]) / "spill.raw"
            assert spill_a.stat().st_size == 0
            full["a"] = False  # space came back
            more = torch.randn(5 * MiB // 8)
            hs.append(store.put(more))
            wait_for(lambda: store.tier_of(hs[-1]) is tierstore.Tier.DISK)
            assert spill_a.stat().st_size > 0
            for h, t in zip(hs, [*tensors, more], strict=True):
                assert torch.equal(store.get(h), t)
        finally:
            store.close()


def test_a_full_striped_directory_is_not_reopened_for_a_share_it_cannot_take(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Note: [A full directory is skipped]: with room for one chunk but not for its share of a
    blob (three chunks in one extent), the full directory was reopened, failed two growths
    and was marked full again, on every big blob."""
    import errno

    from tierstore.tiers.raw._spill_file import SpillFile

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    real_fallocate, real_free = os.posix_fallocate, SpillFile.free_space
    left = {"a": 3 * MiB // 2}  # room for a 1 MiB chunk, not for 3 MiB
    refused: list[int] = []

    def fallocate(fd: int, offset: int, length: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").startswith(f"{a}/"):
            if length > left["a"]:
                refused.append(length)
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            left["a"] -= length
        real_fallocate(fd, offset, length)

    def free_space(self: Any) -> int:
        return left["a"] if str(self.path).startswith(f"{a}/") else real_free(self)

    monkeypatch.setattr(os, "posix_fallocate", fallocate)
    monkeypatch.setattr(SpillFile, "free_space", free_space)
    with caplog.at_level(logging.INFO, logger="tierstore"):
        store = TieredStore(disk_dir=[a, b], host_bytes=0, min_bytes=0, io_chunk_bytes="1MiB")
        try:
            tensors = [torch.randn(6 * MiB // 4) for _ in range(8)]  # 6 MiB: 3 chunks each
            hs = []
            for t in tensors:  # one at a time: each is placed after the last one failed
                hs.append(store.put(t))
                wait_for(lambda: settled(store))
            assert len(refused) <= 2, f"the full directory was tried {len(refused)} times"
            reopened = [r for r in caplog.records if r.getMessage().endswith("has room again")]
            assert reopened == []
            assert store.stats().write_errors == 0
            for h, t in zip(hs, tensors, strict=True):
                assert torch.equal(store.get(h), t)
        finally:
            store.close()


@pytest.mark.parametrize("where", ["growth", "write"])
def test_a_failing_striped_directory_is_skipped_for_a_while(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, where: str
) -> None:
    """Note: [A failing directory is skipped]: one directory's spill file fails with an error
    a full disk does not explain (EROFS growing it, EIO writing it). Every big blob striped
    over it failed, the disk tier paused once a second, and the other directory sat unused."""
    import errno

    from tierstore.tiers.raw import _chunk_io, _striping

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    real_fallocate, real_pwrite = os.posix_fallocate, _chunk_io.pwrite_all
    failed: list[int] = []

    def in_a(fd: int) -> bool:
        return os.readlink(f"/proc/self/fd/{fd}").startswith(f"{a}/")

    def fallocate(fd: int, offset: int, length: int) -> None:
        if where == "growth" and in_a(fd):
            failed.append(length)
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
        real_fallocate(fd, offset, length)

    def pwrite_all(fd: int, view: memoryview, offset: int) -> None:
        if where == "write" and in_a(fd):
            failed.append(len(view))
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real_pwrite(fd, view, offset)

    monkeypatch.setattr(os, "posix_fallocate", fallocate)
    monkeypatch.setattr(_chunk_io, "pwrite_all", pwrite_all)
    monkeypatch.setattr(_striping, "QUOTA_RETRY_SECONDS", 60.0)
    with caplog.at_level(logging.INFO, logger="tierstore"):
        store = TieredStore(disk_dir=[a, b], host_bytes=0, min_bytes=0, io_chunk_bytes="1MiB")
        try:
            tensors = [torch.randn(MiB + i) for i in range(6)]  # 4 MiB: chunks in both
            hs = [store.put(t) for t in tensors]
            wait_for(lambda: settled(store))
            errors, tried = store.stats().write_errors, len(failed)
            assert tried > 0
            time.sleep(1.1)  # the store's pause after a failed write (RETRY_SECONDS)
            # The tensors whose writes failed stayed in memory; the next puts spill them too.
            more = [torch.randn(MiB + i) for i in range(6)]
            hs += [store.put(t) for t in more]
            wait_for(lambda: all(store.tier_of(h) is tierstore.Tier.DISK for h in hs))
            assert len(failed) == tried, "the failing directory was tried again at once"
            assert store.stats().write_errors == errors
            for h, t in zip(hs, [*tensors, *more], strict=True):
                assert torch.equal(store.get(h), t)
        finally:
            store.close()


def test_one_transient_growth_error_in_the_only_directory_is_recovered_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Note: [A failing directory is skipped]: with every directory skipped, all are tried. A
    version that refused growths while a directory was marked failing, and marked it again on
    each refusal, never grew the spill file again after one EIO: nothing reached the disk."""
    import errno

    real_fallocate = os.posix_fallocate
    calls = {"n": 0}

    def fallocate(fd: int, offset: int, length: int) -> None:
        calls["n"] += 1
        if calls["n"] == 2:  # the first is the O_DIRECT probe's
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real_fallocate(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", fallocate)
    store = TieredStore(disk_dir=tmp_path, host_bytes=0, min_bytes=0, io_chunk_bytes="1MiB")
    try:
        first = torch.randn(MiB // 4)
        h = store.put(first)
        wait_for(lambda: settled(store))
        assert store.stats().write_errors == 1
        time.sleep(1.1)  # the store's pause after a failed write
        later = torch.randn(MiB // 4)
        h2 = store.put(later)  # runs the cascade: both spill
        wait_for(lambda: store.tier_of(h) is tierstore.Tier.DISK)
        wait_for(lambda: store.tier_of(h2) is tierstore.Tier.DISK)
        assert torch.equal(store.get(h), first) and torch.equal(store.get(h2), later)
        assert store.stats().write_errors == 1
    finally:
        store.close()


def test_a_striped_directory_over_its_quota_is_not_retried_at_every_placement(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """EDQUOT: the filesystem shows free space (statvfs does not see a quota), so a directory
    marked full was tried again at every placement, a failed fallocate and a log line each.
    It is now skipped for QUOTA_RETRY_SECONDS, then tried once."""
    import errno

    from tierstore.tiers.raw import _striping

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    real_fallocate = os.posix_fallocate
    refused: list[int] = []

    def fallocate(fd: int, offset: int, length: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").startswith(f"{a}/"):
            refused.append(length)
            raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))
        real_fallocate(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", fallocate)
    monkeypatch.setattr(_striping, "QUOTA_RETRY_SECONDS", 0.5)
    with caplog.at_level(logging.INFO, logger="tierstore"):
        store = TieredStore(disk_dir=[a, b], host_bytes=0, min_bytes=0, io_chunk_bytes="1MiB")
        try:
            tensors = [torch.randn(3 * MiB // 8 + i) for i in range(8)]
            hs = [store.put(t) for t in tensors]
            wait_for(lambda: all(store.tier_of(h) is tierstore.Tier.DISK for h in hs))
            first = len(refused)  # each blob placed before the first refusal tried it
            assert first >= 1
            more = [torch.randn(3 * MiB // 8) for _ in range(4)]
            hs += [store.put(t) for t in more]
            wait_for(lambda: all(store.tier_of(h) is tierstore.Tier.DISK for h in hs))
            assert len(refused) == first, "the quota-full directory was retried at once"
            time.sleep(0.6)
            late = torch.randn(3 * MiB // 8)
            hs.append(store.put(late))
            wait_for(lambda: store.tier_of(hs[-1]) is tierstore.Tier.DISK)
            assert len(refused) > first  # tried again after the pause
            assert store.stats().write_errors == 0
            for h, t in zip(hs, [*tensors, *more, late], strict=True):
                assert torch.equal(store.get(h), t)
        finally:
            store.close()


def test_a_read_only_mount_is_refused_by_the_store_and_by_info(tmp_path: Path) -> None:
    mnt = tmp_path / "ro"
    _mount(mnt, "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs")
    try:
        with pytest.raises(ConfigError, match="is on a read-only filesystem") as info:
            TieredStore(disk_dir=mnt)
        assert str(info.value).startswith(f"disk_dir/TIERSTORE_DISK_DIR={str(mnt)!r}")
        proc = subprocess.run(
            [sys.executable, "-m", "tierstore", "info"],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": SRC, "TIERSTORE_DISK_DIR": str(mnt)},
            timeout=120,
            check=False,
        )
        # info fails as the store does, with the store's own message.
        assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr
        assert str(info.value) in proc.stderr
    finally:
        _umount(mnt)


def test_the_o_direct_probe_never_raises_and_removes_only_its_own_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without root: the errors a read-only mount and an over-long path give, injected."""
    import errno

    from tierstore.tiers.raw import probe_direct_io

    real_open, real_unlink = os.open, os.unlink
    unlinked: list[str] = []
    for code in (errno.EROFS, errno.ENAMETOOLONG, errno.EEXIST):

        def refuse(path: str, *args: object, code: int = code, **kw: object) -> int:
            if ".tierstore-probe-" in os.fspath(path):
                raise OSError(code, os.strerror(code), path)
            return real_open(path, *args, **kw)  # type: ignore[arg-type]

        def unlink(path: str, *args: object, code: int = code, **kw: object) -> None:
            unlinked.append(os.fspath(path))
            raise OSError(code, os.strerror(code), path)

        monkeypatch.setattr(os, "open", refuse)
        monkeypatch.setattr(os, "unlink", unlink)
        probe = probe_direct_io(tmp_path)
        monkeypatch.setattr(os, "open", real_open)
        monkeypatch.setattr(os, "unlink", real_unlink)
        assert not probe.supported
        assert os.strerror(code) in probe.reason
    # The scratch name was never ours when it already existed: that file is left alone.
    assert len(unlinked) == 2


def _long_dir(root: Path, length: int) -> Path:
    """A directory under ``root`` whose absolute path is exactly ``length`` bytes long."""
    path = str(root)
    while len(path) < length:
        part = min(200, length - len(path) - 1)
        path = os.path.join(path, "d" * part)
    assert len(path) == length
    os.makedirs(path, exist_ok=True)
    return Path(path)


@pytest.mark.parametrize("length", [3950, 4040, 4050, 4060, 4066, 4070])
def test_a_disk_dir_too_long_for_its_spill_files_is_refused_and_leaves_nothing(
    tmp_path: Path, length: int
) -> None:
    parent = _long_dir(tmp_path, length)
    with pytest.raises(ConfigError, match="per path; choose a directory whose path") as info:
        TieredStore(disk_dir=parent, host_bytes=0, min_bytes=0)
    assert str(info.value).startswith(f"disk_dir/TIERSTORE_DISK_DIR={str(parent)!r}: its path is")
    assert list(parent.iterdir()) == []


def test_the_longest_accepted_disk_dir_spills_for_real(tmp_path: Path) -> None:
    probe = _long_dir(tmp_path / "probe", 4000)
    with pytest.raises(ConfigError) as info:
        TieredStore(disk_dir=probe)
    longest = int(str(info.value).rsplit("at most ", 1)[1].split()[0])
    parent = _long_dir(tmp_path / "ok", longest)
    for fmt in ("raw", "zarr"):
        with TieredStore(disk_dir=parent, host_bytes=0, min_bytes=0, disk_format=fmt) as store:
            t = torch.randn(MiB // 4 + 3)
            h = store.put(t)
            wait_for(lambda h=h: store.tier_of(h) is tierstore.Tier.DISK)  # type: ignore[misc]
            assert torch.equal(store.get(h), t)
            assert store.stats().write_errors == 0
    assert list(parent.iterdir()) == []


SWEEP = """
    import sys
    from pathlib import Path
    from tierstore._spilldir import sweep_stale
    print(len(sweep_stale(Path(sys.argv[1]))))
"""


def test_a_start_is_never_swept_by_another_starting_process(
    disk_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Note: [Starts and sweeps take turns]: another process sweeps in the gap between the
    new ``.lock`` and its ``flock``, as a slow ``flock`` in the starting process lets it."""
    import fcntl

    real_flock = fcntl.flock
    sweeps: list[str] = []

    def slow_flock(fd: int, operation: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").endswith("/.lock") and not sweeps:
            proc = subprocess.run(
                [sys.executable, "-c", textwrap.dedent(SWEEP), str(disk_dir)],
                capture_output=True,
                text=True,
                env={**os.environ, "PYTHONPATH": SRC},
                timeout=120,
                check=False,
            )
            assert proc.returncode == 0, proc.stderr[-3000:]
            sweeps.append(proc.stdout.strip())
        real_flock(fd, operation)

    monkeypatch.setattr(fcntl, "flock", slow_flock)
    with TieredStore(disk_dir=disk_dir, host_bytes=0, min_bytes=0) as store:
        monkeypatch.setattr(fcntl, "flock", real_flock)
        assert sweeps == ["0"], "the other process removed a directory"
        (spill,) = store.spill_dirs
        assert Path(spill).is_dir()
        h = store.put(torch.arange(1000.0))
        wait_for(lambda: store.tier_of(h) is tierstore.Tier.DISK)
        assert torch.equal(store.get(h), torch.arange(1000.0))
    assert list(disk_dir.iterdir()) == []


# --------------------------------------------------------------------------- environment


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("TIERSTORE_HOST_BYTES", "-1"),
        ("TIERSTORE_HOST_BYTES", "-0"),
        ("TIERSTORE_HOST_BYTES", "12 parsecs"),
        ("TIERSTORE_HOST_BYTES", "64MiB;rm -rf /"),
        ("TIERSTORE_HOST_BYTES", "nan"),
        ("TIERSTORE_HOST_BYTES", "1e400"),
        ("TIERSTORE_HOST_BYTES", "18446744073709551616"),  # 2**64
        ("TIERSTORE_DISK_BYTES", "9" * 400),
        ("TIERSTORE_DISK_BYTES", "8EiB"),
        ("TIERSTORE_DEVICE_BYTES", "\u0661\u0662MiB"),  # Arabic-Indic digits
        ("TIERSTORE_PREFETCH_BYTES", "1,024"),
        ("TIERSTORE_MIN_BYTES", "0.5KiB.5"),
        ("TIERSTORE_MAX_INFLIGHT_BYTES", "-64MiB"),
        ("TIERSTORE_IO_THREADS", "-4"),
        ("TIERSTORE_IO_THREADS", "4.5"),
        ("TIERSTORE_IO_THREADS", "9" * 50),
        ("TIERSTORE_IO_CHUNK_BYTES", "-8MiB"),
        ("TIERSTORE_HOSTBYTES", "64MiB"),  # a typo is an error, not silence
    ],
)
def test_junk_in_the_environment_is_refused_before_anything_is_made(
    monkeypatch: pytest.MonkeyPatch, disk_dir: Path, var: str, value: str
) -> None:
    monkeypatch.setenv("TIERSTORE_DISK_DIR", str(disk_dir))
    monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError) as info:
        TieredStore()
    msg = str(info.value)
    assert msg.startswith(f"{var}="), msg
    assert repr(value) in msg or value in msg
    assert list(disk_dir.iterdir()) == []


@pytest.mark.parametrize("direct_io", ["on", "off"])
def test_a_spill_directory_removed_under_a_running_store_keeps_spilling(
    make_store: MakeStore, direct_io: str
) -> None:
    """Its file stays open, so the store goes on. Buffered writes opened the file again by its
    path, once per I/O thread, to check their write-back: every one failed with ENOENT and
    the disk tier paused again and again."""
    store = make_store(host_bytes=0, direct_io=direct_io, io_chunk_bytes="1MiB")
    first = [torch.randn(MiB // 2) for _ in range(2)]
    handles = [store.put(t) for t in first]
    wait_for(lambda: settled(store))
    shutil.rmtree(store.spill_dirs[0])
    later = [torch.randn(MiB // 2) for _ in range(6)]  # 2 MiB each: two chunks
    handles += [store.put(t) for t in later]
    wait_for(lambda: settled(store))
    assert all(store.tier_of(h) is tierstore.Tier.DISK for h in handles)
    for h, t in zip(handles, [*first, *later], strict=True):
        assert torch.equal(store.get(h), t)
    stats = store.stats()
    assert stats.write_errors == 0 and stats.disk_available


def test_a_refused_view_leaves_nothing_in_the_device_tiers_totals(
    make_store: MakeStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Note: [A failed host copy keeps nothing]: the put undone leaves no count, byte or peak
    in the stats, the device tier's totals included."""
    from tierstore.core import _moves as moves

    def compact(t: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(moves, "compact", compact)
    store = make_store(device_bytes=0)
    base = torch.randn(8000)
    with pytest.raises(tierstore.TierFullError):
        store.put(base[::2])
    st = store.stats()
    assert (st.puts, st.bytes_put, st.live_entries) == (0, 0, 0)
    assert (st.device.total_entries, st.device.total_bytes, st.device.peak_bytes) == (0, 0, 0)
    audit(store)
