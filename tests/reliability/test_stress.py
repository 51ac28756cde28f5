"""Concurrency stress, a hypothesis state machine against a dict model, round-trip properties.

Every test here ends with ``audit()`` (counters recomputed from the entries) and the
``make_store`` fixture's check that no spill directory is left after close.
"""

from __future__ import annotations

import errno
import faulthandler
import gc
import random
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    rule,
)

from tierstore import (
    SpillIOError,
    TensorReleasedError,
    TensorState,
    Tier,
    TieredStore,
    TierFullError,
)
from tierstore.core import _disk_room as disk_room
from tierstore.testing import audit, install_faults, settled, wait_for

KiB = 1 << 10
MiB = 1 << 20
MakeStore = Callable[..., TieredStore]

# Reproducible in CI: no example database, derandomized search, no wall-clock deadline (the
# machine is shared and two cores are busy with the store's own threads).
PROFILE = settings(
    database=None,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.complex64,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
]


def _tensor(seed: int, nbytes: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    return torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    )


# --------------------------------------------------------------------------- 8-thread stress


# Sizes the stress threads put: small ones (packs, page edges), and ones past 1 MiB that the
# disk tier writes alone, in several chunks (1 MiB chunks in that run), at odd lengths.
SMALL_SIZES = [1, 4095, 4096, 4097, 64 * KiB, 200 * KiB]
BIG_SIZES = [4097, 64 * KiB, MiB + 4097, 2 * MiB + MiB // 2 + 3, 3 * MiB]


def _worker(
    store: TieredStore,
    seed: int,
    ops: int,
    errors: list[BaseException],
    kept: dict[int, list[tuple[Any, torch.Tensor]]],
    faults: bool,
    sizes: list[int],
) -> None:
    rng = random.Random(seed)
    mine: list[tuple[Any, torch.Tensor]] = []
    try:
        for i in range(ops):
            op = rng.random()
            if op < 0.35 or not mine:
                t = _tensor(seed * 100_000 + i, rng.choice(sizes))
                try:
                    mine.append((store.put(t), t))
                except TierFullError:
                    if not faults:
                        raise
                    if mine:
                        store.release(mine.pop(0)[0])
            elif op < 0.65:
                h, t = rng.choice(mine)
                for attempt in range(50):
                    try:
                        out = store.get(h)
                        break
                    except SpillIOError:
                        if not faults or attempt == 49:
                            raise
                assert torch.equal(out, t), f"wrong bytes for {h!r}"
            elif op < 0.75:
                store.prefetch([h for h, _ in rng.sample(mine, min(len(mine), 4))])
            elif op < 0.85:
                h, _t = mine.pop(rng.randrange(len(mine)))
                store.release(h)
                assert store.state_of(h) is TensorState.RELEASED
            elif op < 0.95:
                # Drop the last reference: the weakref callback releases the entry.
                mine.pop(rng.randrange(len(mine)))
            else:
                h, _t = rng.choice(mine)
                assert store.tier_of(h) in (Tier.DEVICE, Tier.HOST, Tier.DISK)
    except BaseException as exc:
        errors.append(exc)
    kept[seed] = mine


@pytest.mark.parametrize("big", [False, True], ids=["small", "over-1MiB"])
@pytest.mark.parametrize("faults", [False, True], ids=["clean", "with-io-faults"])
def test_eight_threads_thousands_of_random_calls(
    make_store: MakeStore, monkeypatch: pytest.MonkeyPatch, faults: bool, big: bool
) -> None:
    monkeypatch.setattr(disk_room, "RETRY_SECONDS", 0.01)
    if big:
        ops, sizes = 150, BIG_SIZES
        store = make_store(
            device_bytes=0,
            host_bytes=4 * MiB,
            prefetch_bytes=6 * MiB,
            max_inflight_bytes=6 * MiB,
            disk_bytes=1024 * MiB,
            io_chunk_bytes=MiB,
        )
    else:
        ops, sizes = 400, SMALL_SIZES
        store = make_store(
            device_bytes=0,
            host_bytes=MiB,
            prefetch_bytes=512 * KiB,
            max_inflight_bytes=512 * KiB,
            disk_bytes=64 * MiB,
        )
    faulty = install_faults(store)
    if faults:
        # Fail every 7th write and every 5th read (deterministic, across threads).
        counter = {"w": 0, "r": 0}
        real_write, real_read = faulty.inner.write, faulty.inner.read

        async def write(key: int, src: torch.Tensor, **kw: Any) -> None:
            counter["w"] += 1
            if counter["w"] % 7 == 0:
                raise OSError(errno.EIO, "injected")
            await real_write(key, src, **kw)

        async def read(key: int, out: torch.Tensor) -> None:
            counter["r"] += 1
            if counter["r"] % 5 == 0:
                raise OSError(errno.EIO, "injected")
            await real_read(key, out)

        faulty.inner.write = write  # type: ignore[method-assign]
        faulty.inner.read = read  # type: ignore[method-assign]

    errors: list[BaseException] = []
    kept: dict[int, list[tuple[Any, torch.Tensor]]] = {}
    threads = [
        threading.Thread(target=_worker, args=(store, seed, ops, errors, kept, faults, sizes))
        for seed in range(8)
    ]
    # A deadlock becomes a failure with every thread's stack, not a hung CI job.
    faulthandler.dump_traceback_later(150, exit=True, file=sys.stderr)
    try:
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            audit(store)  # consistent while eight threads race
            for t in threads:
                t.join(0.05)
        for t in threads:
            t.join(60)
            assert not t.is_alive(), "a worker thread is stuck"
    finally:
        faulthandler.cancel_dump_traceback_later()
    assert not errors, errors[:3]
    live = [pair for pairs in kept.values() for pair in pairs]
    wait_for(lambda: settled(store))
    gc.collect()
    st = store.stats()
    assert st.live_entries == len(live), (st.live_entries, len(live))
    assert st.puts - st.releases == len(live)
    audit(store)
    for h, t in live:  # no entry lost, none garbled
        for _ in range(50):
            try:
                assert torch.equal(store.get(h), t)
                break
            except SpillIOError:
                assert faults
    assert st.puts > 1.5 * ops and st.gets > 1.5 * ops, st
    assert st.bytes_to_disk > 2 * MiB and st.bytes_from_disk > MiB // 2, st  # the disk worked
    if big:
        assert st.bytes_to_disk > 64 * MiB and st.bytes_from_disk > 16 * MiB, st
    if faults:
        assert st.write_errors > 0 and st.read_errors > 0
    del live, kept, h, t
    gc.collect()

    def drained() -> bool:
        st = store.stats()
        return st.live_entries == 0 and st.host.bytes == st.disk.bytes == st.device.bytes == 0

    # Reads of entries released mid-fetch finish in the background, then free their bytes.
    wait_for(drained, what="every byte freed")
    audit(store)
    wait_for(lambda: faulty.written == set(), what="every spilled key deleted")


# --------------------------------------------------------------------------- state machine


class StoreMachine(RuleBasedStateMachine):
    """Random put/get/prefetch/release/drop sequences against a dict of expected tensors."""

    handles = Bundle("handles")

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="statemachine-"))
        self.model: dict[int, tuple[Any, torch.Tensor]] = {}
        self.store: TieredStore | None = None

    @initialize(
        target=handles,
        device=st.sampled_from([0, 64 * KiB]),
        host=st.sampled_from([0, 48 * KiB, 256 * KiB]),
        prefetch=st.sampled_from([16 * KiB, 1 * MiB]),
        first=st.lists(st.integers(1024, 50_000), min_size=4, max_size=10),
    )
    def open_store(self, device: int, host: int, prefetch: int, first: list[int]) -> Any:
        return self._open(device, host, prefetch, first)

    def _open(
        self, device: int, host: int, prefetch: int, first: list[int], **settings: object
    ) -> Any:
        # A short pause after a write error keeps sequences with faults quick.
        self.saved_retry = disk_room.RETRY_SECONDS
        disk_room.RETRY_SECONDS = 0.01
        settings = {"max_inflight_bytes": 64 * KiB, "disk_bytes": 16 * MiB, **settings}
        self.store = TieredStore(
            disk_dir=self.dir,
            device_bytes=device,
            host_bytes=host,
            prefetch_bytes=prefetch,
            min_bytes=1024,
            **settings,
        )
        self.faulty = install_faults(self.store)
        # Start with a batch, so every sequence has entries moving through every tier.
        return multiple(*(self._put(seed, n) for seed, n in enumerate(first)))

    def _put(self, seed: int, nbytes: int) -> int:
        assert self.store is not None
        t = _tensor(seed, nbytes)
        h = self.store.put(t)
        self.model[h.key] = (h, t)
        return int(h.key)

    @rule()
    def fail_next_write(self) -> None:
        self.faulty.fail_writes(errno.EIO, times=1)

    @rule()
    def fail_next_read(self) -> None:
        self.faulty.fail_reads(errno.EIO, times=1)

    @rule(
        target=handles,
        seed=st.integers(0, 10**6),
        # Spilling sizes first: hypothesis treats the first choice as the simplest.
        nbytes=st.sampled_from([40000, 20000, 4097, 1024, 1000, 1, 0]),
    )
    def put(self, seed: int, nbytes: int) -> Any:
        return self._put_until_admitted(seed, nbytes)

    def _put_until_admitted(self, seed: int, nbytes: int) -> Any:
        for _attempt in range(1000):
            try:
                return self._put(seed, nbytes)
            except TierFullError:
                # Only while the disk tier pauses (10 ms) after an injected write error; the
                # put must succeed after it, so the bundle does not depend on timing.
                assert self.faulty.failed_writes > 0
                time.sleep(0.002)
        raise AssertionError("put kept raising TierFullError after the disk pause")

    @rule(key=handles)
    def get(self, key: int) -> None:
        assert self.store is not None
        if key not in self.model:
            return
        h, t = self.model[key]
        try:
            out = self.store.get(h)
        except SpillIOError as exc:  # an injected read fault, used up now: the retry works
            assert f"tensor #{h.key}" in str(exc)
            out = self.store.get(h)
        assert torch.equal(out, t)

    @rule(keys=st.lists(handles, max_size=4))
    def prefetch(self, keys: list[int]) -> None:
        assert self.store is not None
        self.store.prefetch([self.model[k][0] for k in keys if k in self.model])

    @rule(key=consumes(handles))
    def release(self, key: int) -> None:
        assert self.store is not None
        if key not in self.model:
            return
        h, _t = self.model.pop(key)
        self.store.release(h)
        with pytest.raises(TensorReleasedError):
            self.store.get(h)

    @rule(key=consumes(handles))
    def drop(self, key: int) -> None:
        self.model.pop(key, None)  # the handle's last reference goes; the store releases it

    @rule()
    def settle(self) -> None:
        assert self.store is not None
        wait_for(lambda: self.store is not None and settled(self.store))

    @invariant()
    def consistent(self) -> None:
        if self.store is None:
            return
        # Handles are only in self.model (the bundle holds keys): a dropped one dies at once.
        assert self.store.stats().live_entries == len(self.model)
        audit(self.store)

    def teardown(self) -> None:
        if hasattr(self, "saved_retry"):
            disk_room.RETRY_SECONDS = self.saved_retry
        if self.store is not None:
            self.faulty.heal()
            for h, t in self.model.values():
                try:
                    out = self.store.get(h)
                except SpillIOError:  # a prefetch may have used an injected fault
                    out = self.store.get(h)
                assert torch.equal(out, t)
            self.store.close()
            leftovers = list(self.dir.iterdir())
            shutil.rmtree(self.dir, ignore_errors=True)
            assert leftovers == [], leftovers
        else:
            shutil.rmtree(self.dir, ignore_errors=True)


TestStoreMachine = StoreMachine.TestCase
TestStoreMachine.settings = settings(PROFILE, max_examples=30, stateful_step_count=30)


class BigStoreMachine(StoreMachine):
    """The same sequences with tensors past 1 MiB, which the disk tier writes alone (not in a
    pack) and in several 1 MiB chunks, next to small ones."""

    @initialize(
        target=StoreMachine.handles,
        device=st.sampled_from([0, 3 * MiB]),
        host=st.sampled_from([0, 3 * MiB]),
        prefetch=st.sampled_from([2 * MiB, 6 * MiB]),
        first=st.lists(st.sampled_from([MiB + 4097, 2 * MiB + 3, 40000]), min_size=2, max_size=5),
    )
    def open_store(self, device: int, host: int, prefetch: int, first: list[int]) -> Any:
        return self._open(
            device,
            host,
            prefetch,
            first,
            io_chunk_bytes=MiB,
            max_inflight_bytes=4 * MiB,
            disk_bytes=256 * MiB,
        )

    @rule(
        target=StoreMachine.handles,
        seed=st.integers(0, 10**6),
        nbytes=st.sampled_from([MiB + 4097, 2 * MiB + MiB // 2 + 3, 3 * MiB, 40000, 4097, 0]),
    )
    def put(self, seed: int, nbytes: int) -> Any:
        return self._put_until_admitted(seed, nbytes)


TestBigStoreMachine = BigStoreMachine.TestCase
TestBigStoreMachine.settings = settings(PROFILE, max_examples=15, stateful_step_count=25)


# --------------------------------------------------------------------------- round trips


@st.composite
def _tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 9), min_size=0, max_size=4)))
    n = 1
    for s in shape:
        n *= s
    seed = draw(st.integers(0, 2**31))
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = _tensor(seed, n * itemsize)
    if dtype is torch.bool:
        raw = raw % 2
    t = raw.view(dtype).reshape(shape)
    layout = draw(st.sampled_from(["contiguous", "transposed", "sliced", "expanded", "offset"]))
    if layout == "transposed" and t.dim() >= 2:
        t = t.transpose(0, -1)
    elif layout == "sliced" and t.dim() >= 1 and t.shape[0] > 1:
        t = t[::2]
    elif layout == "expanded" and t.dim() >= 1 and t.shape[0] == 1:
        t = t.expand(3, *t.shape[1:])
    elif layout == "offset" and t.numel() > 1:
        t = t.reshape(-1)[1:]
    return t


@pytest.mark.parametrize("tier", ["device", "host", "disk"])
def test_round_trips_of_random_shapes_dtypes_and_strides(disk_dir: Path, tier: str) -> None:
    caps = {"device": (1 << 40, 0), "host": (0, 1 << 40), "disk": (0, 0)}[tier]
    with TieredStore(
        disk_dir=disk_dir, device_bytes=caps[0], host_bytes=caps[1], min_bytes=1
    ) as store:

        @settings(PROFILE, max_examples=60)
        @given(t=_tensors())
        def check(t: torch.Tensor) -> None:
            expected = t.clone()
            h = store.put(t)
            if tier == "disk" and h.nbytes:
                wait_for(lambda: store.tier_of(h) is Tier.DISK)
            out = store.get(h)
            assert _same_bits(out, expected), (t.shape, t.stride(), t.dtype)
            assert out.shape == t.shape and out.dtype == t.dtype and out.device == t.device
            store.release(h)

        check()
        audit(store)
        assert store.stats().live_entries == 0
    assert list(disk_dir.iterdir()) == []
