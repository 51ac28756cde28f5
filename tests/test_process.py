"""Whole-process behaviour: crashes, exit, fork, and the 1 GiB spill with a 64 MiB host tier."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from pathlib import Path

import pytest
import torch

import tierstore
from tierstore._spilldir import PREFIX, sweep_stale

SRC = str(Path(__file__).resolve().parents[1] / "src")
# Every child script may call held_files(): the paths its open descriptors refer to.
_PRELUDE = """
def held_files():
    import os
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            found.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass  # the listing's own descriptor, closed by now
    return found
"""


def _python(code: str, env: dict[str, str] | None = None, timeout: float = 120) -> str:
    full_env = {**os.environ, "PYTHONPATH": SRC, **(env or {})}
    proc = subprocess.run(
        [sys.executable, "-c", _PRELUDE + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_sigkill_leaves_a_directory_that_the_next_start_removes(disk_dir: Path) -> None:
    code = f"""
        import sys, torch, tierstore
        store = tierstore.TieredStore(disk_dir={str(disk_dir)!r}, device_bytes=0, host_bytes=0,
                                      min_bytes=0)
        hs = [store.put(torch.randn(1 << 18)) for _ in range(8)]
        while store.stats().inflight_bytes:
            pass
        print(store.spill_dirs[0], flush=True)
        sys.stdin.read()  # hold the tensors until killed
    """
    with subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": SRC},
        text=True,
    ) as proc:
        assert proc.stdout is not None
        spill = Path(proc.stdout.readline().strip())
        assert spill.is_dir() and len(list(spill.iterdir())) > 1
        # While the process lives, its directory is locked and nobody removes it.
        assert sweep_stale(disk_dir) == [] and spill.is_dir()
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    assert spill.is_dir(), "a SIGKILLed process cannot clean up; the next start must"
    store = tierstore.TieredStore(disk_dir=disk_dir)
    try:
        assert not spill.exists()
        assert [p.name.startswith(PREFIX) for p in disk_dir.iterdir()] == [True]  # only ours
    finally:
        store.close()
    assert list(disk_dir.iterdir()) == []


def test_directories_of_other_users_and_foreign_names_are_left_alone(disk_dir: Path) -> None:
    foreign = disk_dir / "not-ours"
    foreign.mkdir()
    half_made = disk_dir / f"{PREFIX}999999999-deadbeef"  # no lock file, PID gone
    half_made.mkdir(mode=0o700)
    # The user's own directories that merely start with the prefix, whatever digits follow:
    # once read as a dead PID and deleted, or as one too big for kill(), which failed every
    # start in that directory.
    users = [
        disk_dir / f"{PREFIX}20240105",
        disk_dir / f"{PREFIX}99999999999",
        disk_dir / f"{PREFIX}123-results",
        disk_dir / f"{PREFIX}999999998-deadbeef",  # our name, but not private as ours are
    ]
    for d in users:
        d.mkdir(mode=0o755)
        (d / "keep.txt").write_text("mine")
    removed = sweep_stale(disk_dir)
    assert removed == [half_made]
    assert foreign.is_dir()
    for d in users:
        assert (d / "keep.txt").read_text() == "mine", d


def test_a_dead_processs_directory_is_removed_where_flock_needs_a_writable_descriptor(
    disk_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over NFS, Linux emulates flock with fcntl byte-range locks, and an exclusive one needs
    a descriptor open for writing (EBADF otherwise): the sweep opened the lock file read-only,
    so on NFS it warned at every start and never removed a dead process's directory."""
    import errno
    import fcntl

    from tierstore import _spilldir

    real_flock = fcntl.flock

    def nfs_flock(fd: int, operation: int) -> None:
        read_only = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
        if operation & fcntl.LOCK_EX and read_only:
            raise OSError(errno.EBADF, os.strerror(errno.EBADF))
        real_flock(fd, operation)

    monkeypatch.setattr(_spilldir.fcntl, "flock", nfs_flock)
    dead = disk_dir / f"{PREFIX}999999997-0badcafe"
    dead.mkdir(mode=0o700)
    (dead / ".lock").touch(mode=0o600)
    (dead / "spill-0.bin").write_bytes(b"x" * 4096)
    assert sweep_stale(disk_dir) == [dead]
    assert not dead.exists()


def test_exit_without_close_removes_the_directory(disk_dir: Path) -> None:
    _python(f"""
        import torch, tierstore
        store = tierstore.TieredStore(disk_dir={str(disk_dir)!r}, device_bytes=0, host_bytes=0,
                                      min_bytes=0)
        hs = [store.put(torch.randn(1 << 18)) for _ in range(16)]
        # exit with writes possibly still in flight and the store open
    """)
    assert list(disk_dir.iterdir()) == []


@pytest.mark.parametrize("disk_format", ["raw", "zarr"])
def test_store_stays_usable_after_fork(disk_dir: Path, disk_format: str) -> None:
    # zarr runs its own event loop, which its at-fork hook restarts in the child; a store that
    # started inside tierstore's at-fork hook, before zarr's, hung there.
    out = _python(f"""
        import os, torch, tierstore
        store = tierstore.TieredStore(disk_dir={str(disk_dir)!r}, device_bytes=0, host_bytes=0,
                                      min_bytes=0, disk_format={disk_format!r})
        parent_h = store.put(torch.arange(1000.0))
        parent_dir = store.spill_dirs[0]
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                h = store.put(torch.full((1 << 16,), 7.0))
                assert torch.equal(store.get(h), torch.full((1 << 16,), 7.0))
                try:
                    store.get(parent_h)
                    code = 3
                except tierstore.TensorReleasedError as exc:
                    assert "fork" in str(exc)
                assert store.spill_dirs[0] != parent_dir
                store.close()
            except BaseException as exc:
                print("child failed", repr(exc), flush=True)
                code = 2
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        print("child", os.waitstatus_to_exitcode(status))
        assert torch.equal(store.get(parent_h), torch.arange(1000.0))
        print("parent dir alive", parent_dir.is_dir())
        store.close()
    """)
    assert "child 0" in out and "parent dir alive True" in out, out
    assert list(disk_dir.iterdir()) == []


def test_a_forked_child_holds_no_descriptor_of_the_parents_spill_files(disk_dir: Path) -> None:
    """A child that never touches the store (a data loader's worker) kept the parent's spill
    file open, so its space stayed in use after the parent removed it, until the child
    exited. 16 MiB spilled over two directories first, so both files exist and have grown."""
    second = disk_dir / "second"
    second.mkdir()
    out = _python(f"""
        import os, torch, tierstore
        from tierstore.testing import settled, wait_for
        store = tierstore.TieredStore(disk_dir=[{str(disk_dir)!r}, {str(second)!r}],
                                      device_bytes=0, host_bytes=0, min_bytes=0)
        hs = [store.put(torch.full((1 << 20,), float(i))) for i in range(4)]
        wait_for(lambda: settled(store) and store.stats().disk.bytes >= 16 << 20)
        parents = [str(d) for d in store.spill_dirs]
        pid = os.fork()
        if pid == 0:
            mine = [p for p in held_files() if any(p.startswith(d) for d in parents)]
            os._exit(0 if not mine else 3)
        _, status = os.waitpid(pid, 0)
        print("child", os.waitstatus_to_exitcode(status))
        assert all(torch.equal(store.get(h), torch.full((1 << 20,), float(i)))
                   for i, h in enumerate(hs))
        store.close()
    """)
    assert "child 0" in out, out


# The forks below: the child puts and gets through the default store (TIERSTORE_DISK_DIR),
# closes it and exits 0; the parent gives it 30 s, then kills it ("hung").
_FORK_HARNESS = """
import os, signal, threading, time, torch, tierstore
from pathlib import Path
from tierstore import _registry, _spilldir, _sync

def child():
    try:
        t, store = torch.full((1 << 16,), 7.0), tierstore.default_store()
        ok = torch.equal(store.get(store.put(t)), t)
        store.close()
        os._exit(0 if ok else 3)
    except BaseException as exc:
        print("child failed", repr(exc), flush=True)
        os._exit(2)

def fork_and_wait(then=lambda: None):
    pid = os.fork()
    if pid == 0:
        child()
    then()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return "hung"

def fork_while_held(lock):
    # Another thread holds `lock` at the fork and lets go of it 0.3 s later.
    held, release = threading.Event(), threading.Event()
    def hold():
        with lock:
            held.set()
            release.wait()
    holder = threading.Thread(target=hold)
    holder.start()
    held.wait()
    code = fork_and_wait(lambda: (time.sleep(0.3), release.set()))
    holder.join()
    return code
"""


def _fork_script(disk_dir: Path, body: str) -> str:
    env = {
        "PYTHONWARNINGS": "ignore::DeprecationWarning",  # fork with threads running
        "TIERSTORE_DISK_DIR": str(disk_dir),
        "TIERSTORE_MIN_BYTES": "0",
    }
    return _python(_FORK_HARNESS + textwrap.dedent(body), env=env)


@pytest.mark.parametrize(
    "lock",
    [
        "_registry._dirs_lock",
        # A sweep (or a start) holds the spill parent's flock: the child's inherited
        # descriptor must not keep it alive, for the child's start or the parent's next one.
        "_spilldir._parent_locked(Path(os.environ['TIERSTORE_DISK_DIR']), sweep=True)",
        "_sync._default_lock",  # default_store() holds it while a store starts
    ],
    ids=["registry", "parent-flock", "default-store"],
)
def test_a_fork_while_another_thread_holds_a_store_lock_leaves_both_sides_working(
    disk_dir: Path, lock: str
) -> None:
    out = _fork_script(
        disk_dir,
        f"""
        parent = tierstore.default_store()
        print("child", fork_while_held({lock}))
        other = tierstore.TieredStore(timeout=20)
        print("parent starts", other.spill_dirs[0].is_dir())
        other.close()
        parent.close()
        """,
    )
    assert "child 0" in out and "parent starts True" in out, out
    assert list(disk_dir.iterdir()) == []


def test_a_fork_while_another_thread_binds_an_async_store_leaves_the_child_working(
    disk_dir: Path,
) -> None:
    """A fork while another thread made an AsyncTieredStore's core, under the lock a first
    call binds under: the child's first call must not wait on a lock no thread of its own
    holds (Note: [Binding to a loop])."""
    out = _fork_script(
        disk_dir,
        """
        import asyncio
        from tierstore import _store
        store = tierstore.AsyncTieredStore()

        async def use():
            t = torch.arange(3.0)
            return torch.equal(await store.get(await store.put(t)), t)

        def child():
            try:
                ok = asyncio.run(use())
                asyncio.run(store.close())
                os._exit(0 if ok else 3)
            except BaseException as exc:
                print("child failed", repr(exc), flush=True)
                os._exit(2)

        real, making = _store.StoreCore, threading.Event()

        def slow(*args, **kwargs):
            making.set()
            time.sleep(0.5)
            return real(*args, **kwargs)

        _store.StoreCore = slow
        binder = threading.Thread(target=asyncio.run, args=(store.open(),))
        binder.start()
        making.wait()
        _store.StoreCore = real
        print("child", fork_and_wait())
        binder.join()
        asyncio.run(store.close())
        """,
    )
    assert "child 0" in out, out
    assert list(disk_dir.iterdir()) == []


def test_one_thing_that_fails_to_reset_after_fork_leaves_the_stores_working(
    disk_dir: Path,
) -> None:
    out = _fork_script(
        disk_dir,
        """
        class Unforgettable:
            def remove(self):
                pass
            def forget(self):
                raise RuntimeError("cannot forget")
        _registry.track(Unforgettable())
        parent = tierstore.default_store()
        print("child", fork_and_wait())
        parent.close()
        """,
    )
    assert "child 0" in out, out
    assert list(disk_dir.iterdir()) == []


@pytest.mark.slow
def test_one_gib_through_a_64_mib_host_tier(disk_dir: Path) -> None:
    """The acceptance run of the core issue, in its own process so RSS is its own."""
    out = _python(
        f"""
        import json, os, resource, torch, tierstore
        from pathlib import Path
        MiB = 1 << 20
        n, size = 64, 16 * MiB                       # 1 GiB in 16 MiB tensors
        def tensor(i):
            g = torch.Generator().manual_seed(i)
            return torch.randn(size // 4, generator=g)
        tensor(0)
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        store = tierstore.TieredStore(disk_dir={str(disk_dir)!r}, device_bytes=0,
                                      host_bytes="64MiB", max_inflight_bytes="64MiB",
                                      prefetch_bytes="64MiB", min_bytes=0)
        hs = [store.put(tensor(i)) for i in range(n)]
        while store.stats().inflight_bytes:
            pass
        tiers = [store.tier_of(h).value for h in hs]
        spill = store.spill_dirs[0]
        on_disk = sum(p.stat().st_blocks * 512 for p in Path(spill).rglob("*") if p.is_file())
        exact = True
        for i in reversed(range(n)):
            exact &= torch.equal(store.get(hs[i]), tensor(i))
            hs.pop()
        st = store.stats()
        store.close()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        print(json.dumps(dict(tiers=tiers, on_disk=on_disk, exact=exact, grew=peak - base,
                              left=os.listdir({str(disk_dir)!r}), hits=st.prefetch_hits,
                              misses=st.prefetch_misses, live=st.live_entries)))
    """,
        timeout=300,
    )
    r = json.loads(out.strip().splitlines()[-1])
    assert r["tiers"].count("disk") >= 60 and r["tiers"][-1] == "host"
    assert r["on_disk"] >= 60 * 16 << 20
    assert r["exact"] is True
    assert r["grew"] < 400 << 20, f"peak RSS grew by {r['grew'] >> 20} MiB for 1 GiB pushed"
    assert r["left"] == []
    assert r["live"] == 0
    assert r["misses"] <= 2


def test_the_in_ram_warning_holds_its_lock_across_no_syscall(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fork can only land inside a critical section that gives up the GIL: the warning
    resolved the directory (two syscalls) under its lock, so a fork from another thread
    then left the lock held in the child, whose first store on tmpfs waited for ever."""
    from tierstore import _spilldir

    resolved_under_lock = []
    real = os.path.realpath

    def realpath(path: object) -> str:
        resolved_under_lock.append(_spilldir._warned_lock.locked())
        return real(path)  # type: ignore[call-overload,no-any-return]

    monkeypatch.setattr(_spilldir, "ram_filesystem", lambda parent: "tmpfs")
    monkeypatch.setattr(os.path, "realpath", realpath)
    assert _spilldir.warn_if_in_ram(tmp_path) == "tmpfs"
    assert resolved_under_lock and not any(resolved_under_lock)


def test_a_child_forked_during_a_close_closes_at_once(disk_dir: Path) -> None:
    """A fork while another thread's close runs: the child's store is closed, with no
    thread to end that close, and a close there (its exit hook's too) waited for it, up to
    ten minutes with the default timeout."""
    out = _python(f"""
        import asyncio, os, threading, time, torch, tierstore
        store = tierstore.TieredStore(disk_dir={str(disk_dir)!r}, min_bytes=0, timeout=5)
        store.put(torch.ones(4))
        real = store._core.finish_close

        async def slow(timeout):
            await asyncio.sleep(1.0)
            await real(timeout)

        store._core.finish_close = slow
        closing = threading.Thread(target=store.close)
        closing.start()
        time.sleep(0.2)
        pid = os.fork()
        if pid == 0:
            started = time.monotonic()
            store.close()
            os._exit(0 if time.monotonic() - started < 2.0 else 3)
        _, status = os.waitpid(pid, 0)
        closing.join()
        print("child", os.waitstatus_to_exitcode(status))
    """)
    assert "child 0" in out, out


def _dropped_store_closes(where: str, disk_dir: Path) -> None:
    before = set(threading.enumerate())
    store = tierstore.TieredStore(
        disk_dir=disk_dir, device_bytes=0, host_bytes=0, min_bytes=0, disk_bytes="256MiB"
    )
    # Over 1 MiB and packed ones, so the engine's I/O threads are running.
    tensors = [torch.randn(n) for n in (1 << 19, 1 << 19, 1 << 10, 1 << 12)]
    handles = [store.put(t) for t in tensors]
    assert all(torch.equal(store.get(h), t) for h, t in zip(handles, tensors, strict=True))
    spill_dir, core = store.spill_dirs[0], store._core
    assert core is not None and spill_dir.is_dir()
    core_gone = weakref.ref(core)
    ours = set(threading.enumerate()) - before
    assert any(t.name == "tierstore-loop" for t in ours)
    gone = weakref.ref(store)
    if where == "by its last reference":
        del store
    else:
        cycle: list[object] = [store]
        cycle.append(cycle)
        del store, cycle
        if where == "by the collector on its own loop thread":
            core.loop.call_soon_threadsafe(gc.collect)
        else:  # inside its lock: the close must wait for the lock, not re-enter it
            with core.lock:
                gc.collect()
                assert gone() is None and not core.closed
    deadline = time.monotonic() + 20
    while (spill_dir.exists() or any(t.is_alive() for t in ours)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone() is None
    assert not spill_dir.exists(), "the dropped store's spill directory is still there"
    assert [t.name for t in ours if t.is_alive()] == []
    assert core.closed and core.final_stats is not None
    # Its handles are released ones now; nothing of them stayed on disk.
    assert list(disk_dir.iterdir()) == []
    # Nothing keeps the closed store's memory (its pinned pool, on a GPU) either.
    del core
    gc.collect()
    assert core_gone() is None


@pytest.mark.parametrize(
    "where",
    [
        "by its last reference",
        "by the collector on its own loop thread",
        "by the collector inside its lock",
    ],
)
def test_a_store_dropped_without_close_closes_itself(disk_dir: Path, where: str) -> None:
    _dropped_store_closes(where, disk_dir)


def test_a_store_dropped_just_before_exit_closes_cleanly(disk_dir: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
                import atexit, torch, tierstore
                store = tierstore.TieredStore(disk_dir={str(disk_dir)!r}, device_bytes=0,
                                              host_bytes=0, min_bytes=0)
                hs = [store.put(torch.randn(1 << 19)) for _ in range(16)]
                core = store._core  # the store's state, which does not keep the store alive
                # Runs after the exit hook that joins closes, before the directory backstop.
                atexit.register(lambda: print("closed", core.closed, core.final_stats is not None))
                del store  # its close is still under way when the interpreter exits
            """),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": SRC},
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-3000:]
    assert "closed True True" in proc.stdout, proc.stdout
    assert list(disk_dir.iterdir()) == []


def test_a_forked_child_that_drops_the_parents_store_leaves_the_parents_files(
    disk_dir: Path,
) -> None:
    out = _python(f"""
        import gc, os, time, torch, tierstore
        store = tierstore.TieredStore(disk_dir={str(disk_dir)!r}, device_bytes=0, host_bytes=0,
                                      min_bytes=0)
        h = store.put(torch.arange(1 << 19, dtype=torch.float32))
        parent_dir = store.spill_dirs[0]
        # Made here: torch's OpenMP pool hangs a forked child's first parallel operation.
        ones = torch.ones(1 << 19)
        for use in (False, True):  # dropped unused, and after it started a store of its own
            pid = os.fork()
            if pid == 0:
                code = 0
                if use:
                    store.put(ones)
                    child_dir = store.spill_dirs[0]
                del store
                gc.collect()
                if use:
                    deadline = time.monotonic() + 20
                    while child_dir.exists() and time.monotonic() < deadline:
                        time.sleep(0.05)
                    code = 0 if not child_dir.exists() else 4
                os._exit(code)
            _, status = os.waitpid(pid, 0)
            print("child", use, os.waitstatus_to_exitcode(status))
        print("parent dir alive", parent_dir.is_dir())
        assert torch.equal(store.get(h), torch.arange(1 << 19, dtype=torch.float32))
        store.close()
    """)
    assert "child False 0" in out and "child True 0" in out, out
    assert "parent dir alive True" in out, out
    assert list(disk_dir.iterdir()) == []


def test_an_async_store_used_before_a_fork_works_in_the_child(disk_dir: Path) -> None:
    """The child's stores start empty at their first call there; an ``AsyncTieredStore``
    bound before the fork called itself closed in the child instead."""
    out = _python(f"""
        import asyncio, os, torch, tierstore
        torch.set_num_threads(1)  # torch's OpenMP pool hangs a forked child's parallel ops
        store = tierstore.AsyncTieredStore(disk_dir={str(disk_dir)!r}, device_bytes=0,
                                           host_bytes=0, min_bytes=0)
        t = torch.arange(1 << 19, dtype=torch.float32)

        async def round_trip():
            h = await store.put(t)
            assert torch.equal(await store.get(h), t)
            return h, store._core.spill_dirs[0]

        loop = asyncio.new_event_loop()  # the parent's, open across the fork
        parent_h, parent_dir = loop.run_until_complete(round_trip())
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                async def child():
                    _, child_dir = await round_trip()
                    assert child_dir != parent_dir
                    try:
                        await store.get(parent_h)
                        return 3
                    except tierstore.TensorReleasedError:
                        pass
                    await store.close()
                    return 0 if not child_dir.exists() else 4
                code = asyncio.run(child())
            except BaseException as exc:
                print("child failed", repr(exc), flush=True)
                code = 2
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        print("child", os.waitstatus_to_exitcode(status))
        print("parent dir alive", parent_dir.is_dir())

        async def finish():
            assert torch.equal(await store.get(parent_h), t)
            await store.close()

        loop.run_until_complete(finish())
        loop.close()
    """)
    assert "child 0" in out and "parent dir alive True" in out, out
    assert list(disk_dir.iterdir()) == []


def test_module_locks_are_made_anew_in_a_forked_child() -> None:
    """A module-level lock another thread holds at a fork stays held in the child for ever.
    Each is a ForkSafeLock, or renewed or held across the fork by an at-fork hook of its
    own module (named here)."""
    import importlib
    import pkgutil

    renewed_by_their_module = {
        "tierstore._registry._dirs_lock",
        "tierstore._spilldir._held_lock",
    }
    plain = (type(threading.Lock()), type(threading.RLock()))
    found = []
    for info in pkgutil.walk_packages(tierstore.__path__, "tierstore."):
        if ".bench" in info.name or info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if isinstance(value, plain) and f"{info.name}.{name}" not in renewed_by_their_module:
                found.append(f"{info.name}.{name}")
    assert found == [], f"plain module-level locks, which hang a forked child: {found}"


def test_a_fork_while_another_thread_looks_up_an_engine_leaves_the_child_working(
    disk_dir: Path,
) -> None:
    out = _python(f"""
        import os, threading, torch, tierstore
        from tierstore.tiers import _engine
        torch.set_num_threads(1)
        held, done = threading.Event(), threading.Event()

        def hold():
            with _engine._engines_lock:  # as while another thread configures a store
                held.set()
                done.wait()

        threading.Thread(target=hold, daemon=True).start()
        held.wait()
        pid = os.fork()
        if pid == 0:
            import faulthandler, sys
            faulthandler.dump_traceback_later(20, exit=True)
            with tierstore.TieredStore(disk_dir={str(disk_dir)!r}, host_bytes=0,
                                       min_bytes=0) as store:
                t = torch.arange(1 << 10, dtype=torch.float32)
                ok = torch.equal(store.get(store.put(t)), t)
            os._exit(0 if ok else 3)
        done.set()
        _, status = os.waitpid(pid, 0)
        print("child", os.waitstatus_to_exitcode(status))
    """)
    assert "child 0" in out, out


def test_a_child_forked_while_a_dropped_store_closes_holds_none_of_its_files(
    disk_dir: Path,
) -> None:
    """A dropped store closing on its loop thread is in no list of open stores: the fork hook
    did not reset its core, and the child kept the parent's spill file open (its space held
    until the child exited)."""
    out = _python(f"""
        import gc, os, time, torch, tierstore
        from tierstore.testing import install_faults
        torch.set_num_threads(1)  # torch's OpenMP pool hangs a forked child's parallel ops
        store = tierstore.TieredStore(disk_dir={str(disk_dir)!r}, device_bytes=0,
                                      host_bytes=0, min_bytes=0, io_chunk_bytes="1MiB")
        faulty = install_faults(store)
        faulty.write_delay = 0.3  # a slow disk: the close waits for the writes in flight
        spill = store.spill_dirs[0]
        hs = [store.put(torch.full((1 << 20,), float(i))) for i in range(6)]
        assert store.stats().inflight_bytes > 0
        del store
        gc.collect()
        pid = os.fork()
        if pid == 0:
            held = [p for p in held_files() if p.startswith({str(disk_dir)!r})]
            print("child holds", held, flush=True)
            os._exit(0)
        os.waitpid(pid, 0)
        deadline = time.monotonic() + 30
        while spill.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        print("parent's directory removed", not spill.exists(), flush=True)
    """)
    assert "child holds []" in out and "parent's directory removed True" in out, out


def test_exit_waits_for_a_dropped_stores_close_as_long_as_close_would() -> None:
    """The exit hook joined closing loop threads for 30 s in all; a close outlasting that was
    cut off at teardown (its executors shut down under it, or the process aborted). Each now
    gets the wait its store's ``close()`` would have had."""
    out = _python("""
        import threading, time
        from tierstore import _registry

        class Core:
            def forget_after_fork(self):
                pass

        slow = threading.Thread(target=time.sleep, args=(1.5,), daemon=True)
        stuck = threading.Thread(target=time.sleep, args=(60,), daemon=True)
        slow.start(), stuck.start()
        _registry.closing(slow, Core(), 30.0)
        _registry.closing(stuck, Core(), 0.5)
        started = time.monotonic()
        _registry._close_all()
        print("joined slow", not slow.is_alive(), "gave up on stuck", stuck.is_alive(),
              f"after {time.monotonic() - started:.1f}", flush=True)
    """)
    assert "joined slow True gave up on stuck True" in out, out
    assert float(out.split("after ")[1]) < 5, out


def test_a_fork_in_the_middle_of_closing_the_spill_files_leaves_the_child_none(
    disk_dir: Path,
) -> None:
    """Note: [Descriptors across fork]: closing the descriptors marked them gone first and
    closed them one by one, each close letting other threads run; a fork in between left the
    child holding the rest, the parent's spill file, whose space stayed allocated until the
    child exited. Each close here is slowed so that the fork comes in the middle; the fork
    must not wait for the close either (a lock it waited on lost a Ctrl-C pressed meanwhile
    and hung the child)."""
    out = _python(f"""
        import os, threading, time, torch, tierstore
        torch.set_num_threads(1)
        store = tierstore.TieredStore(disk_dir={str(disk_dir)!r}, device_bytes=0, host_bytes=0,
                                      min_bytes=0, direct_io="off")
        h = store.put(torch.ones(1 << 20))
        while store.stats().inflight_bytes:
            time.sleep(0.01)
        f = store._core.disk.engine.files[0]
        for _ in range(4):  # per-thread descriptors too, as the I/O threads take them
            t = threading.Thread(target=f.writeback_fd)
            t.start()
            t.join()
        real_close, inside = os.close, threading.Event()

        def slow_close(fd):
            real_close(fd)
            if threading.current_thread() is not threading.main_thread():
                inside.set()
                time.sleep(0.5)

        os.close = slow_close
        closer = threading.Thread(target=f.close_descriptor)
        closer.start()
        inside.wait()
        started = time.monotonic()
        pid = os.fork()
        if pid != 0:
            print(f"fork took {{time.monotonic() - started:.2f}} s", flush=True)
        if pid == 0:
            held = [p for p in held_files() if p.endswith("spill.raw")]
            print("child holds", held, flush=True)
            os._exit(0)
        os.waitpid(pid, 0)
        closer.join()
        os.close = real_close
    """)
    assert "child holds []" in out, out
    assert float(out.split("fork took ")[1].split()[0]) < 0.4, out


def test_a_lock_number_the_parent_closed_and_reused_is_not_closed_in_the_child(
    disk_dir: Path,
) -> None:
    """Note: [Descriptors across fork]: a fork while the parent closed a spill directory's
    lock file, its number reused at once by the pipe a data loader makes just before it forks
    a worker. The child's reset closed that number again, the pipe, and the worker died
    with EBADF (exit code 1, no traceback)."""
    out = _python(f"""
        import os, threading, time, torch, tierstore
        torch.set_num_threads(1)
        store = tierstore.TieredStore(disk_dir={str(disk_dir)!r}, device_bytes=0, host_bytes=0,
                                      min_bytes=0, direct_io="off")
        h = store.put(torch.ones(1 << 18))
        while store.stats().inflight_bytes:
            time.sleep(0.01)
        lock_fd = store._core.disk_tier.dirs[0]._lock_fd
        lock_file = os.readlink(f"/proc/self/fd/{{lock_fd}}")
        real_close, closed = os.close, threading.Event()

        def close_then_pause(fd):
            real_close(fd)
            if fd == lock_fd and threading.current_thread().name == "tierstore-loop":
                closed.set()
                time.sleep(1.0)

        os.close = close_then_pause
        closer = threading.Thread(target=store.close)
        closer.start()
        closed.wait()
        r, w = os.pipe()  # as multiprocessing's fork start does right before it forks
        pid = os.fork()
        if pid == 0:
            try:
                os.fstat(r), os.fstat(w)
                held = held_files()
                print("child pipe intact; holds the lock file", lock_file in held, flush=True)
            except OSError as exc:
                print("child pipe closed:", exc, flush=True)
            os._exit(0)
        os.waitpid(pid, 0)
        closer.join()
        os.close = real_close
        print("reused", lock_fd in (r, w), flush=True)
    """)
    assert "child pipe intact; holds the lock file False" in out, out


@pytest.mark.parametrize("through", ["the directory", "a symlink to it"])
def test_a_file_being_created_in_a_spill_directory_at_the_fork_is_closed_in_the_child(
    disk_dir: Path, tmp_path: Path, through: str
) -> None:
    """A spill file opened but not yet recorded by its engine when another thread forks (a
    store starting while a data loader starts its workers) stayed open in the child, holding
    the parent's file: the child closes whatever it holds inside the parent's private spill
    directories (Note: [Descriptors across fork]), found by their real path: a spill parent
    reached through a symlink (a cluster's /scratch) did not match what /proc shows."""
    if through == "a symlink to it":
        link = tmp_path / "scratch-link"
        link.symlink_to(disk_dir, target_is_directory=True)
        disk_dir = link
    out = _python(f"""
        import os, torch, tierstore
        torch.set_num_threads(1)
        store = tierstore.TieredStore(disk_dir={str(disk_dir)!r}, host_bytes=0, min_bytes=0)
        spill = store.spill_dirs[0]
        unrecorded = os.open(spill / "being-created", os.O_CREAT | os.O_RDWR, 0o600)
        pid = os.fork()
        if pid == 0:
            real = os.path.realpath(spill)
            print("child holds", [p for p in held_files() if p.startswith(real)], flush=True)
            os._exit(0)
        os.waitpid(pid, 0)
        os.close(unrecorded)
        store.close()
    """)
    assert "child holds []" in out, out


def test_a_removed_spill_directorys_lock_identity_closes_nothing_in_a_child(
    disk_dir: Path,
) -> None:
    """A store's spill directory, removed, kept the lock file's device and inode, which the
    filesystem soon gives to another file (the application's): a child forked while the
    closed store's core still lived forgot it again and closed that file's descriptor."""
    out = _python(f"""
        import os, torch, tierstore
        from tierstore._inherited import identity_of
        torch.set_num_threads(1)
        store = tierstore.TieredStore(disk_dir={str(disk_dir)!r}, host_bytes=0, min_bytes=0)
        d = store._core.disk_tier.dirs[0]
        store.close()
        app = os.open({str(disk_dir)!r} + "/app-file", os.O_CREAT | os.O_RDWR, 0o600)
        d._lock_identity, d._lock_fd = identity_of(app), app  # the inode and number reused
        pid = os.fork()
        if pid == 0:
            d.forget()
            try:
                os.fstat(app)
                print("child: app file intact", flush=True)
            except OSError as exc:
                print("child: app file closed", exc, flush=True)
            os._exit(0)
        os.waitpid(pid, 0)
        os.close(app)
        os.unlink({str(disk_dir)!r} + "/app-file")
    """)
    assert "child: app file intact" in out, out


def test_a_child_forked_while_the_lock_file_closes_holds_none_of_it(disk_dir: Path) -> None:
    """The directory stopped being tracked, and counted as removed, before its lock file's
    descriptor was closed: a child forked during that close kept the lock file (and its
    flock) open until it exited."""
    out = _python(f"""
        import os, threading, time, torch, tierstore
        torch.set_num_threads(1)
        store = tierstore.TieredStore(disk_dir={str(disk_dir)!r}, device_bytes=0,
                                      host_bytes=0, min_bytes=0, direct_io="off")
        h = store.put(torch.ones(1 << 18))
        while store.stats().inflight_bytes:
            time.sleep(0.01)
        lock_fd = store._core.disk_tier.dirs[0]._lock_fd
        real_close, paused = os.close, threading.Event()

        def pause_then_close(fd):
            if fd == lock_fd and threading.current_thread().name == "tierstore-loop":
                paused.set()
                time.sleep(1.0)
            real_close(fd)

        os.close = pause_then_close
        closer = threading.Thread(target=store.close)
        closer.start()
        paused.wait()
        pid = os.fork()
        if pid == 0:
            held = [p for p in held_files() if {str(disk_dir)!r} in p]
            print("child holds", held, flush=True)
            os._exit(0)
        os.waitpid(pid, 0)
        closer.join()
        os.close = real_close
    """)
    assert "child holds []" in out, out
