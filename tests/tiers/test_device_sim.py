"""The store's GPU path on the stream simulator (tests/gpusim): exact bytes, no unordered access.

Every test runs under both schedules (Note: [Copy ordering on an accelerator] says what each
ordering rule protects; the lazy schedule shows a missing wait as stale bytes, the eager one shows
an early free or overwrite as poison), and the simulator's race checker fails the test on any
access it cannot order, whichever schedule hid it. Tensors live on ``cuda:0`` and ``cuda:1`` and
come contiguous and strided.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import tierstore
from tierstore import Tier
from tierstore.testing import audit, internals, plain_tensor_type, settled, wait_for
from tierstore.tiers import _accelerator, _device

gpusim = pytest.importorskip("gpusim", exc_type=ImportError)

MiB = 1 << 20
DEVICES = ("cuda:0", "cuda:1")
LAYOUTS = ("contiguous", "strided")


class Env:
    """A simulated pair of GPUs (``sim``) and a factory of stores on them (``store``)."""

    def __init__(self, sim: gpusim.Simulator, disk_dir: Path) -> None:
        self.sim = sim
        self.disk_dir = disk_dir
        self.made: list[tierstore.TieredStore] = []

    def store(self, tier: str = "host", **overrides: object) -> tierstore.TieredStore:
        """A store whose entries rest in ``tier``; "tiered": the oldest spill to disk."""
        settings: dict[str, object] = {
            "device": {"device_bytes": "unlimited"},
            "host": {"device_bytes": 0, "host_bytes": 64 * MiB},
            "disk": {"device_bytes": 0, "host_bytes": 0},
            "tiered": {"device_bytes": 0, "host_bytes": 96 * 1024},
        }[tier]
        settings = {**settings, "min_bytes": 0, "disk_dir": self.disk_dir, **overrides}
        store = tierstore.TieredStore(**settings)  # type: ignore[arg-type]
        self.made.append(store)
        return store


@contextlib.contextmanager
def session(schedule: str, disk_dir: Path) -> Iterator[Env]:
    """Simulated GPUs for the block; stores made in it are closed (and audited) before it ends,
    and the race checker must have stayed silent (else ``SimulationError`` at exit)."""
    # The store refuses tensor subclasses; the simulator's stands in for a plain device tensor.
    _device.forget_streams()
    try:
        with plain_tensor_type(gpusim.SimTensor), gpusim.simulate(schedule, legacy=True) as sim:
            env = Env(sim, disk_dir)
            try:
                yield env
            finally:
                gc.collect(1)  # young objects only: a full collection walks everything torch made
                for store in env.made:
                    if not store.closed:
                        audit(store)
                    store.close()
    finally:
        _device.forget_streams()


@pytest.fixture(params=["lazy", "eager"])
def env(request: pytest.FixtureRequest, disk_dir: Path) -> Iterator[Env]:
    try:
        with session(request.param, disk_dir) as e:
            yield e
    except gpusim.Unsupported as exc:
        pytest.skip(str(exc))


def produced(
    device: str, layout: str, seed: int, rows: int = 48, cols: int = 40
) -> tuple[torch.Tensor, torch.Tensor]:
    """A tensor computed on ``device``'s current stream (still queued), and its expected bytes."""
    g = torch.Generator().manual_seed(seed)
    host = torch.randn(rows, cols, generator=g)
    base = host.to(device)
    t = base * 3 + 1  # work the copy must wait for
    want = host * 3 + 1
    if layout == "strided":
        t, want = t.t()[:, 1::2], want.t()[:, 1::2]
    assert t.is_contiguous() == (layout == "contiguous")
    return t, want


def rests(store: tierstore.TieredStore, h: tierstore.TensorHandle, timeout: float = 10.0) -> Tier:
    """Wait until ``h``'s entry rests (no copy in flight) and return its tier."""
    resting = {tierstore.TensorState.DEVICE, tierstore.TensorState.HOST, tierstore.TensorState.DISK}
    deadline = time.monotonic() + timeout
    while store.state_of(h) not in resting:
        assert time.monotonic() < deadline, f"{h!r} still {store.state_of(h)}"
        time.sleep(0.001)
    return store.tier_of(h)


def on_host(t: torch.Tensor) -> torch.Tensor:
    """The device tensor's bytes, read back with a blocking copy on the current stream."""
    return t.cpu()


# ------------------------------------------------------------------ the simulator itself


def test_a_missing_wait_shows_in_the_bytes_or_the_checker(env: Env) -> None:
    x = torch.ones(1024, device="cuda:0") * 2
    side = torch.Stream(device="cuda:0")
    host = torch.empty(1024, pin_memory=True)
    with side:  # no side.wait_stream(...) before reading x
        host.copy_(x, non_blocking=True)
    side.synchronize()
    stale = not torch.equal(host, torch.full((1024,), 2.0))
    assert stale == (env.sim.schedule == "lazy")
    assert env.sim.errors, "the race checker missed a read of memory another stream writes"
    env.sim.errors.clear()


def test_an_early_free_shows_in_the_bytes_or_the_checker(env: Env) -> None:
    side = torch.Stream(device="cuda:1")
    x = torch.full((256,), 5.0, device="cuda:1")
    side.wait_stream(torch.accelerator.current_stream("cuda:1"))
    host = torch.empty(256, pin_memory=True)
    with side:
        host.copy_(x, non_blocking=True)
    del x  # freed while the side stream may still read it; no record_stream
    side.synchronize()
    poisoned = bool(torch.isnan(host).any())
    assert poisoned == (env.sim.schedule == "eager")
    assert env.sim.errors, "the race checker missed a free before a read on another stream ended"
    env.sim.errors.clear()


def test_query_says_not_ready_first_and_the_stream_is_per_thread(env: Env) -> None:
    side = torch.Stream(device="cuda:0")
    event = torch.Event(device="cuda:0")
    with side:
        event.record(side)
        seen: list[object] = []
        thread = threading.Thread(
            target=lambda: seen.append(torch.accelerator.current_stream("cuda:0"))
        )
        thread.start()
        thread.join()
        assert torch.accelerator.current_stream("cuda:0") == side
    assert seen[0] != side
    assert event.query() is False and event.query() is True


# ------------------------------------------------------------------ scenarios
# Each takes (env, device, layout); the tests below run them, and so do the mutation checks.


def put_get_each_tier(env: Env, device: str, layout: str) -> None:
    """Note: [Copy ordering on an accelerator]: each tier returns the bytes compute wrote,
    on the tensor's own device index, as a tensor that owns exactly its bytes."""
    for tier in ("device", "host", "disk"):
        store = env.store(tier)
        t, want = produced(device, layout, seed=len(tier))
        h = store.put(t)
        del t  # the store's reference is the last: an early free would show
        expected = {"device": Tier.DEVICE, "host": Tier.HOST, "disk": Tier.DISK}[tier]
        assert rests(store, h) is expected
        got = store.get(h)
        assert got.device == torch.device(device)
        assert got.is_contiguous() and got.storage_offset() == 0
        assert got.untyped_storage().nbytes() == want.numel() * want.element_size()
        assert torch.equal(on_host(got), want), tier
        del got
        store.release(h)


def get_from_host(env: Env, device: str, layout: str) -> None:
    """Note: [Copy ordering on an accelerator]: the reload lands in memory of the consumer's
    stream, nothing waits for it in get, and the consumer's later work waits on its event."""
    store = env.store("host")
    t, want = produced(device, layout, seed=7)
    h = store.put(t)
    del t
    assert rests(store, h) is Tier.HOST
    with torch.Stream(device=device):
        got = store.get(h)
        doubled = got * 2
        del got  # freed on the consumer's stream, after its reads
        assert torch.equal(on_host(doubled), want * 2)


def fetched(store: tierstore.TieredStore, h: tierstore.TensorHandle) -> None:
    deadline = time.monotonic() + 10
    while store.state_of(h) is not tierstore.TensorState.FETCHED:
        assert time.monotonic() < deadline, store.state_of(h)
        time.sleep(0.001)


def prefetched_on_another_stream(env: Env, device: str, layout: str) -> None:
    """A fetch allocates on the stream current at put; a getter on another stream waits for
    the copy and records the tensor, so its memory is not reused under that getter's reads."""
    store = env.store("host")
    t, want = produced(device, layout, seed=8)
    h = store.put(t)
    del t
    assert rests(store, h) is Tier.HOST
    store.prefetch([h])
    fetched(store, h)
    with torch.Stream(device=device):
        got = store.get(h)
        doubled = got * 2  # read on the getter's stream; then the tensor dies
        del got
        assert torch.equal(on_host(doubled), want * 2)


def three_fetched(
    env: Env, device: str, layout: str
) -> tuple[tierstore.TieredStore, list[tierstore.TensorHandle]]:
    """A host-tier store and three handles whose tensors it has fetched back, unasked for."""
    store = env.store("host")
    hs = []
    for seed in range(3):
        t, _ = produced(device, layout, seed=seed)
        hs.append(store.put(t))
        del t
    for h in hs:
        assert rests(store, h) is Tier.HOST
    store.prefetch(hs)
    for h in hs:
        fetched(store, h)
    return store, hs


def prefetched_then_released(env: Env, device: str, layout: str) -> None:
    """A tensor fetched back for nobody (its entry released first) is freed only after its
    copy has ended: the allocator would hand its memory to the next tensor at once."""
    _, hs = three_fetched(env, device, layout)
    del hs  # released by their handles' deaths
    gc.collect(1)
    after = torch.full((48, 40), 7.0, device=device)  # may reuse the freed memory
    assert torch.equal(on_host(after), torch.full((48, 40), 7.0))


def close_with_copies_in_flight(env: Env, device: str, layout: str) -> None:
    """Copies still waiting for compute when close() gives up on them (its timeout) are waited
    for before their sources and buffers are dropped; the checker sees every free ordered."""
    store = env.store("host", timeout=0.2)
    with env.sim.hold(torch.accelerator.current_stream(device)):
        handles = [store.put(produced(device, layout, seed=i)[0]) for i in range(3)]
        assert store.stats().inflight_bytes > 0
        store.close()
    with pytest.raises(tierstore.StoreClosedError):
        store.get(handles[0])


def spilled_through_pinned_memory(env: Env, device: str, layout: str) -> None:
    """Note: [Staging room in the pinned pool]: with no host tier (host_bytes=0), every copy
    on its way to disk once landed in pageable memory: a synchronous copy on the store's loop
    thread, and a buffer too unaligned for O_DIRECT. The pool keeps a window's worth of room
    for them, and pins only what they use; every tensor still comes back exact, from disk."""
    store = env.store("disk")
    made = [produced(device, layout, seed=i, rows=512, cols=1024) for i in range(6)]
    hs = [store.put(t) for t, _ in made]  # 2 MiB each
    assert all(rests(store, h) is Tier.DISK for h in hs)
    assert internals(store).pinned_pool.pinned is True
    if env.sim is not None:
        pinned = sum(n for _, n, _ in env.sim.pinned)
        assert 2 * MiB <= pinned <= 64 * MiB, pinned  # the pool's first piece, no more
    for h, (_, want) in zip(hs, made, strict=True):
        assert torch.equal(on_host(store.get(h)), want)


def device_tier_get_on_another_stream(env: Env, device: str, layout: str) -> None:
    """A get of an entry still on its device, from a stream other than the put's, was not
    ordered after the producer, and the store could free that memory (at release, on the
    producer's stream) under the getter's reads; gets from the other tiers were."""
    store = env.store("device")
    t, want = produced(device, layout, seed=9)
    h = store.put(t)
    del t
    assert rests(store, h) is Tier.DEVICE
    with torch.Stream(device=device):
        got = store.get(h)
        doubled = got * 2
        del got
        store.release(h)
        gc.collect(1)
        torch.full((48, 40), 7.0, device=device)  # may take the memory the release freed
        assert torch.equal(on_host(doubled), want * 2)


def put_from_a_side_stream(env: Env, device: str, layout: str) -> None:
    """The copy down waits for the stream current at each put, read anew every time: one
    cached at the first put (the default stream) left a later put's copy unordered."""
    store = env.store("host")
    first = store.put(torch.ones(4, device=device) * 1)
    assert rests(store, first) is Tier.HOST
    side = torch.Stream(device=device)
    with side:
        t, want = produced(device, layout, seed=5)
        h = store.put(t)
        del t
    assert rests(store, h) is Tier.HOST
    with side:
        assert torch.equal(on_host(store.get(h)), want)


def close_with_fetched_uploads_nobody_took(env: Env, device: str, layout: str) -> None:
    """Tensors fetched back for gets that never came are freed at close only after their
    copies end: the allocator hands their memory to the next tensor at once."""
    store, _ = three_fetched(env, device, layout)
    store.close()
    gc.collect(1)
    after = torch.full((48, 40), 7.0, device=device)  # may reuse the freed memory
    assert torch.equal(on_host(after), torch.full((48, 40), 7.0))


def store_dropped_after_close_with_uploads_nobody_took(env: Env, device: str, layout: str) -> None:
    """A store dropped right after its close, with tensors fetched back for gets that never
    came: its pinned pool goes back to the host allocator with it, and the copies up from its
    pieces hold them by address only (torch records no event for a view made from an
    address), so close waits for those copies first."""
    store, hs = three_fetched(env, device, layout)
    store.close()
    env.made.remove(store)
    del store, hs
    gc.collect()  # the pool, and with it the pinned pieces, die here
    after = torch.full((48, 40), 7.0, device=device)
    assert torch.equal(on_host(after), torch.full((48, 40), 7.0))


SCENARIOS = {
    f.__name__: f
    for f in (
        put_get_each_tier,
        get_from_host,
        prefetched_on_another_stream,
        prefetched_then_released,
        close_with_copies_in_flight,
        spilled_through_pinned_memory,
        device_tier_get_on_another_stream,
        put_from_a_side_stream,
        close_with_fetched_uploads_nobody_took,
        store_dropped_after_close_with_uploads_nobody_took,
    )
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_device_copies(env: Env, scenario: str, device: str, layout: str) -> None:
    SCENARIOS[scenario](env, device, layout)


def test_a_second_stream_taking_a_kept_upload_waits_for_it(env: Env) -> None:
    """Note: [Every stream that takes an upload]: the adapters keep what a get returned while
    a view of it lives, and a second unpack may run on another stream. The first hand-over
    forgot the upload, so the second stream read the bytes with nothing ordering it after
    the copy (the race checker's report, or bytes not copied yet)."""
    from tierstore.adapters._storage import Stored

    store = env.store("host")
    t, want = produced("cuda:0", "contiguous", seed=11)
    h = store.put(t)
    del t
    assert rests(store, h) is Tier.HOST
    stored = Stored(store, h)
    with torch.Stream(device="cuda:0"):
        first = stored.flat()
    with torch.Stream(device="cuda:0"):
        second = stored.flat()
        assert second is first
        doubled = second * 2  # read on the second stream
        del first, second
        assert torch.equal(on_host(doubled), want * 2)
    del stored


def test_a_thread_finds_a_stream_ordered_only_once_its_wait_is_queued(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Note: [Every stream that takes an upload]: two threads on one stream take the same
    upload (two gets of one entry, one answered by its future and one finding it fetched).
    The stream was marked ordered before its wait was queued, so the second thread, finding
    it marked, queued its read ahead of the first one's wait and read bytes not copied yet.
    The first thread is held between marking and waiting here."""
    from gpusim._sim import SimStream

    stream = torch.Stream(device="cuda:0")
    host = torch.full((1024,), 7.0).pin_memory()
    with stream:
        kept = [_device.upload(host, torch.device("cuda:0"), stream)]  # dropped at the end
    a_waiting, b_done = threading.Event(), threading.Event()
    real_wait = SimStream.wait_event

    def slow_wait(self: SimStream, event: object) -> None:
        if threading.current_thread().name == "A":
            a_waiting.set()
            b_done.wait(0.5)  # B runs meanwhile, unless it is held back
        real_wait(self, event)

    monkeypatch.setattr(SimStream, "wait_event", slow_wait)
    got: dict[str, torch.Tensor] = {}

    def a() -> None:
        with stream:
            _device.hand_over(kept[0])

    def b() -> None:
        a_waiting.wait(5)
        with stream:
            _device.hand_over(kept[0])
            got["doubled"] = kept[0] * 2
        b_done.set()

    threads = [threading.Thread(target=a, name="A"), threading.Thread(target=b, name="B")]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    monkeypatch.setattr(SimStream, "wait_event", real_wait)
    with stream:
        assert torch.equal(on_host(got.pop("doubled")), torch.full((1024,), 14.0))
        kept.clear()


@pytest.mark.parametrize("device", DEVICES)
def test_reloads_are_queued_on_the_consumers_stream(env: Env, device: str) -> None:
    """Note: [Copy ordering on an accelerator], from inside: a get of a host-resident entry
    returns before its copy has run, in memory of the getter's stream; a prefetch allocates
    on the stream current at put."""
    store = env.store("host")
    hs = [store.put(produced(device, "contiguous", seed=i)[0]) for i in range(2)]
    for h in hs:
        assert rests(store, h) is Tier.HOST
    consumer = torch.Stream(device=device)
    with consumer:
        got = store.get(hs[0])
        assert got._alloc.stream == consumer
        assert bool(torch.isnan(got._elem).all()), "get waited for the copy"
        del got
    producer = torch.accelerator.current_stream(device)
    store.prefetch([hs[1]])
    fetched(store, hs[1])
    with consumer:
        assert store.get(hs[1])._alloc.stream == producer


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_tensor_returns_to_its_own_device(env: Env, layout: str) -> None:
    """Tensors of both devices in one store, through host and disk: each comes back to its own
    index, and each device's copies run on side streams of that device."""
    store = env.store("tiered", host_bytes=8192)
    puts = []
    for i in range(6):
        t, want = produced(DEVICES[i % 2], layout, seed=i)
        puts.append((store.put(t), want, DEVICES[i % 2]))
        del t
    tiers = {rests(store, h) for h, _, _ in puts}
    assert tiers == {Tier.HOST, Tier.DISK}
    for h, want, device in reversed(puts):
        got = store.get(h)
        assert got.device == torch.device(device)
        assert torch.equal(on_host(got), want)
    streams = _device.side_streams()
    sides = {(index, role) for _, index, role in streams}
    assert {(0, "down"), (1, "down"), (0, "up"), (1, "up")} <= sides
    assert all(s.device_index == index for (_, index, _), s in streams.items())


@pytest.mark.parametrize("device", DEVICES)
def test_host_bytes_are_reserved_for_copies_in_flight(env: Env, device: str) -> None:
    """A copy on its way to the host tier takes its room at once: a second tensor that would
    not fit beside it is refused, not admitted over capacity."""
    t, want = produced(device, "contiguous", seed=3)
    store = env.store("host", host_bytes=t.numel() * t.element_size(), disk_bytes=0)
    with env.sim.hold(torch.accelerator.current_stream(device)):
        h = store.put(t)
        with pytest.raises(tierstore.TierFullError):
            store.put(produced(device, "contiguous", seed=4)[0])
    assert rests(store, h) is Tier.HOST
    assert torch.equal(on_host(store.get(h)), want)


def test_a_copy_that_fails_because_the_tensor_changed_fails_that_entry(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copy to the host that fails because the tensor changed after put (FSDP frees a flat
    parameter with ``resize_(0)``; here, as the simulator's storages cannot shrink, a write in
    place) ends the entry with the error a get raises (Note: [Writes after put]). It used to
    go back to the device and be copied again at once, failing again, for as long as it
    lived: 1593 tries in a second."""
    from tierstore.core import _transfers

    t, _ = produced("cuda:0", "contiguous", seed=5)
    tries = [0]

    async def freed_then_failed(src: torch.Tensor, *args: object, **kwargs: object) -> None:
        tries[0] += 1
        src.mul_(1)  # the values stay; the version counter says it was written
        raise RuntimeError("the copy failed")

    monkeypatch.setattr(_transfers, "copy_to_host", freed_then_failed)
    store = env.store("host")
    h = store.put(t)
    wait_for(lambda: store.state_of(h) is tierstore.TensorState.FAILED)
    wait_for(lambda: settled(store))
    with pytest.raises(tierstore.TensorModifiedError, match="written in place"):
        store.get(h)
    assert tries[0] == 1


def test_a_failing_copy_of_an_unchanged_tensor_pauses_copies_instead_of_looping(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The entry stays on its device, intact; no copy starts until the pause is over, then
    the store moves what waited."""
    from tierstore.core import _transfers

    real_copy = _transfers.copy_to_host
    tries = [0]

    async def refused(src: torch.Tensor, *args: object, **kwargs: object) -> None:
        tries[0] += 1
        raise RuntimeError("pinned and pageable memory both refused")

    monkeypatch.setattr(_transfers, "copy_to_host", refused)
    # Long enough for the puts below to come within the pause on a loaded machine.
    monkeypatch.setattr(_transfers, "COPY_RETRY_SECONDS", 2.0)
    store = env.store("host")
    made = [produced("cuda:0", "contiguous", seed=10 + i) for i in range(3)]
    h0 = store.put(made[0][0])
    assert rests(store, h0) is Tier.DEVICE and tries[0] == 1
    later = [store.put(t) for t, _ in made[1:]]  # each put runs the cascade: no new copy
    time.sleep(0.1)
    assert tries[0] == 1
    monkeypatch.setattr(_transfers, "copy_to_host", real_copy)
    time.sleep(2.0)
    h3 = store.put(produced("cuda:0", "contiguous", seed=13)[0])  # after the pause: all move
    for h in (h0, *later, h3):
        assert rests(store, h) is Tier.HOST
    for h, (_, want) in zip((h0, *later), made, strict=True):
        assert torch.equal(on_host(store.get(h)), want)


def test_a_copy_paused_after_a_failure_is_tried_again_with_no_other_call(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Note: [Tried again after a pause]: the entry whose copy failed moved to the host tier
    only when a later put, get or release ran the cascade; now the store tries again itself
    once copies may start."""
    from tierstore.core import _disk_room, _transfers

    real_copy = _transfers.copy_to_host
    tries = [0]

    async def refused_once(src: torch.Tensor, *args: object, **kwargs: object) -> Any:
        tries[0] += 1
        if tries[0] == 1:
            raise RuntimeError("pinned and pageable memory both refused")
        return await real_copy(src, *args, **kwargs)

    monkeypatch.setattr(_transfers, "copy_to_host", refused_once)
    monkeypatch.setattr(_transfers, "COPY_RETRY_SECONDS", 0.2)
    monkeypatch.setattr(_disk_room, "RETRY_SECONDS", 0.1)
    t, want = produced("cuda:0", "contiguous", seed=50)
    store = env.store("host")
    h = store.put(t)
    assert rests(store, h) is Tier.DEVICE and tries[0] == 1
    # Nothing but the state is asked from here on.
    wait_for(lambda: rests(store, h) is Tier.HOST and settled(store), what="the copy again")
    assert tries[0] == 2
    assert torch.equal(on_host(store.get(h)), want)


def test_a_put_after_a_failed_copy_waits_for_no_copy_that_never_started(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While copies are paused after a failed one, the cascade plans copies it does not
    start; a plan blocked behind them (past ``max_inflight_bytes``) made the next put wait
    for a move that would never end to wake it: its whole timeout, then StoreTimeoutError."""
    from tierstore.core import _transfers

    real_copy = _transfers.copy_to_host

    async def refused(src: torch.Tensor, *args: object, **kwargs: object) -> None:
        raise RuntimeError("pinned and pageable memory both refused")

    monkeypatch.setattr(_transfers, "copy_to_host", refused)
    first, want = produced("cuda:0", "contiguous", seed=20)
    nbytes = first.numel() * first.element_size()
    store = env.store("host", max_inflight_bytes=nbytes, timeout=5)
    h1 = store.put(first)
    assert rests(store, h1) is Tier.DEVICE  # its copy failed; copies are paused
    monkeypatch.setattr(_transfers, "copy_to_host", real_copy)  # the failure passed
    started = time.monotonic()
    h2 = store.put(produced("cuda:0", "contiguous", seed=21)[0])
    assert time.monotonic() - started < 4.0  # the store's timeout is 5 s
    time.sleep(_transfers.COPY_RETRY_SECONDS)
    store.put(produced("cuda:0", "contiguous", seed=22)[0])
    assert rests(store, h1) is Tier.HOST and rests(store, h2) is Tier.HOST
    assert torch.equal(on_host(store.get(h1)), want)


def test_device_entries_waiting_for_a_copy_count_against_the_host_tiers_room(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Note: [Room for a put]: entries left on the device past ``device_bytes`` (copies
    paused after a failure) land in the host tier when copies resume. Counting only the host
    tier's free room admitted every put meanwhile, and the host tier then held six tensors
    against room for two; now a put beyond what the tiers below can take raises
    TierFullError, and the host tier never passes its capacity."""
    from tierstore.core import _transfers

    real_copy = _transfers.copy_to_host

    async def refused(src: torch.Tensor, *args: object, **kwargs: object) -> None:
        raise RuntimeError("pinned and pageable memory both refused")

    monkeypatch.setattr(_transfers, "copy_to_host", refused)
    made = [produced("cuda:0", "contiguous", seed=30 + i) for i in range(6)]
    nbytes = made[0][0].numel() * made[0][0].element_size()
    store = env.store("host", host_bytes=2 * nbytes, disk_bytes=0)
    kept, refusals = [], 0
    for t, want in made:
        try:
            kept.append((store.put(t), want))
        except tierstore.TierFullError:
            refusals += 1
    assert len(kept) == 2 and refusals == 4
    monkeypatch.setattr(_transfers, "copy_to_host", real_copy)
    time.sleep(_transfers.COPY_RETRY_SECONDS)
    with pytest.raises(tierstore.TierFullError):
        store.put(produced("cuda:0", "contiguous", seed=40)[0])  # runs the cascade too
    for h, _ in kept:
        assert rests(store, h) is Tier.HOST
    assert store.stats().host.peak_bytes <= 2 * nbytes
    for h, want in kept:
        assert torch.equal(on_host(store.get(h)), want)


def test_a_copy_on_its_way_into_a_full_host_tier_counts_whole(env: Env) -> None:
    """Note: [Room for a put]: a 4 MiB copy on its way into a 4 MiB host tier, a 2 MiB disk
    tier. A 64 KiB put would push the 4 MiB entry, the oldest, onto the disk, which cannot
    take it. The copy was counted as bytes, the 64 KiB put admitted, and the host tier then
    held 4.06 MiB of 4."""
    store = env.store("host", host_bytes=4 * MiB, disk_bytes=2 * MiB)
    with env.sim.hold(torch.accelerator.current_stream("cuda:0")):
        big = torch.ones(MiB, device="cuda:0") * 2  # 4 MiB, its producer still queued
        h = store.put(big)
        del big
        with pytest.raises(tierstore.TierFullError, match="no tier has room"):
            store.put(torch.ones(16 * 1024, device="cuda:0") * 3)
    assert rests(store, h) is Tier.HOST
    wait_for(lambda: settled(store))
    stats = store.stats()
    assert stats.host.peak_bytes <= 4 * MiB and stats.kept_no_room == 0, stats
    assert torch.equal(on_host(store.get(h)), torch.full((MiB,), 2.0))


def test_an_unlimited_host_tier_pins_what_it_holds(env: Env) -> None:
    """Note: [Pinned as needed, in power-of-two pieces]: a store whose host tier is
    "unlimited" once pinned all of the machine's memory at its first copy (on an H200 that
    failed part way and got the process killed). It pins what its tensors need, and every
    tensor comes back exact."""
    store = env.store("host", host_bytes="unlimited")
    made = [produced("cuda:0", "contiguous", seed=i, rows=512, cols=1024) for i in range(6)]
    hs = [store.put(t) for t, _ in made]  # 2 MiB each
    assert all(rests(store, h) is Tier.HOST for h in hs)
    pinned = sum(n for _, n, _ in env.sim.pinned)
    assert 12 * MiB <= pinned <= 64 * MiB, pinned  # the first piece, not the machine
    for h, (_, want) in zip(hs, made, strict=True):
        assert torch.equal(on_host(store.get(h)), want)


def test_the_legacy_cuda_api_path(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    """On torch before 2.6 the seam uses torch.cuda's streams and events; same result."""
    monkeypatch.setattr(_accelerator, "_generic", lambda: False)
    put_get_each_tier(env, "cuda:1", "strided")


def test_info_reports_the_accelerator_through_the_seam(env: Env) -> None:
    from tierstore.__main__ import collect_info

    info = collect_info()["cuda"]
    assert info == {
        "available": True,
        "type": "cuda",
        "devices": ["simulated GPU 0", "simulated GPU 1"],
        "pinning": True,
        "pinning_detail": "ok",
    }


def test_put_accepts_the_accelerators_own_device_type(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not the string "cuda": whatever device type the runtime names (xpu, a renamed one)."""
    from tierstore.core._checks import check_tensor

    meta = torch.empty(4, device="meta")
    with pytest.raises(tierstore.UnsupportedTensorError, match="meta"):
        check_tensor(meta)
    monkeypatch.setattr(_accelerator, "accelerator_type", lambda: "meta")
    check_tensor(meta)


# ------------------------------------------------------------------ training


class Block(torch.nn.Module):
    """A pre-norm transformer block: fused QKV (three views of one storage), causal mask."""

    def __init__(self, dim: int = 32, heads: int = 2, seq: int = 16) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.qkv, self.proj = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
        self.fc1, self.fc2 = torch.nn.Linear(dim, 2 * dim), torch.nn.Linear(2 * dim, dim)
        self.register_buffer("mask", torch.ones(seq, seq, dtype=torch.bool).tril())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        q, k, v = (t.reshape(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / (d // self.heads) ** 0.5
        att = att.masked_fill(~self.mask[:s, :s], float("-inf")).softmax(-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, s, d))
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))


def model_on(device: str, layers: int = 2) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(*(Block() for _ in range(layers))).to(device)


def batch_on(device: str, layout: str) -> torch.Tensor:
    """A (2, 16, 32) input; strided: a transposed view, as a layer's output may be."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 16, 32, generator=g)
    if layout == "strided":
        x = torch.randn(32, 16, 2, generator=g).permute(2, 1, 0)
    return x.to(device) if layout == "contiguous" else x.contiguous().to(device).transpose(0, 0)


def step(
    model: torch.nn.Module,
    x: torch.Tensor,
    wrap: Callable[[], object] | None = None,
    layer: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor] | None = None,
    between: Callable[[], object] | None = None,
) -> list[torch.Tensor]:
    """One training step's loss and gradients, read back to the host; ``between`` runs after
    the forward, before the backward."""
    model.zero_grad(set_to_none=True)
    ctx = wrap() if wrap is not None else None
    if ctx is not None:
        ctx.__enter__()  # type: ignore[attr-defined]
    try:
        h = x
        for block in model:
            h = block(h) if layer is None else layer(block, h)
        loss = (h * h).mean()
    finally:
        if ctx is not None:
            ctx.__exit__(None, None, None)  # type: ignore[attr-defined]
    if between is not None:
        between()
    loss.backward()
    return [loss.detach().cpu()] + [p.grad.cpu() for p in model.parameters()]


def assert_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert torch.equal(x, y), f"tensor {i} differs (NaN: {bool(torch.isnan(x).any())})"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_offload_activations_gradients_equal_no_offloading(
    env: Env, device: str, layout: str
) -> None:
    """Through the host tier and on to disk (the oldest entries spill)."""
    model, x = model_on(device), batch_on(device, layout)
    plain = step(model, x)
    store = env.store("tiered")
    offloaded = step(
        model,
        x,
        wrap=lambda: tierstore.offload_activations(store, min_bytes=0),
        # The backward would take entries whose copies have not landed from their device:
        # the copies to the host and the spills must have ended for the path to be taken.
        between=lambda: wait_for(lambda: settled(store), what="the copies and spills"),
    )
    st = store.stats()
    assert st.bytes_to_host > 0 and st.bytes_to_disk > 0
    assert_same(offloaded, plain)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_checkpoint_gradients_equal_no_offloading(env: Env, device: str, layout: str) -> None:
    model, x = model_on(device), batch_on(device, layout)
    plain = step(model, x)
    store = env.store("tiered", host_bytes=4096)
    ckpt = step(
        model,
        x,
        layer=lambda block, h: tierstore.checkpoint(block, h, store=store),
        between=lambda: wait_for(lambda: settled(store), what="the copies and spills"),
    )
    st = store.stats()
    assert st.bytes_to_host > 0 and st.bytes_to_disk > 0
    assert_same(ckpt, plain)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_prefetch_during_backward(env: Env, device: str, layout: str) -> None:
    """Backward finds its tensors fetched or on their way (uploads allocated on the stream of
    their put), and takes them with the exact bytes."""
    model, x = model_on(device, layers=3), batch_on(device, layout)
    plain = step(model, x)
    store = env.store("tiered", prefetch_bytes=MiB)
    offloaded = step(
        model,
        x,
        wrap=lambda: tierstore.offload_activations(store, min_bytes=0),
        # On a loaded machine the backward can come before the copies down have landed, and
        # then takes every tensor from its device with nothing to fetch.
        between=lambda: wait_for(lambda: settled(store), what="the copies and spills"),
    )
    assert_same(offloaded, plain)
    st = store.stats()
    assert st.prefetch_hits > 0 and st.bytes_to_device > 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_held_back_compute_stream_with_copies_in_flight(
    env: Env, device: str, layout: str
) -> None:
    """The forced race: the compute stream is held back, as behind long kernels, for the whole
    forward, so every copy down is in flight while later activations are produced and put."""
    model, x = model_on(device), batch_on(device, layout)
    plain = step(model, x)
    store = env.store("host")
    compute = torch.accelerator.current_stream(device)
    model.zero_grad(set_to_none=True)
    with env.sim.hold(compute), tierstore.offload_activations(store, min_bytes=0):
        h = x
        for block in model:
            h = block(h)
        loss = (h * h).mean()
        assert store.stats().inflight_bytes > 0, "no copy was left waiting for compute"
    loss.backward()
    got = [loss.detach().cpu()] + [p.grad.cpu() for p in model.parameters()]
    assert_same(got, plain)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_forwards_without_backward_leave_nothing(env: Env, device: str, layout: str) -> None:
    """An eval forward puts nothing; a training forward dropped without backward releases its
    entries while their copies are in flight, and their memory is freed only after them."""
    model, x = model_on(device), batch_on(device, layout)
    store = env.store("tiered")
    with torch.no_grad(), tierstore.offload_activations(store, min_bytes=0):
        model.eval()
        model(x).sum().cpu()
        model.train()
    assert store.stats().puts == 0
    with env.sim.hold(torch.accelerator.current_stream(device)):
        with tierstore.offload_activations(store, min_bytes=0):
            loss = model(x).sum()
        assert store.stats().live_entries > 0
        del loss
        gc.collect(1)
        deadline = time.monotonic() + 10
        while store.stats().live_entries:
            assert time.monotonic() < deadline
            time.sleep(0.001)
    deadline = time.monotonic() + 10
    while store.stats().inflight_bytes or store.stats().host.bytes:
        assert time.monotonic() < deadline, store.stats()
        time.sleep(0.001)


def test_spills_move_between_the_pinned_pool_and_the_disk_without_a_copy(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Note: [The pinned pool]: buffers are page-aligned, so the raw engine writes a big
    tensor's host copy and reads it back with O_DIRECT straight from and into the pool."""
    from tierstore.tiers.raw import _chunk_io

    copied: list[tuple[int, int]] = []
    real = _chunk_io.memmove

    def spy(dst: int, src: int, n: int) -> None:
        copied.append((dst, src))
        real(dst, src, n)

    monkeypatch.setattr(_chunk_io, "memmove", spy)
    store = env.store("host", host_bytes=8 * MiB, direct_io="on")
    big = [produced("cuda:0", "contiguous", seed=i, rows=768, cols=1024) for i in range(3)]
    hs = [store.put(t) for t, _ in big]
    assert rests(store, hs[0]) is Tier.DISK  # the third put made the first spill
    pool = internals(store).pinned_pool
    region = pool.pieces()
    assert pool.pinned is True

    def in_pool(address: int) -> bool:
        return any(start <= address < start + n for start, n in region)

    got = store.get(hs[0])
    assert torch.equal(on_host(got), big[0][1])
    assert not [c for c in copied if in_pool(c[0]) or in_pool(c[1])], "a bounce copy"
    assert store.stats().bytes_from_disk == 3 * MiB


@pytest.mark.parametrize("bit", ["conj", "neg"])
def test_a_device_tensor_with_a_lazy_bit_comes_back_resolved(env: Env, bit: str) -> None:
    """CUDA's non-blocking copy into pinned memory moves the bytes and loses a lazy conj or
    neg bit (its host fix-up runs before the bytes land); the store copied ``x.conj()`` so,
    and gave back the unconjugated values. The simulator's copy does as CUDA does."""
    store = env.store("host", host_bytes="unlimited")
    x = torch.complex(torch.arange(8.0), torch.arange(8.0) + 0.5).to("cuda:0")
    # Contiguous, as a strided one would be made contiguous (and resolved) before the copy.
    t = x.conj() if bit == "conj" else torch._neg_view(torch.arange(8.0).to("cuda:0"))
    assert t.is_conj() if bit == "conj" else t.is_neg()
    want = on_host(t.resolve_conj().resolve_neg())
    h = store.put(t)
    assert rests(store, h) is Tier.HOST
    assert torch.equal(on_host(store.get(h)), want)


def test_an_upload_released_while_its_fetch_ends_is_discarded(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The entry goes while its upload is queued on the up stream: the upload nobody takes
    must be discarded (its memory's stream waits for the copy), or the next tensor allocated
    there is written by the copy still running."""
    from tierstore.core import _transfers

    store = env.store("host")
    t, _ = produced("cuda:0", "contiguous", seed=3)
    h = store.put(t)
    del t
    assert rests(store, h) is Tier.HOST
    real = _transfers.Transfers._fetched
    box = [h]

    def fetched_then_released(self: Any, *args: Any) -> Any:
        out = real(self, *args)
        store._core.release(box.pop())  # on the loop thread, inside the store's call
        return out

    monkeypatch.setattr(_transfers.Transfers, "_fetched", fetched_then_released)
    store.prefetch([h])
    del h
    wait_for(lambda: store.stats().live_entries == 0 and settled(store))
    stats = store.stats()
    assert stats.device.bytes == stats.host.bytes == stats.disk.bytes == 0, stats
    gc.collect(1)
    after = torch.full((48, 40), 7.0, device="cuda:0")
    assert torch.equal(on_host(after), torch.full((48, 40), 7.0))


def test_uploads_made_before_a_cancelled_read_of_their_batch_are_discarded(env: Env) -> None:
    """A batch of fetches whose engine answers one read as cancelled (an engine's own close
    cancelling its reads) ends there, after the uploads of the entries read before it were
    queued: those uploads nobody takes must be discarded (their memory's stream waits for the
    copy), or the next tensor allocated there is written by the copy still running."""
    from tierstore.testing import install_faults

    store = env.store("disk")
    faulty = install_faults(store)
    real_read_many = faulty.read_many
    made = [produced("cuda:0", "contiguous", seed=20 + i) for i in range(2)]
    hs = [store.put(t) for t, _ in made]
    del made
    assert all(rests(store, h) is Tier.DISK for h in hs)

    async def first_read_then_cancelled(requests: Any) -> list[BaseException | None]:
        first = await real_read_many(requests[:1])
        return [*first, *(asyncio.CancelledError() for _ in requests[1:])]

    faulty.read_many = first_read_then_cancelled  # type: ignore[method-assign]
    store.prefetch(hs)
    wait_for(lambda: faulty.reads >= 1 and settled(store))
    gc.collect(1)
    after = torch.full((48, 40), 7.0, device="cuda:0")
    assert torch.equal(on_host(after), torch.full((48, 40), 7.0))


def test_a_put_behind_copies_paused_for_long_does_not_wait_for_them(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Note: [The save semaphore]: only a move in flight wakes a waiting put. While copies
    are paused after a failed one, a plan blocked behind copies it did not start has none in
    flight, so the put must go on at once. (The test above passes even when such a put
    waits, because its pause is shorter than the store's timeout; here the pause outlasts
    the timeout.)"""
    from tierstore.core import _transfers

    async def refused(src: torch.Tensor, *args: object, **kwargs: object) -> None:
        raise RuntimeError("pinned and pageable memory both refused")

    monkeypatch.setattr(_transfers, "copy_to_host", refused)
    monkeypatch.setattr(_transfers, "COPY_RETRY_SECONDS", 600.0)  # paused for the whole test
    first, want = produced("cuda:0", "contiguous", seed=60)
    nbytes = first.numel() * first.element_size()
    store = env.store("host", max_inflight_bytes=nbytes, timeout=3)
    h1 = store.put(first)
    assert rests(store, h1) is Tier.DEVICE  # its copy failed; copies are paused
    h2 = store.put(produced("cuda:0", "contiguous", seed=61)[0])  # no StoreTimeoutError
    assert store.stats().inflight_bytes == 0
    assert rests(store, h2) is Tier.DEVICE and rests(store, h1) is Tier.DEVICE
    assert torch.equal(on_host(store.get(h1)), want)


def test_a_tensor_written_while_its_copy_to_the_host_runs_fails_its_entry(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A device tensor written in place while its copy to the host tier runs: the copy may
    hold the bytes of either moment, so the entry fails with the error a get raises. Without
    the check after the copy, the host copy was kept and a get returned it, the write
    unnoticed."""
    from tierstore.core import _transfers

    real_copy = _transfers.copy_to_host
    t, _ = produced("cuda:0", "contiguous", seed=21)

    async def written_meanwhile(src: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        host = await real_copy(src, *args, **kwargs)
        src.mul_(1)  # the values stay; the version counter says it was written
        return host

    monkeypatch.setattr(_transfers, "copy_to_host", written_meanwhile)
    store = env.store("host")
    h = store.put(t)
    wait_for(lambda: settled(store))
    assert store.state_of(h) is tierstore.TensorState.FAILED
    with pytest.raises(tierstore.TensorModifiedError, match="written in place"):
        store.get(h)


def test_a_copy_on_its_way_to_a_full_host_tier_spills_the_oldest_at_once(env: Env) -> None:
    """The host tier is full with one tensor when a second one's copy to it starts: the copy
    counts against the tier at once, so the oldest host entry is spilled while the copy runs.
    Counting only what rests there, the spill waited for the copy to land, and the host tier
    then held both tensors against room for one until it ended."""
    old_t, old_want = produced("cuda:0", "contiguous", seed=22)
    nbytes = old_t.numel() * old_t.element_size()
    store = env.store("host", host_bytes=nbytes)
    old = store.put(old_t)
    assert rests(store, old) is Tier.HOST
    with env.sim.hold(torch.accelerator.current_stream("cuda:0")):
        new_t, new_want = produced("cuda:0", "contiguous", seed=23)  # its producer queued
        new = store.put(new_t)
        del new_t
        wait_for(lambda: store.tier_of(old) is Tier.DISK, what="the oldest spilled")
        assert store.state_of(new) is tierstore.TensorState.MOVING_TO_HOST
    assert rests(store, new) is Tier.HOST
    wait_for(lambda: settled(store))
    assert store.stats().host.peak_bytes <= nbytes
    assert torch.equal(on_host(store.get(old)), old_want)
    assert torch.equal(on_host(store.get(new)), new_want)
