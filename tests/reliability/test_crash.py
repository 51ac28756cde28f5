"""Crashes and exits, each in a subprocess with a timeout: nothing hangs, nothing is left behind.

The subprocesses spill for real (host tier 0) and print their spill directory, then a marker
once transfers are in flight, so every signal lands in the middle of I/O, not after it. They
put tensors of 1 MiB, which the disk tier writes in packs, and of 3 MiB and 4 bytes, which it
writes alone in several chunks (``BIG``), so an exit or a signal finds both kinds in flight.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import tierstore
from tierstore._spilldir import PREFIX

TESTS = Path(__file__).resolve().parents[1]
SRC = str(TESTS.parent / "src")
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, str(TESTS)])}
# Elements of a float32 tensor past 1 MiB that does not end on a page: 3 MiB and 4 bytes.
BIG = (3 << 18) + 1

# A training-like loop: put activations (spilled at once), get and drop the older ones.
HEAVY_LOOP = """
    import sys, torch, tierstore
    store = tierstore.TieredStore(disk_dir={disk_dir!r}, device_bytes=0, host_bytes=0,
                                  min_bytes=0, max_inflight_bytes="64MiB", io_chunk_bytes="1MiB")
    print(store.spill_dirs[0], flush=True)
    {setup}
    marked = False
    step = 0
    while True:
        # 8 x 4 MiB, each written alone in four chunks, and 4 x 64 KiB, written in packs
        hs = [store.put(torch.full((1 << 20,), float(step))) for _ in range(8)]
        hs += [store.put(torch.full((1 << 14,), float(step))) for _ in range(4)]
        if not marked and store.stats().inflight_bytes:
            print("IN_FLIGHT", flush=True)
            marked = True
        for h in reversed(hs[4:]):
            assert store.get(h)[0].item() == float(step)
        step += 1
"""


def _start(code: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        env=ENV,
        text=True,
    )


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=90,
        check=False,
    )


def _spill_dir_and_wait_in_flight(proc: subprocess.Popen[str]) -> Path:
    assert proc.stdout is not None
    spill = Path(proc.stdout.readline().strip())
    line = proc.stdout.readline().strip()
    if line != "IN_FLIGHT":
        proc.kill()
        _out, err = proc.communicate(timeout=30)
        raise AssertionError(f"child did not start spilling: {line!r}\n{err[-3000:]}")
    assert spill.is_dir()
    return spill


def _finish(proc: subprocess.Popen[str], timeout: float = 60) -> tuple[int, str]:
    try:
        _out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _out, err = proc.communicate()
        raise AssertionError(f"child hung after the signal:\n{err[-3000:]}") from None
    return proc.returncode, err


def test_sigkill_during_heavy_spill_next_start_removes_the_stale_dir(disk_dir: Path) -> None:
    proc = _start(HEAVY_LOOP.format(disk_dir=str(disk_dir), setup=""))
    spill = _spill_dir_and_wait_in_flight(proc)
    proc.send_signal(signal.SIGKILL)
    code, _err = _finish(proc)
    assert code == -signal.SIGKILL
    assert spill.is_dir() and any(spill.iterdir()), "SIGKILL cannot clean up; the next start must"
    store = tierstore.TieredStore(disk_dir=disk_dir, host_bytes=0, min_bytes=0)
    try:
        assert not spill.exists(), "the next start did not sweep the dead process's directory"
        assert [p.name.startswith(PREFIX) for p in disk_dir.iterdir()] == [True]
        t = torch.arange(1000.0)
        assert store.get(store.put(t)).equal(t)
    finally:
        store.close()
    assert list(disk_dir.iterdir()) == []


def test_sigterm_mid_step_removes_the_spill_dir_and_still_dies_of_sigterm(disk_dir: Path) -> None:
    proc = _start(HEAVY_LOOP.format(disk_dir=str(disk_dir), setup=""))
    spill = _spill_dir_and_wait_in_flight(proc)
    proc.send_signal(signal.SIGTERM)
    code, err = _finish(proc)
    # Note: [SIGTERM]: the exit status is the default one, files are gone.
    assert code == -signal.SIGTERM, err[-3000:]
    assert not spill.exists()
    assert list(disk_dir.iterdir()) == []


def test_application_sigterm_handler_is_respected_and_exit_closes(disk_dir: Path) -> None:
    # The application installs its handler *before* the store: tierstore must leave it alone.
    code = textwrap.dedent("""
        import signal, sys
        def handler(signum, frame):
            print("APP_HANDLER", file=sys.stderr, flush=True)
            sys.exit(7)
        signal.signal(signal.SIGTERM, handler)
    """) + textwrap.dedent(HEAVY_LOOP.format(disk_dir=str(disk_dir), setup=""))
    proc = _start(code)
    spill = _spill_dir_and_wait_in_flight(proc)
    proc.send_signal(signal.SIGTERM)
    rc, err = _finish(proc)
    assert rc == 7 and "APP_HANDLER" in err, err[-3000:]
    assert not spill.exists(), "SystemExit runs the exit hooks, which close the store"
    assert list(disk_dir.iterdir()) == []


def test_keyboard_interrupt_mid_step_closes_the_store(disk_dir: Path) -> None:
    # A child started from pytest may inherit SIGINT ignored; a terminal user's would not be.
    setup = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler)"
    proc = _start(HEAVY_LOOP.format(disk_dir=str(disk_dir), setup=setup))
    spill = _spill_dir_and_wait_in_flight(proc)
    proc.send_signal(signal.SIGINT)
    code, err = _finish(proc)
    assert code != 0 and "KeyboardInterrupt" in err, err[-3000:]
    assert "Exception ignored" not in err and "Fatal Python error" not in err, err[-3000:]
    assert not spill.exists()
    assert list(disk_dir.iterdir()) == []


SLOW_EXIT = """
    import sys, time, torch, tierstore
    from tierstore.testing import install_faults
    store = tierstore.TieredStore(disk_dir={disk_dir!r}, device_bytes=0, host_bytes=0,
                                  min_bytes=0, timeout={timeout}, io_chunk_bytes="1MiB")
    faulty = install_faults(store)
    {slow}
    print(store.spill_dirs[0], flush=True)
    hs = [store.put(torch.full((1 << 18 if i % 2 else {big},), float(i))) for i in range(8)]
    assert store.stats().inflight_bytes > 0, "nothing pending at exit"
    print("PENDING", faulty.writes, flush=True)
    # fall off the end of the script with writes still pending and handles alive
"""


@pytest.mark.parametrize(
    ("slow", "timeout", "expect"),
    [
        ("faulty.write_delay = 0.2", 60, "finished"),
        ("import threading; faulty.write_gate = threading.Event()  # never opens", 2, "cancelled"),
    ],
    ids=["slow-disk-finishes", "stuck-disk-cancels"],
)
def test_exit_with_io_pending_finishes_or_cancels_without_hanging(
    disk_dir: Path, slow: str, timeout: int, expect: str
) -> None:
    code = SLOW_EXIT.format(disk_dir=str(disk_dir), slow=slow, timeout=timeout, big=BIG)
    t0 = time.monotonic()
    proc = _run(code)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.split("\n")
    spill = Path(lines[0].strip())
    assert lines[1].startswith("PENDING")
    assert not spill.exists()
    assert list(disk_dir.iterdir()) == []
    if expect == "cancelled":
        assert "cancelled" in proc.stderr and "transfers still running at close" in proc.stderr
        assert elapsed < 30, elapsed
    else:
        assert "cancelled" not in proc.stderr, proc.stderr[-3000:]


BLOCKED_PUT = """
    import signal, sys, threading, torch, tierstore
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from tierstore.testing import install_faults
    store = tierstore.TieredStore(disk_dir={disk_dir!r}, device_bytes=0, host_bytes=0,
                                  min_bytes=0, max_inflight_bytes="1MiB", timeout=2,
                                  io_chunk_bytes="1MiB")
    faulty = install_faults(store)
    faulty.write_gate = threading.Event()  # the disk never answers
    print(store.spill_dirs[0], flush=True)
    hs = [store.put(torch.ones({big}))]  # 3 MiB in flight: the semaphore is full
    print("IN_FLIGHT", flush=True)
    hs.append(store.put(torch.ones(1 << 18)))  # blocks on backpressure until the signal
    print("NOT_BLOCKED", flush=True)
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_while_put_waits_on_backpressure_does_not_hang(
    disk_dir: Path, sig: signal.Signals
) -> None:
    proc = _start(BLOCKED_PUT.format(disk_dir=str(disk_dir), big=BIG))
    spill = _spill_dir_and_wait_in_flight(proc)
    time.sleep(0.3)  # let the main thread block inside put()
    proc.send_signal(sig)
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError("the blocked put hung after the signal") from None
    assert "NOT_BLOCKED" not in out
    # An uncaught KeyboardInterrupt ends Python by re-raising SIGINT: status -2, like SIGTERM's.
    assert proc.returncode == -sig, err[-3000:]
    if sig == signal.SIGINT:
        assert "KeyboardInterrupt" in err, err[-3000:]
        # The stuck write is cancelled after the store's timeout (2 s here), then cleaned up.
        assert "cancelled 1 transfers still running at close" in err, err[-3000:]
    assert not spill.exists()
    assert list(disk_dir.iterdir()) == []


ASYNC_EXIT = """
    import asyncio, torch, tierstore
    from tierstore.testing import install_faults, internals

    async def main():
        store = tierstore.AsyncTieredStore(disk_dir={disk_dir!r}, device_bytes=0, host_bytes=0,
                                           min_bytes=0, io_chunk_bytes="1MiB")
        await store.open()
        faulty = install_faults(store)
        faulty.write_delay = 0.3
        print(internals(store).spill_dirs[0], flush=True)
        hs = [await store.put(torch.full((1 << 18 if i % 2 else {big},), float(i)))
              for i in range(6)]
        assert (await store.stats()).inflight_bytes > 0
        print("PENDING", flush=True)
        return hs  # the loop ends with writes pending and the store never closed

    asyncio.run(main())
"""


def test_async_store_left_open_when_its_loop_ends_exits_cleanly(disk_dir: Path) -> None:
    # install_faults() takes an AsyncTieredStore as well, once it has opened.
    proc = _run(ASYNC_EXIT.format(disk_dir=str(disk_dir), big=BIG))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[1] == "PENDING"
    assert not Path(lines[0]).exists()
    assert list(disk_dir.iterdir()) == []
    for noise in ("Traceback", "Exception ignored", "was destroyed but it is pending", "Fatal"):
        assert noise not in proc.stderr, proc.stderr[-3000:]


DROPPED_SYNC = """
    import gc, torch, tierstore

    def step():
        store = tierstore.TieredStore(disk_dir={disk_dir!r}, device_bytes=0, host_bytes=0,
                                      min_bytes=0, io_chunk_bytes="1MiB")
        hs = [store.put(torch.full((1 << 18 if i % 2 else {big},), float(i))) for i in range(4)]
        print(store.spill_dirs[0], flush=True)
        return hs  # the store itself is dropped, never closed

    hs = step()
    gc.collect()
"""


def test_sync_store_dropped_without_close_leaves_nothing_at_exit(disk_dir: Path) -> None:
    proc = _run(DROPPED_SYNC.format(disk_dir=str(disk_dir), big=BIG))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not Path(proc.stdout.splitlines()[0]).exists()
    assert list(disk_dir.iterdir()) == []
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


def test_a_ctrl_c_that_arrives_while_c_code_frees_a_handle_still_interrupts(
    disk_dir: Path,
) -> None:
    """A SIGINT that arrives while C code frees a handle (autograd freeing its graph) is
    raised at the next Python instruction. With a Python weakref callback that was the
    callback's first line, where Python prints "Exception ignored" and drops it: the training
    loop ran on, and the entry, never queued for release, stayed until close. Modelled by
    freeing a 256 MiB tensor (a long munmap) and then the handle, in one ``del``, while
    another thread sends SIGINT; an attempt whose signal came after the free is repeated."""
    proc = _run(f"""
        import signal, threading, time, torch, tierstore
        torch.set_num_threads(1)
        store = tierstore.TieredStore(disk_dir={str(disk_dir)!r}, min_bytes=0)
        main = threading.main_thread().ident

        def free_time():
            big = torch.ones(64 << 20)
            started = time.monotonic()
            del big
            return time.monotonic() - started

        for attempt in range(5):
            took = free_time()
            h = store.put(torch.ones(1 << 10))
            doomed = [h, torch.ones(64 << 20)]  # freed last to first: the tensor, then h
            del h
            sent = []

            def interrupt():
                time.sleep(took / 4)
                sent.append(time.monotonic())
                signal.pthread_kill(main, signal.SIGINT)

            killer = threading.Thread(target=interrupt)
            killer.start()
            started = time.monotonic()
            try:
                del doomed
                # Python code after the free, as after a backward: a signal flagged during C
                # code is raised at the next instruction (a single blocking call would defer
                # it to its return, with or without a store).
                for _ in range(500):
                    time.sleep(0.01)
                print("NOT INTERRUPTED", flush=True)
                break
            except KeyboardInterrupt:
                landed = time.monotonic()
            killer.join()
            if sent[0] - started < 0.8 * took:  # the signal came during the free
                print(f"INTERRUPTED after {{landed - started:.2f}} s", flush=True)
                break
        else:
            print("INCONCLUSIVE", flush=True)
        deadline = time.monotonic() + 5
        while store._core.table.entries and time.monotonic() < deadline:
            time.sleep(0.01)  # no store call: the loop's poll releases it
        print("RELEASED", not store._core.table.entries, flush=True)
        store.close()
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Exception ignored" not in proc.stderr, proc.stderr[-3000:]
    assert "INCONCLUSIVE" not in proc.stdout, proc.stdout
    interrupted = [line for line in proc.stdout.splitlines() if line.startswith("INTERRUPTED")]
    assert interrupted and float(interrupted[0].split()[2]) < 2.0, proc.stdout
    assert "RELEASED True" in proc.stdout, proc.stdout
