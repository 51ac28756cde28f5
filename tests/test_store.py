"""TieredStore end to end on real files: tiers, cascade, prefetch, semaphore, lifetime."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import errno
import functools
import gc
import logging
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import thread as cf_thread
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch

import tierstore
from tierstore import (
    StoreClosedError,
    TensorReleasedError,
    TensorState,
    Tier,
    TieredStore,
    TierFullError,
    UnsupportedTensorError,
    WrongThreadError,
    _registry,
)
from tierstore.testing import FaultyEngine, audit, install_faults, internals, settled, wait_for

if TYPE_CHECKING:
    from tierstore.tiers import DiskEngine

MiB = 1 << 20
MakeStore = Callable[..., TieredStore]


def _cpu_dtypes() -> list[torch.dtype]:
    names = [
        "float32",
        "float64",
        "float16",
        "bfloat16",
        "complex64",
        "complex128",
        "complex32",
        "uint8",
        "int8",
        "int16",
        "int32",
        "int64",
        "bool",
        "uint16",
        "uint32",
        "uint64",
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
    ]
    return [getattr(torch, n) for n in names if hasattr(torch, n)]


def _random(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random bytes reinterpreted as ``dtype``: every bit pattern, NaNs included."""
    g = torch.Generator().manual_seed(seed)
    n = 1
    for s in shape:
        n *= s
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * itemsize,), dtype=torch.uint8, generator=g)
    if dtype is torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit equality, so NaN payloads and -0.0 count."""
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    # A fresh tensor has plain strides, which view(uint8) needs.
    fresh_a = torch.empty(a.shape, dtype=a.dtype, device=a.device).copy_(a)
    fresh_b = torch.empty(b.shape, dtype=b.dtype, device=b.device).copy_(b)
    return torch.equal(fresh_a.reshape(-1).view(torch.uint8), fresh_b.reshape(-1).view(torch.uint8))


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("tier", ["device", "host", "disk"])
@pytest.mark.parametrize("dtype", _cpu_dtypes(), ids=str)
def test_every_dtype_round_trips_bit_exact_in_every_tier(
    make_store: MakeStore, dtype: torch.dtype, tier: str
) -> None:
    caps = {"device": ("unlimited", "0"), "host": ("0", "unlimited"), "disk": ("0", "0")}[tier]
    store = make_store(device_bytes=caps[0], host_bytes=caps[1])
    t = _random((3, 5, 7), dtype, seed=_cpu_dtypes().index(dtype))
    h = store.put(t)
    wait_for(lambda: store.state_of(h) in (TensorState.DEVICE, TensorState.HOST, TensorState.DISK))
    assert store.tier_of(h) is Tier(tier)
    for _ in range(2):  # get repeats until release
        out = store.get(h)
        assert _same_bits(out, t)


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_views_noncontiguous_zero_size_and_scalars(make_store: MakeStore, tier: str) -> None:
    store = make_store(device_bytes=0, host_bytes="unlimited" if tier == "host" else 0)
    base = _random((64, 48), torch.float32, seed=1)
    cases = {
        "transpose": base.t(),
        "slice": base[3:40:3, 5:],
        "expand": torch.arange(6.0).reshape(6, 1).expand(6, 9),
        "narrow_view": base.narrow(0, 10, 4),
        "zero_size": torch.empty(0, 4, dtype=torch.bfloat16),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "conj": torch.randn(5, dtype=torch.complex64).conj(),
        "neg_bit": torch.randn(4, dtype=torch.complex64).conj().imag,
    }
    handles = {k: store.put(v) for k, v in cases.items()}
    wait_for(lambda: settled(store))
    if tier == "disk":
        tiers = {k: store.tier_of(h) for k, h in handles.items()}
        assert tiers.pop("zero_size") is Tier.DEVICE  # nothing to move
        assert set(tiers.values()) == {Tier.DISK}, tiers
    for name, h in handles.items():
        out = store.get(h)
        expected = cases[name].resolve_conj().resolve_neg()
        assert _same_bits(out, expected), name


def test_host_tier_on_cpu_holds_the_tensor_itself(make_store: MakeStore) -> None:
    store = make_store(device_bytes=0, host_bytes="unlimited")
    t = torch.randn(MiB // 4)
    h = store.put(t)
    assert store.tier_of(h) is Tier.HOST
    assert store.get(h).data_ptr() == t.data_ptr()  # no copy


def test_a_view_does_not_keep_its_base_alive(make_store: MakeStore) -> None:
    # Releasing a tensor frees its storage, views of a larger base included: once moved, the
    # store holds a compact copy, not the padded base.
    store = make_store(device_bytes=0, host_bytes="unlimited")
    base = torch.randn(4 * MiB)
    ref = base.untyped_storage()._weak_ref()
    view = base[:1000]
    h = store.put(view)
    del base, view
    gc.collect()
    assert torch.UntypedStorage._expired(ref), "the base storage outlived the view"
    assert store.get(h).numel() == 1000
    torch.UntypedStorage._free_weak_ref(ref)


# --------------------------------------------------------------------------- tiers and cascade


def test_cascade_keeps_newest_in_fastest_tier(make_store: MakeStore) -> None:
    store = make_store(device_bytes=2 * MiB, host_bytes=2 * MiB, prefetch_bytes=0)
    hs = [store.put(torch.full((MiB // 4,), float(i))) for i in range(6)]  # 1 MiB each
    wait_for(lambda: settled(store))
    tiers = [store.tier_of(h) for h in hs]
    assert tiers == [Tier.DISK, Tier.DISK, Tier.HOST, Tier.HOST, Tier.DEVICE, Tier.DEVICE]
    st = store.stats()
    assert (st.device.bytes, st.host.bytes) == (2 * MiB, 2 * MiB)
    assert st.disk.entries == 2 and st.disk.bytes >= 2 * MiB
    for i, h in enumerate(hs):
        assert store.get(h)[0].item() == float(i)
    audit(store)


def test_small_tensors_stay_put(make_store: MakeStore) -> None:
    store = make_store(device_bytes=0, host_bytes=0, min_bytes="64KiB")
    small, big = store.put(torch.ones(100)), store.put(torch.ones(MiB // 4))
    wait_for(lambda: store.tier_of(big) is Tier.DISK)
    assert store.tier_of(small) is Tier.DEVICE


def test_spilled_bytes_are_really_in_the_spill_directory(make_store: MakeStore) -> None:
    store = make_store(device_bytes=0, host_bytes=0)
    hs = [store.put(torch.randn(MiB // 4)) for _ in range(4)]
    wait_for(lambda: all(store.tier_of(h) is Tier.DISK for h in hs))
    (spill,) = store.spill_dirs
    on_disk = sum(p.stat().st_blocks * 512 for p in Path(spill).rglob("*") if p.is_file())
    assert on_disk >= 4 * MiB
    assert oct(Path(spill).stat().st_mode & 0o777) == "0o700"


def test_a_big_cpu_tensor_comes_back_at_its_place_in_a_page(make_store: MakeStore) -> None:
    # Note: [A tensor's lead]: written straight from the tensor's pages, read
    # straight into a pooled buffer spanning the same pages, handed back as a tensor whose
    # storage is exactly its bytes at the lead (Note: [What get returns]).
    # An older entry stays, and nothing is prefetched: no get ends a backward sweep, whose
    # end may unmap the free buffer before the second read (whether it does depended on
    # when the read task's last check ran).
    store = make_store(device_bytes=0, host_bytes=0, prefetch_bytes=0)
    older = store.put(torch.ones(4))
    t = _random((3 * MiB // 4 + 5,), torch.float32, seed=4)
    lead = t.data_ptr() % 4096
    h = store.put(t)
    wait_for(lambda: store.tier_of(h) is Tier.DISK)
    out = store.get(h)
    assert _same_bits(out, t)
    engine = internals(store).engine
    direct = engine is not None and all(engine.describe()["direct_io"].values())
    assert out.data_ptr() % 4096 == (lead if direct and lead % 64 == 0 else 0)
    out2 = out.clone()
    del out
    gc.collect()
    # The pooled buffer is reused for the next read of the same span, lead and all.
    reused = internals(store).read_pool.reused
    h2 = store.put(out2)
    wait_for(lambda: store.tier_of(h2) is Tier.DISK)
    assert _same_bits(store.get(h2), t)
    assert internals(store).read_pool.reused == reused + 1
    store.release(older)


@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"direct_io": "off"},
        {"disk_format": "zarr"},
        {"stripes": 2},
    ],
    ids=["direct", "buffered", "zarr", "two-dirs"],
)
def test_small_reads_come_from_the_pool_until_it_is_full_then_from_plain_memory(
    make_store: MakeStore, tmp_path: Path, settings: dict[str, object]
) -> None:
    """Packed blobs read back into pooled buffers (from 32 KiB) or plain allocations, held
    while later reads land: every tensor keeps its own bits, in both rounds."""
    from tierstore.core._transfers import POOLED_READ_BYTES

    config = dict(settings)
    if config.pop("stripes", None):
        config["disk_dir"] = [str(tmp_path / "a"), str(tmp_path / "b")]
        for d in config["disk_dir"]:
            Path(d).mkdir()
    store = make_store(device_bytes=0, host_bytes=0, **config)
    pool = internals(store).read_pool
    pool.max_buffers = 3
    shapes = [(16 * 1024 // 4 + 1,), (64 * 1024 // 4,), (48 * 1024 // 4 + 3,), (100_001,)] * 3
    tensors = [_random(s, torch.float32, seed=i) for i, s in enumerate(shapes)]
    pooled = sum(t.nbytes >= POOLED_READ_BYTES for t in tensors)
    assert 3 < pooled < len(tensors)  # some pooled, some past the cap, some too small

    def on_disk(handles: list[tierstore.TensorHandle]) -> None:
        wait_for(lambda: all(store.tier_of(h) is Tier.DISK for h in handles))

    for _ in range(2):
        handles = [store.put(t) for t in tensors]
        on_disk(handles)
        back = [store.get(h) for h in reversed(handles)]
        for b, t in zip(back, reversed(tensors), strict=True):
            assert _same_bits(b, t)
        for h in handles:
            store.release(h)
        assert pool.buffers == 3
        del back
    assert pool.created == 3 and pool.reused == 3


def test_read_buffers_are_reused_while_held_rounds_repeat_and_handed_back_after_a_sweep(
    make_store: MakeStore,
) -> None:
    """Note: [A finished sweep hands its buffers back]. Tensors of 3 MiB: several chunks of
    the raw engine's reads."""
    store = make_store(device_bytes=0, host_bytes=0, prefetch_bytes=64 * MiB, io_chunk_bytes=MiB)
    pool = internals(store).read_pool
    tensors = [_random((3 * MiB // 4,), torch.float32, seed=i) for i in range(6)]

    def on_disk(handles: list[tierstore.TensorHandle]) -> None:
        wait_for(lambda: all(store.tier_of(h) is Tier.DISK for h in handles))

    for _ in range(2):  # all read back and held, as tierstore-bench's rounds do
        handles = [store.put(t) for t in tensors]
        on_disk(handles)
        back = [store.get(h) for h in reversed(handles)]
        assert all(_same_bits(b, t) for b, t in zip(back, reversed(tensors), strict=True))
        for h in handles:
            store.release(h)
        del back
    assert pool.created == len(tensors) and pool.reused == len(tensors)
    # A backward sweep: each tensor is dropped once used, its entry released after it.
    handles = [store.put(t) for t in tensors]
    on_disk(handles)
    for h, t in zip(reversed(handles), reversed(tensors), strict=True):
        assert _same_bits(store.get(h), t)
        store.release(h)
    # The last get's buffer can still be held a moment by the loop thread that read it; it is
    # unmapped when let go, not kept until the next sweep.
    wait_for(lambda: pool.mapped_bytes == 0, timeout=5, what="every buffer unmapped")


def _all_on_disk(store: TieredStore, handles: list[tierstore.TensorHandle]) -> bool:
    return all(store.tier_of(h) is Tier.DISK for h in handles)


def test_held_rounds_of_tensors_as_big_as_the_window_reuse_their_buffers(
    make_store: MakeStore,
) -> None:
    """Note: [The last read's buffer]: the re-check of a sweep's end after a read ran after
    the first get of a round too, when the window (full with the answer not yet consumed)
    had left the other reads planned but not started: it unmapped the last round's free
    buffers, and every round mapped and faulted in new ones (256 MiB tensors read at
    0.15-0.20 CPU-s/GB instead of 0.07). 3 MiB tensors, a 4 MiB window."""
    store = make_store(device_bytes=0, host_bytes=0, prefetch_bytes=3 * MiB, io_chunk_bytes=MiB)
    pool = internals(store).read_pool
    tensors = [_random((3 * MiB // 4,), torch.float32, seed=40 + i) for i in range(4)]
    for _ in range(3):  # all read back and held, as tierstore-bench's rounds do
        handles = [store.put(t) for t in tensors]
        wait_for(functools.partial(_all_on_disk, store, handles))
        wait_for(lambda: settled(store))
        back = [store.get(h) for h in reversed(handles)]
        assert all(_same_bits(b, t) for b, t in zip(back, reversed(tensors), strict=True))
        for h in handles:
            store.release(h)
        del back
        wait_for(lambda: settled(store))
    assert (pool.created, pool.reused) == (len(tensors), 2 * len(tensors))


def test_without_prefetching_a_finished_sweep_still_hands_its_buffers_back(
    make_store: MakeStore,
) -> None:
    """Note: [A finished sweep hands its buffers back], with prefetch_bytes=0: no walk runs, so
    the sweep's end is the get of the oldest entry."""
    store = make_store(device_bytes=0, host_bytes=0, prefetch_bytes=0)
    pool = internals(store).read_pool
    tensors = [_random((MiB // 2,), torch.float32, seed=20 + i) for i in range(8)]
    handles = [store.put(t) for t in tensors]
    wait_for(lambda: all(store.tier_of(h) is Tier.DISK for h in handles) and settled(store))
    # The seven newest come back and are held, so each read maps a buffer of its own; they
    # are dropped before the oldest's get, which ends the sweep.
    held = [store.get(h) for h in reversed(handles[1:])]
    assert all(_same_bits(a, t) for a, t in zip(held, reversed(tensors[1:]), strict=True))
    del held
    assert pool.mapped_bytes >= 7 * 2 * MiB  # free now, still mapped
    assert _same_bits(store.get(handles[0]), tensors[0])
    assert store.stats().bytes_from_disk == 8 * 2 * MiB
    # The oldest's own buffer may still be busy when the sweep ends (the getter holds it
    # while it consumes); the seven free ones are gone. Without the sweep's end the pool
    # keeps them all (its keep_bytes is 64 MiB).
    assert pool.mapped_bytes <= 2 * MiB + 4096, pool.mapped_bytes


def _linger_after_answering_gets(
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[threading.Event, threading.Event]:
    """``(linger, let_go)``: once ``linger`` is set, the thread that answers a get with a
    tensor keeps holding it (in its frame) until ``let_go`` is set, at most 5 s."""
    linger, let_go = threading.Event(), threading.Event()
    answer = cf.Future.set_result

    def answer_and_linger(fut: cf.Future[object], result: object) -> None:
        answer(fut, result)
        if linger.is_set() and isinstance(result, torch.Tensor):
            let_go.wait(5)  # this frame still holds the tensor the get returned

    monkeypatch.setattr(cf.Future, "set_result", answer_and_linger)
    return linger, let_go


@pytest.mark.parametrize("disk_format", ["raw", "zarr"])
def test_the_last_reads_buffer_goes_though_its_task_held_it_past_the_sweeps_end(
    make_store: MakeStore, monkeypatch: pytest.MonkeyPatch, disk_format: str
) -> None:
    """Note: [The last read's buffer]: the loop thread that read the oldest tensor is made to
    hold it after answering the get, until the getter has dropped it and released its entry
    (the sweep's end); the buffer is unmapped all the same, not kept until the next sweep."""
    store = make_store(device_bytes=0, host_bytes=0, prefetch_bytes=0, disk_format=disk_format)
    pool = internals(store).read_pool
    tensors = [_random((3 * MiB // 4,), torch.float32, seed=30 + i) for i in range(2)]
    handles = [store.put(t) for t in tensors]
    wait_for(lambda: all(store.tier_of(h) is Tier.DISK for h in handles) and settled(store))
    # An I/O thread that dwells between completing its read and dropping its work item
    # held the buffer past the sweep's end: Note: [A finished transfer holds no memory].
    run = cf_thread._WorkItem.run

    def run_then_dwell(self: cf_thread._WorkItem) -> None:  # type: ignore[type-arg]
        run(self)
        time.sleep(0.2)

    monkeypatch.setattr(cf_thread._WorkItem, "run", run_then_dwell)
    linger, released = _linger_after_answering_gets(monkeypatch)
    assert _same_bits(store.get(handles[1]), tensors[1])
    store.release(handles[1])
    linger.set()
    assert _same_bits(store.get(handles[0]), tensors[0])
    store.release(handles[0])  # the sweep's end, the buffer still busy in the loop thread
    released.set()
    wait_for(lambda: pool.mapped_bytes == 0, timeout=5, what="the last buffer unmapped")


def test_tensors_bigger_than_the_prefetch_window_are_prefetched_one_at_a_time(
    make_store: MakeStore,
) -> None:
    """Note: [A tensor bigger than the window]: 3 MiB tensors (several chunks) against a
    1 MiB window are read ahead one at a time, and come back bit for bit."""
    store = make_store(device_bytes=0, host_bytes=0, prefetch_bytes=MiB, io_chunk_bytes=MiB)
    tensors = [_random((3 * MiB // 4,), torch.float32, seed=10 + i) for i in range(4)]
    handles = [store.put(t) for t in tensors]
    wait_for(lambda: all(store.tier_of(h) is Tier.DISK for h in handles))
    hits = store.stats().prefetch_hits
    for h, t in zip(reversed(handles), reversed(tensors), strict=True):
        assert _same_bits(store.get(h), t)
        ahead = [s for s in internals(store).states() if s in ("FETCHING", "FETCHED")]
        assert len(ahead) <= 1, ahead
        # Let the read ahead finish, as backward's compute between two gets would.
        wait_for(lambda: "FETCHING" not in internals(store).states())
        store.release(h)
    assert store.stats().prefetch_hits - hits == len(tensors) - 1  # all but the first get


@pytest.mark.parametrize(
    "settings",
    [
        {"device_bytes": "unlimited"},
        {"host_bytes": "unlimited"},
        {"host_bytes": 0},
        {"host_bytes": 0, "direct_io": "off"},
        {"host_bytes": 0, "disk_format": "zarr"},
    ],
    ids=["device", "host", "disk-direct", "disk-buffered", "disk-zarr"],
)
def test_get_returns_a_tensor_that_owns_exactly_its_bytes(
    make_store: MakeStore, settings: dict[str, object]
) -> None:
    """Note: [What get returns]: offset 0, a storage of exactly its bytes, on every path."""
    store = make_store(**{"device_bytes": 0, "io_chunk_bytes": MiB, **settings})
    # Small (packed), just over 1 MiB, several chunks; plain, 64 bytes into a page, a view.
    base = _random((3 * MiB + 4096,), torch.uint8, seed=9)
    cases = [
        _random((16 << 10,), torch.float32, seed=10),
        _random((MiB // 4 + 16,), torch.float32, seed=11),
        _random((5 * MiB // 2,), torch.bfloat16, seed=12),
        base[64 : 64 + 3 * MiB].view(torch.int32),
        base[128:].view(torch.int16)[: MiB + 7].reshape(MiB + 7, 1).t(),
    ]
    handles = [store.put(t) for t in cases]
    wait_for(lambda: settled(store))
    for t, h in zip(cases, handles, strict=True):
        out = store.get(h)
        assert _same_bits(out, t)
        assert out.is_contiguous() and out.storage_offset() == 0
        assert out.untyped_storage().nbytes() == t.numel() * t.element_size()


def test_a_contiguous_tensor_with_odd_strides_on_size_one_dims_spills(
    make_store: MakeStore,
) -> None:
    # Found by the round-trip property test: reshape(-1) kept the stride 2 of a size-1
    # dimension, view(uint8) refused it, and the spill task died with the entry in flight.
    store = make_store(device_bytes=0, host_bytes=0)
    t = torch.tensor([7], dtype=torch.int16)[0:1:2].unflatten(0, (1, -1)).t()
    assert t.is_contiguous() and t.stride() == (2, 2)
    h = store.put(t)
    wait_for(lambda: settled(store))
    assert store.tier_of(h) is Tier.DISK
    assert _same_bits(store.get(h), t)


def test_a_puts_own_min_bytes_wins_over_the_stores(make_store: MakeStore) -> None:
    store = make_store(device_bytes=0, host_bytes=0, min_bytes="1MiB")
    small = torch.randn(1 << 14)  # 64 KiB
    kept = store.put(small)
    moved = store.put(small.clone(), min_bytes=1024)
    big = torch.randn(1 << 19)  # 2 MiB: over the store's, but kept below this put's
    held = store.put(big, min_bytes=4 << 20)
    wait_for(lambda: settled(store))
    assert store.tier_of(kept) is Tier.DEVICE  # where it was put, never moved
    assert store.tier_of(moved) is Tier.DISK
    assert store.tier_of(held) is Tier.DEVICE
    assert _same_bits(store.get(moved), small) and _same_bits(store.get(held), big)
    for bad in (-1, True, 1.5, "1KiB"):
        with pytest.raises(ValueError, match="min_bytes"):
            store.put(small, min_bytes=bad)  # type: ignore[arg-type]


def test_tier_full_raises_and_drops_nothing(make_store: MakeStore) -> None:
    store = make_store(device_bytes=0, host_bytes=2 * MiB, disk_bytes=0)
    a = store.put(torch.ones(MiB // 4))
    b = store.put(torch.ones(MiB // 4))
    # Sizes in human units: what each tier holds of what it may.
    full = r"no tier has room for a 1\.0 MiB float32 tensor: .*host 2\.0 MiB of 2\.0 MiB"
    with pytest.raises(TierFullError, match=full):
        store.put(torch.ones(MiB // 4))
    assert store.stats().live_entries == 2
    assert store.get(a).sum().item() == store.get(b).sum().item() == MiB // 4


def test_unsupported_tensors_are_refused_clearly(make_store: MakeStore) -> None:
    store = make_store()
    with pytest.raises(UnsupportedTensorError, match="sparse"):
        store.put(torch.eye(3).to_sparse())
    with pytest.raises(UnsupportedTensorError, match="meta"):
        store.put(torch.empty(3, device="meta"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch deprecates building quantized tensors
        quantized = torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.quint8)
    with pytest.raises(UnsupportedTensorError, match="quantized"):
        store.put(quantized)
    with pytest.raises(UnsupportedTensorError, match=r"torch\.Tensor"):
        store.put([1, 2, 3])  # type: ignore[arg-type]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch calls nested tensors a prototype
        nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    with pytest.raises(UnsupportedTensorError, match="nested"):
        store.put(nested)
    assert store.stats().live_entries == 0


def test_parameters_are_stored_as_plain_data(make_store: MakeStore) -> None:
    store = make_store(device_bytes=0, host_bytes=0)
    p = torch.nn.Parameter(torch.randn(1000))
    h = store.put(p)
    out = store.get(h)
    assert type(out) is torch.Tensor and not out.requires_grad
    assert torch.equal(out, p.detach())


# --------------------------------------------------------------------------- prefetch


def test_backward_order_sweep_mostly_hits(make_store: MakeStore) -> None:
    store = make_store(device_bytes=0, host_bytes=MiB, prefetch_bytes=8 * MiB)
    ts = [torch.randn(MiB // 4) for _ in range(40)]
    hs = [store.put(t) for t in ts]
    wait_for(lambda: settled(store))
    for h, t in zip(reversed(hs), reversed(ts), strict=False):
        assert torch.equal(store.get(h), t)
    st = store.stats()
    assert st.prefetch_hits + st.prefetch_misses == 40
    assert st.prefetch_misses <= 2, st
    assert st.bytes_from_disk >= 38 * MiB


def test_a_backward_sweep_walks_each_entry_about_once(make_store: MakeStore) -> None:
    # Note: [Resumable prefetch walk]: walking from the cursor on every get was quadratic.
    n = 1500
    store = make_store(device_bytes=0, host_bytes=0, prefetch_bytes="unlimited")
    hs = [store.put(torch.full((256,), float(i))) for i in range(n)]
    wait_for(lambda: settled(store))
    for i in reversed(range(n)):
        assert store.get(hs[i])[0].item() == float(i)
    assert internals(store).prefetch_walk_steps <= 3 * n, internals(store).prefetch_walk_steps
    assert store.stats().prefetch_misses <= 1
    # A second backward pass (retain_graph) walks again from the top, and still hits.
    for h in reversed(hs):
        store.get(h)
    assert internals(store).prefetch_walk_steps <= 6 * n


def test_prefetch_window_is_respected(make_store: MakeStore) -> None:
    store = make_store(device_bytes=0, host_bytes=0, prefetch_bytes=3 * MiB)
    hs = [store.put(torch.randn(MiB // 4)) for _ in range(10)]
    wait_for(lambda: all(store.tier_of(h) is Tier.DISK for h in hs))
    store.prefetch(hs)
    wait_for(lambda: store.state_of(hs[-1]) is TensorState.FETCHED)
    states = [store.state_of(h) for h in hs]
    fetched = [i for i, s in enumerate(states) if s in (TensorState.FETCHED, TensorState.FETCHING)]
    assert fetched == [7, 8, 9], states  # newest first, 3 MiB of window
    audit(store)
    # Consuming one frees room for the next older one.
    store.get(hs[9])
    wait_for(lambda: store.state_of(hs[6]) in (TensorState.FETCHED, TensorState.FETCHING))
    assert store.state_of(hs[9]) is TensorState.DISK


def test_an_entry_got_in_this_sweep_is_not_fetched_again(make_store: MakeStore) -> None:
    """Note: [Got once a sweep]: backward unpacks a little out of order; a get above the last
    one restarted the walk there, and it fetched entries already got, back on disk, again."""
    store = make_store(device_bytes=0, host_bytes=0, prefetch_bytes=2 * MiB)
    hs = [store.put(torch.randn(MiB // 4)) for _ in range(6)]
    wait_for(lambda: all(store.tier_of(h) is Tier.DISK for h in hs))
    for i in (5, 3, 4, 2, 1, 0):  # 3 before 4: the cursor moves up, past 3
        store.get(hs[i])
        wait_for(lambda: TensorState.FETCHING not in map(store.state_of, hs))
    stats = store.stats()
    assert stats.gets == 6 and stats.bytes_from_disk == 6 * MiB, stats
    # A second sweep (a retain_graph backward) brings them back again.
    store.get(hs[5])
    wait_for(lambda: store.state_of(hs[4]) in (TensorState.FETCHED, TensorState.FETCHING))
    audit(store)


def test_a_second_sweep_through_entries_already_got_prefetches_them_again(
    make_store: MakeStore,
) -> None:
    """Note: [Got once a sweep]: a retained trunk read back once, then a head saved after it
    and a backward through both (a second loss on a ``retain_graph`` graph). The walk had
    passed the trunk as got; resumed below it when the sweep changed, it fetched none of it
    and every trunk get read for itself (11 misses of 15)."""
    store = make_store(device_bytes=0, host_bytes=0, prefetch_bytes=4 * MiB)

    def put(n: int) -> list[tierstore.TensorHandle]:
        hs = [store.put(torch.randn(MiB // 4)) for _ in range(n)]
        wait_for(lambda: all(store.tier_of(h) is Tier.DISK for h in hs))
        return hs

    def sweep(hs: list[tierstore.TensorHandle]) -> None:
        for h in reversed(hs):
            store.get(h)
            wait_for(lambda: TensorState.FETCHING not in map(store.state_of, hs))

    trunk = put(10)
    sweep(trunk)
    head = put(5)
    before = store.stats()
    sweep(trunk + head)
    after = store.stats()
    # The head's first get, and the trunk's first (the walk from the head passed it as got).
    assert after.prefetch_misses - before.prefetch_misses == 2
    assert after.bytes_from_disk - before.bytes_from_disk == 15 * MiB
    audit(store)


def test_held_back_entries_are_not_fetched_ahead_and_a_get_still_returns_them(
    make_store: MakeStore,
) -> None:
    """Note: [Held back]: the caller has some tensors at hand (a checkpoint's live inputs);
    the walk brought every older entry back, and those copies sat in the window unread."""
    store = make_store(device_bytes=0, host_bytes=0, prefetch_bytes=64 * MiB)
    # Packed, alone, and over two chunks of the raw engine.
    sizes = [64 * 1024, 2 * MiB, 9 * MiB, 64 * 1024, 2 * MiB, 9 * MiB]
    ts = [torch.randint(0, 255, (n,), dtype=torch.uint8) for n in sizes]
    hs = [store.put(t) for t in ts]
    wait_for(lambda: all(store.tier_of(h) is Tier.DISK for h in hs))
    held = {0, 2, 4}
    store.hold_back([hs[i] for i in held])
    for i in reversed(range(len(hs))):
        if i not in held:
            assert torch.equal(store.get(hs[i]), ts[i])
        wait_for(lambda: TensorState.FETCHING not in map(store.state_of, hs))
        assert all(store.state_of(hs[j]) is TensorState.DISK for j in held)
    stats = store.stats()
    assert stats.bytes_from_disk == sum(sizes[i] for i in range(len(hs)) if i not in held)
    assert internals(store).window_bytes == 0
    # A get still returns them, read on demand.
    for i in sorted(held, reverse=True):
        assert torch.equal(store.get(hs[i]), ts[i])
    assert store.stats().bytes_from_disk == sum(sizes)
    # Got, they were wanted after all: the next sweep brings them back ahead again.
    store.get(hs[5])
    wait_for(lambda: store.state_of(hs[4]) in (TensorState.FETCHED, TensorState.FETCHING))
    audit(store)


def test_holding_back_drops_a_copy_brought_back_and_one_still_being_read(
    make_store: MakeStore,
) -> None:
    """Note: [Held back]: a copy already fetched is dropped at once, one whose read runs is
    dropped when it lands; ``prefetch`` undoes the hold."""
    store = make_store(device_bytes=0, host_bytes=0, prefetch_bytes=64 * MiB)
    faulty = install_faults(store)
    ts = [torch.randn(3 * MiB // 4) for _ in range(2)]  # 3 MiB each
    hs = [store.put(t) for t in ts]
    wait_for(lambda: all(store.tier_of(h) is Tier.DISK for h in hs))
    store.prefetch(hs[:1])
    wait_for(lambda: store.state_of(hs[0]) is TensorState.FETCHED)
    faulty.read_delay = 0.3
    store.prefetch(hs[1:])
    assert store.state_of(hs[1]) is TensorState.FETCHING
    store.hold_back(hs)
    assert store.state_of(hs[0]) is TensorState.DISK
    wait_for(lambda: store.state_of(hs[1]) is not TensorState.FETCHING)
    assert store.state_of(hs[1]) is TensorState.DISK
    assert internals(store).window_bytes == 0
    faulty.read_delay = 0
    store.prefetch(hs[:1])  # asked for again: the hold is off
    wait_for(lambda: store.state_of(hs[0]) is TensorState.FETCHED)
    for h, t in zip(hs, ts, strict=True):
        assert torch.equal(store.get(h), t)
    audit(store)


class PausedReadEngine(FaultyEngine, register=False):
    """Each read sets ``reading`` and waits for ``go``: events of the loop of the
    ``AsyncTieredStore`` it is installed in."""

    name = "paused-read"

    def __init__(self, inner: DiskEngine) -> None:
        super().__init__(inner)
        self.reading = asyncio.Event()
        self.go = asyncio.Event()

    async def read(self, key: int, out: torch.Tensor) -> None:
        self.reading.set()
        await self.go.wait()
        await super().read(key, out)


async def test_holding_back_an_entry_a_get_waits_on_leaves_its_copy_to_the_get(
    disk_dir: Path,
) -> None:
    """Note: [Held back]: a copy brought back for a get that waits on it is not dropped. Held
    back between its read's end and the getter taking it, the copy was dropped from the
    store under the getter, and a second get of the tensor (another node that saved it)
    read it from disk again."""
    async with tierstore.AsyncTieredStore(
        disk_dir=disk_dir, device_bytes=0, host_bytes=0, prefetch_bytes=0, min_bytes=0
    ) as store:
        paused = install_faults(store, PausedReadEngine)
        t = torch.randn(MiB // 4)
        h = await store.put(t)
        while (await store.stats()).inflight_bytes:
            await asyncio.sleep(0.005)
        assert await store.tier_of(h) is Tier.DISK
        first = asyncio.create_task(store.get(h))
        await paused.reading.wait()

        async def hold_back_then_get() -> torch.Tensor:
            await store.hold_back([h])
            return await store.get(h)

        # Answering the waiting get runs this on the store's loop; the task it makes runs
        # before the getter wakes.
        loop = asyncio.get_running_loop()
        second: list[asyncio.Task[torch.Tensor]] = []
        internals(store).entry(h).fetch_future.add_done_callback(
            lambda _: second.append(loop.create_task(hold_back_then_get()))
        )
        paused.go.set()
        assert torch.equal(await first, t)
        assert len(second) == 1 and torch.equal(await second[0], t)
        assert paused.reads == 1
        assert (await store.stats()).bytes_from_disk == t.numel() * t.element_size()
        audit(store)


def test_hold_back_refuses_what_prefetch_refuses(make_store: MakeStore) -> None:
    store = make_store(device_bytes=0, host_bytes=0)
    h, gone = store.put(torch.randn(1024)), store.put(torch.randn(1024))
    store.release(gone)
    with pytest.raises(TensorReleasedError):
        store.hold_back([h, gone])
    with pytest.raises(TypeError):
        store.hold_back([object()])  # type: ignore[list-item]
    store.close()
    with pytest.raises(StoreClosedError):
        store.hold_back([h])


def test_an_entry_released_while_its_read_ends_keeps_no_bytes(
    make_store: MakeStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Released after its disk read finished but before the outcome is recorded: the copy
    read back is dropped with the entry (recorded as fetched, it stayed counted on its tier
    for good, and the fetch task died on an illegal transition)."""
    from tierstore.core import _transfers

    store = make_store(device_bytes=0, host_bytes=0, prefetch_bytes=8 * MiB)
    h = store.put(torch.randn(3 * MiB // 4))  # 3 MiB: read alone, over a chunk
    box = [h]
    wait_for(lambda: store.tier_of(box[0]) is Tier.DISK and settled(store))
    real = _transfers.Transfers._fetched

    def fetched_then_released(self: Any, *args: Any) -> Any:
        out = real(self, *args)
        internals(store)._core.release(box.pop())  # on the loop thread, before the record
        return out

    monkeypatch.setattr(_transfers.Transfers, "_fetched", fetched_then_released)
    store.prefetch([h])
    del h

    def empty() -> bool:
        st = store.stats()
        return st.live_entries == 0 and st.device.bytes == st.host.bytes == st.disk.bytes == 0

    wait_for(empty, timeout=5, what="every tier empty after the release")
    audit(store)


def test_a_sweep_with_repeated_gets_keeps_the_walk_linear(make_store: MakeStore) -> None:
    """Note: [Got once a sweep]: in a ``retain_graph`` backward a storage saved by several
    nodes is got once per node, and each such get begins a sweep. Restarting the walk at
    each rescanned the window: 1.4 million entries looked at for 8000 gets."""
    store = make_store(device_bytes=0, host_bytes=0, prefetch_bytes=8 * MiB)
    hs = [store.put(torch.randn(1024)) for _ in range(4000)]  # 4 KiB each
    wait_for(lambda: all(store.tier_of(h) is Tier.DISK for h in hs), timeout=60)
    for h in reversed(hs):
        store.get(h)
    before = internals(store).prefetch_walk_steps
    for i, h in enumerate(reversed(hs)):
        store.get(h)
        if i % 10 == 5:
            store.get(h)  # its second node
    assert internals(store).prefetch_walk_steps - before <= 2 * len(hs)


# --------------------------------------------------------------------------- save semaphore


class GatedEngine(FaultyEngine):
    """Writes wait for a gate, and the peak of bytes in flight is recorded."""

    name = "gated"

    def __init__(self, inner: DiskEngine) -> None:
        super().__init__(inner)
        self.gate = threading.Event()
        self.inflight = 0
        self.peak = 0
        self.lock = threading.Lock()

    async def write(self, key: int, src: torch.Tensor, **kwargs: Any) -> None:
        with self.lock:
            self.inflight += src.numel()
            self.peak = max(self.peak, self.inflight)
        try:
            while not self.gate.is_set():
                await asyncio.sleep(0.002)
            await self.inner.write(key, src, **kwargs)
        finally:
            with self.lock:
                self.inflight -= src.numel()


def test_put_waits_when_the_save_semaphore_is_full(make_store: MakeStore) -> None:
    store = make_store(device_bytes=0, host_bytes=0, max_inflight_bytes=2 * MiB)
    engine = install_faults(store, GatedEngine)
    done = threading.Event()
    handles: list[Any] = []

    def producer() -> None:
        for _ in range(6):
            handles.append(store.put(torch.randn(MiB // 4)))
        done.set()

    thread = threading.Thread(target=producer)
    thread.start()
    wait_for(lambda: engine.inflight == 2 * MiB)
    time.sleep(0.1)
    assert not done.is_set(), "put did not wait although 2 MiB were in flight"
    assert len(handles) <= 3
    assert store.stats().inflight_bytes <= 2 * MiB
    engine.gate.set()
    thread.join(10)
    assert done.is_set()
    assert engine.peak <= 2 * MiB
    wait_for(lambda: settled(store))
    assert all(store.tier_of(h) is Tier.DISK for h in handles)
    assert store.stats().put_wait_seconds > 0.05


# --------------------------------------------------------------------------- lifetime


def test_entry_lives_exactly_as_long_as_its_handle(make_store: MakeStore) -> None:
    store = make_store(device_bytes=0, host_bytes=0)
    h = store.put(torch.randn(MiB // 4))
    wait_for(lambda: store.stats().disk.entries == 1 and settled(store))
    assert store.tier_of(h) is Tier.DISK
    engine = internals(store).engine
    assert engine is not None
    free = engine.reusable_bytes()
    assert store.stats().live_entries == 1
    del h
    gc.collect()
    st = store.stats()
    assert st.live_entries == 0 and st.disk.bytes == 0 and st.releases == 1
    audit(store)
    # The blob's spill space goes back to the engine for the next spills to reuse.
    wait_for(lambda: engine.reusable_bytes() >= free + MiB, what="the blob's space freed")


def test_store_keeps_no_strong_reference_to_handles(make_store: MakeStore) -> None:
    import weakref

    store = make_store()
    h = store.put(torch.ones(10))
    ref = weakref.ref(h)
    del h
    gc.collect()
    assert ref() is None


def test_explicit_release_then_use_is_a_clear_error(make_store: MakeStore) -> None:
    store = make_store(device_bytes=0, host_bytes=0)
    h = store.put(torch.randn(1000))
    store.release(h)
    store.release(h)  # idempotent
    assert store.state_of(h) is TensorState.RELEASED
    with pytest.raises(TensorReleasedError, match="was released"):
        store.get(h)
    assert store.stats().live_entries == 0


def test_handles_of_another_store_are_rejected(make_store: MakeStore) -> None:
    a, b = make_store(), make_store()
    h = a.put(torch.ones(3))
    hb = b.put(torch.zeros(3))
    assert h.key == hb.key
    with pytest.raises(TensorReleasedError, match="not in this store"):
        b.get(h)
    assert torch.equal(b.get(hb), torch.zeros(3))
    a.release(h)
    with pytest.raises(TensorReleasedError, match="not in this store"):
        b.release(h)  # released in its own store; still not this store's (was silent)


def test_a_release_racing_close_does_nothing(make_store: MakeStore) -> None:
    """A release after close does nothing; one whose store another thread closed between its
    test of ``closed`` and its call into the store raised StoreClosedError. The close is made
    to land in that window here."""
    store = make_store(device_bytes=0, host_bytes=MiB)
    h = store.put(torch.randn(1024))
    live = store._live

    def closed_meanwhile() -> Any:
        store.close()  # another thread's close, between the test and the call
        return live()

    store._live = closed_meanwhile  # type: ignore[method-assign]
    store.release(h)  # returns: close released everything
    store.release(h)  # and after close, as ever


def test_release_during_a_spill_frees_everything(make_store: MakeStore) -> None:
    store = make_store(device_bytes=0, host_bytes=0)
    gated = install_faults(store, GatedEngine)
    t = torch.randn(MiB // 4)
    h = store.put(t)
    assert store.state_of(h) is TensorState.MOVING_TO_DISK
    assert torch.equal(store.get(h), t)  # the source is still readable in flight
    store.release(h)
    gated.gate.set()
    wait_for(lambda: settled(store))
    st = store.stats()
    assert (st.host.bytes, st.disk.bytes, st.live_entries) == (0, 0, 0)
    audit(store)


def test_close_waits_for_copies_from_pinned_memory(
    make_store: MakeStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pinned pieces go back to torch's cache with the pool at close: copies from them that
    may still run on a device are waited for first."""
    store = make_store()
    pool = internals(store).pinned_pool
    waited: list[bool] = []
    monkeypatch.setattr(pool, "synchronize", lambda: waited.append(True))
    store.close()
    assert waited == [True]


def test_close_removes_spill_directory_and_refuses_calls(
    make_store: MakeStore, caplog: Any
) -> None:
    store = make_store(device_bytes=0, host_bytes=0)
    hs = [store.put(torch.randn(MiB // 4)) for _ in range(3)]
    (spill,) = store.spill_dirs
    assert Path(spill).is_dir()
    with caplog.at_level(logging.INFO, logger="tierstore"):
        store.close()
    assert not Path(spill).exists()
    assert any("3 tensors" in r.getMessage() for r in caplog.records)
    with pytest.raises(StoreClosedError):
        store.get(hs[0])
    with pytest.raises(StoreClosedError):
        store.put(torch.ones(1))
    # The usual `with TieredStore() as s: ...` then `print(s.stats())`: the close's figures.
    assert store.stats().puts == 3 and store.stats().bytes_to_disk > 0
    store.release(hs[0])  # close released everything: nothing to do
    store.close()
    # Handles that outlive the store die quietly: an error in their finalizer would be an
    # unraisable exception, which pytest turns into a failure here.
    del hs
    gc.collect()


def test_calls_from_the_loop_thread_are_refused(make_store: MakeStore) -> None:
    store = make_store()
    h = store.put(torch.ones(4))
    loop = internals(store).loop

    async def inside() -> None:
        store.get(h)

    fut = asyncio.run_coroutine_threadsafe(inside(), loop)
    with pytest.raises(WrongThreadError, match="its own event-loop thread"):
        fut.result(5)


def test_many_threads_share_one_store(make_store: MakeStore) -> None:
    store = make_store(device_bytes=0, host_bytes=2 * MiB)
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        try:
            for i in range(15):
                t = torch.full((MiB // 16,), float(seed * 100 + i))
                h = store.put(t)
                assert torch.equal(store.get(h), t)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert errors == []
    gc.collect()
    wait_for(lambda: settled(store))
    audit(store)
    assert store.stats().live_entries == 0


def test_default_store_is_built_from_the_environment(monkeypatch: Any, disk_dir: Path) -> None:
    monkeypatch.setenv("TIERSTORE_DISK_DIR", str(disk_dir))
    monkeypatch.setenv("TIERSTORE_HOST_BYTES", "3MiB")
    store = tierstore.default_store()
    try:
        assert store is tierstore.default_store()
        assert store.stats().host.capacity == 3 * MiB
    finally:
        store.close()
    again = tierstore.default_store()
    assert again is not store
    again.close()


# --------------------------------------------------------------------------- asyncio API


async def test_async_store_round_trip(disk_dir: Path) -> None:
    async with tierstore.AsyncTieredStore(
        disk_dir=disk_dir, device_bytes=0, host_bytes=MiB, min_bytes=0
    ) as store:
        ts = [torch.randn(MiB // 4) for _ in range(6)]
        hs = [await store.put(t) for t in ts]
        while (await store.stats()).inflight_bytes:
            await asyncio.sleep(0.005)
        assert await store.tier_of(hs[0]) is Tier.DISK
        assert await store.state_of(hs[0]) is TensorState.DISK
        await store.prefetch(hs[:2])
        for h, t in zip(reversed(hs), reversed(ts), strict=False):
            assert torch.equal(await store.get(h), t)
        await store.release(hs[0])
        assert await store.state_of(hs[0]) is TensorState.RELEASED
    assert list(disk_dir.iterdir()) == []
    with pytest.raises(StoreClosedError):
        await store.put(torch.ones(1))


async def test_async_store_many_concurrent_gets(disk_dir: Path) -> None:
    async with tierstore.AsyncTieredStore(
        disk_dir=disk_dir, device_bytes=0, host_bytes=0, min_bytes=0, prefetch_bytes=0
    ) as store:
        ts = [torch.randn(10_000) for _ in range(20)]
        hs = [await store.put(t) for t in ts]
        outs = await asyncio.gather(*(store.get(h) for h in hs), *(store.get(h) for h in hs))
        for i, t in enumerate(ts):
            assert torch.equal(outs[i], t) and torch.equal(outs[i + 20], t)


def test_async_store_refuses_another_loop(disk_dir: Path) -> None:
    store = tierstore.AsyncTieredStore(disk_dir=disk_dir, min_bytes=0)

    async def use() -> None:
        await store.put(torch.ones(1))

    asyncio.run(use())
    with pytest.raises(WrongThreadError, match="event loop it was opened on"):
        asyncio.run(use())
    store._close_at_exit()
    assert list(disk_dir.iterdir()) == []


async def test_a_closed_async_store_refuses_every_call(disk_dir: Path) -> None:
    async with tierstore.AsyncTieredStore(disk_dir=disk_dir, min_bytes=0) as store:
        h = await store.put(torch.ones(4))
    calls = {
        "put": lambda: store.put(torch.ones(1)),
        "get": lambda: store.get(h),
        "prefetch": lambda: store.prefetch([h]),
        "tier_of": lambda: store.tier_of(h),
        "state_of": lambda: store.state_of(h),
        "step_stats": store.step_stats,
        "end_step": store.end_step,
        "open": store.open,
    }
    refused = []
    for name, call in calls.items():
        try:
            await call()
        except StoreClosedError as e:
            if "is closed" in str(e):
                refused.append(name)
    # What closed released: a release does nothing; stats are those of the close.
    await store.release(h)
    final = await store.stats()
    assert final.puts == 1 and final is await store.stats()
    assert refused == list(calls)
    await store.close()  # idempotent


async def test_a_cancelled_close_goes_on_and_a_second_close_waits_for_it(disk_dir: Path) -> None:
    store = tierstore.AsyncTieredStore(
        disk_dir=disk_dir, device_bytes=0, host_bytes=0, min_bytes=0, max_inflight_bytes="64MiB"
    )
    await store.open()
    faulty = install_faults(store)
    faulty.write_delay = 0.3
    ts = [torch.randn(MiB // 4) for _ in range(4)]  # 1 MiB each: past a small pack
    hs = [await store.put(t) for t in ts]
    first = asyncio.ensure_future(store.close())
    await asyncio.sleep(0.05)  # close is waiting on the slow writes
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    assert store.closed and list(disk_dir.iterdir()) != []  # not finished yet
    await store.close()  # waits for the same close, which went on
    assert list(disk_dir.iterdir()) == []
    assert faulty.writes == len(hs)  # every write ran to its end, none was cut off


async def test_a_get_whose_entry_was_released_during_its_read_ends_when_close_cancels_it(
    disk_dir: Path,
) -> None:
    """Close cancels the read; the entry, released meanwhile, was no longer among the entries
    close fails the waiting gets of, and the get waited for ever."""
    store = tierstore.AsyncTieredStore(
        disk_dir=disk_dir, device_bytes=0, host_bytes=0, min_bytes=0, prefetch_bytes=0,
        close_timeout=0.2,
    )  # fmt: skip
    await store.open()
    faulty = install_faults(store)
    h = await store.put(torch.randn(MiB // 4))
    while (await store.stats()).inflight_bytes:
        await asyncio.sleep(0.005)
    faulty.read_delay = 30
    getter = asyncio.ensure_future(store.get(h))
    while await store.state_of(h) is not TensorState.FETCHING:
        await asyncio.sleep(0.005)
    await store.release(h)
    await store.close()
    done, _ = await asyncio.wait([getter], timeout=5)
    assert done, "the get still waits after close returned"
    with pytest.raises(StoreClosedError):
        getter.result()


def test_a_store_whose_loop_has_ended_is_closed_by_the_next_loop(disk_dir: Path) -> None:
    store = tierstore.AsyncTieredStore(disk_dir=disk_dir, device_bytes=0, host_bytes=0, min_bytes=0)

    async def train() -> None:
        await store.put(torch.randn(MiB // 4))
        while (await store.stats()).inflight_bytes:
            await asyncio.sleep(0.005)

    asyncio.run(train())
    assert list(disk_dir.iterdir()) != []
    asyncio.run(store.close())
    assert store.closed and list(disk_dir.iterdir()) == []
    assert store not in _registry._open


def test_a_close_cut_short_by_its_loop_ending_is_finished_at_exit(disk_dir: Path) -> None:
    async def main() -> tuple[tierstore.AsyncTieredStore, asyncio.Future[None]]:
        store = tierstore.AsyncTieredStore(
            disk_dir=disk_dir, device_bytes=0, host_bytes=0, min_bytes=0
        )
        await store.open()
        install_faults(store).write_delay = 0.5
        await store.put(torch.randn(MiB // 4))
        closer = asyncio.ensure_future(store.close())
        await asyncio.sleep(0.05)
        return store, closer  # asyncio.run cancels the close still waiting on the slow write

    store, closer = asyncio.run(main())
    assert closer.cancelled()
    assert store._closing is not None and store._closing.cancelled()
    assert store in _registry._open  # so the exit hook still removes its files
    store._close_at_exit()
    assert list(disk_dir.iterdir()) == []


def test_close_on_another_loop_is_refused_and_closes_nothing(disk_dir: Path) -> None:
    store = tierstore.AsyncTieredStore(disk_dir=disk_dir, min_bytes=0)
    loop = asyncio.new_event_loop()
    try:
        h = loop.run_until_complete(store.put(torch.arange(8.0)))
        with pytest.raises(WrongThreadError, match="close it there"):
            asyncio.run(store.close())
        assert not store.closed
        assert torch.equal(loop.run_until_complete(store.get(h)), torch.arange(8.0))
        loop.run_until_complete(store.close())
    finally:
        loop.close()
    assert store.closed and list(disk_dir.iterdir()) == []


def test_env_var_paths_are_checked(tmp_path: Path) -> None:
    with pytest.raises(tierstore.ConfigError, match="does not exist"):
        TieredStore(disk_dir=tmp_path / "missing")
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(tierstore.ConfigError, match="not a directory"):
        TieredStore(disk_dir=f)


def test_disk_bytes_never_above_free_space(
    make_store: MakeStore, disk_dir: Path, caplog: Any
) -> None:
    def free(path: Any) -> int:
        st = os.statvfs(path)
        return st.f_bavail * st.f_frsize

    before = free(disk_dir)
    with caplog.at_level(logging.WARNING, logger="tierstore"):
        store = make_store(disk_bytes="1000TiB")
    # Other test workers write and delete beside this one: the free space at the store's
    # start lies near what is free just before or after it, not exactly either.
    after = free(store.spill_dirs[0])
    assert store.stats().disk.capacity <= max(before, after) + (1 << 30)
    said = [r.getMessage() for r in caplog.records]
    capped = [m for m in said if "capped at the free space" in m]
    assert capped and "disk_bytes/TIERSTORE_DISK_BYTES=1000 TiB is more than the " in capped[0]
    assert " GiB free under " in capped[0] or " TiB free under " in capped[0], capped
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tierstore"):
        unlimited = make_store(disk_bytes="unlimited")  # what the default gives: no warning
    assert unlimited.stats().disk.capacity <= max(before, after) + (1 << 30)
    assert not [r for r in caplog.records if "capped" in r.getMessage()]


def test_zarr_format_round_trips_every_dtype_through_the_store(make_store: MakeStore) -> None:
    store = make_store(device_bytes=0, host_bytes=0, disk_format="zarr")
    tensors = [_random((4, 3), dtype, seed=i) for i, dtype in enumerate(_cpu_dtypes())]
    handles = [store.put(t) for t in tensors]
    wait_for(lambda: all(store.tier_of(h) is Tier.DISK for h in handles))
    for h, t in zip(handles, tensors, strict=True):
        assert _same_bits(store.get(h), t), t.dtype


class HeldReadEngine(GatedEngine):
    """Reads wait for ``read_gate``; the first ``failing`` of them then fail with EIO."""

    def __init__(self, inner: DiskEngine) -> None:
        super().__init__(inner)
        self.gate.set()
        self.read_gate = threading.Event()
        self.failing = 1
        self.reads = 0

    async def read(self, key: int, out: torch.Tensor) -> None:
        self.reads += 1
        while not self.read_gate.is_set():
            await asyncio.sleep(0.002)
        if self.failing:
            self.failing -= 1
            raise OSError(errno.EIO, "injected")
        await self.inner.read(key, out)


def test_a_get_waiting_on_a_failed_prefetch_reads_once_itself(make_store: MakeStore) -> None:
    # Note: [A failed prefetch is retried once]: the prefetch began before the disk recovered.
    store = make_store(device_bytes=0, host_bytes=0)
    held = install_faults(store, HeldReadEngine)
    t = torch.randn(MiB // 4)
    h = store.put(t)
    wait_for(lambda: store.tier_of(h) is Tier.DISK and settled(store))
    store.prefetch([h])
    assert store.state_of(h) is TensorState.FETCHING
    result: list[Any] = []
    getter = threading.Thread(target=lambda: result.append(store.get(h)))
    getter.start()
    wait_for(lambda: store.stats().prefetch_hits == 1)  # the get waits on the prefetch
    held.read_gate.set()  # the prefetch's read now fails; the disk is healthy after it
    getter.join(10)
    assert len(result) == 1 and torch.equal(result[0], t)
    assert held.reads == 2 and store.stats().read_errors == 1


def test_a_prefetch_makes_a_future_only_when_a_get_waits_on_it(make_store: MakeStore) -> None:
    store = make_store(device_bytes=0, host_bytes=0)
    held = install_faults(store, HeldReadEngine)
    held.failing = 0
    ts = [torch.randn(MiB // 4) for _ in range(2)]
    hs = [store.put(t) for t in ts]
    wait_for(lambda: all(store.tier_of(h) is Tier.DISK for h in hs) and settled(store))
    store.prefetch(hs)
    entries = [internals(store).entry(h) for h in hs]
    assert [e.state for e in entries] == [TensorState.FETCHING] * 2
    assert [e.fetch_future for e in entries] == [None, None]
    result: list[Any] = []
    getter = threading.Thread(target=lambda: result.append(store.get(hs[1])))
    getter.start()
    wait_for(lambda: entries[1].fetch_future is not None)  # the waiting get made one
    assert entries[0].fetch_future is None
    held.read_gate.set()
    getter.join(10)
    assert len(result) == 1 and torch.equal(result[0], ts[1])
    wait_for(lambda: store.state_of(hs[0]) is TensorState.FETCHED)
    assert torch.equal(store.get(hs[0]), ts[0])  # finished before anyone asked: no future
    assert held.reads == 2 and store.stats().prefetch_hits == 2


def test_a_get_that_fails_keeps_no_handle_alive(make_store: MakeStore) -> None:
    # Note: [A failed wait keeps no handle]: the failed future's error held the waiting frames,
    # which held the future and the handle, so the entry outlived the handle until a collection.
    store = make_store(device_bytes=0, host_bytes=0, prefetch_bytes=0)
    faulty = install_faults(store)
    h = store.put(torch.randn(1024))
    wait_for(lambda: settled(store))
    assert store.tier_of(h) is Tier.DISK
    faulty.fail_reads(errno.EIO, times=1)
    gc.disable()
    try:
        with pytest.raises(tierstore.SpillIOError):
            store.get(h)
        del h
        assert store.stats().live_entries == 0
    finally:
        gc.enable()


async def test_an_async_get_that_fails_keeps_no_handle_alive(disk_dir: Path) -> None:
    async with tierstore.AsyncTieredStore(
        disk_dir=disk_dir, device_bytes=0, host_bytes=0, prefetch_bytes=0, min_bytes=0
    ) as store:
        faulty = install_faults(store)
        h = await store.put(torch.randn(1024))
        while (await store.stats()).inflight_bytes:
            await asyncio.sleep(0.005)
        faulty.fail_reads(errno.EIO, times=1)
        gc.disable()
        try:
            with pytest.raises(tierstore.SpillIOError):
                await store.get(h)
            del h
            await asyncio.sleep(0)  # the futures' callbacks queued on the loop let go
            assert (await store.stats()).live_entries == 0
        finally:
            gc.enable()


def test_a_failed_entry_is_released_when_its_handle_goes(make_store: MakeStore) -> None:
    # Note: [A failed entry raises a copy]: raising the error the entry keeps tied the handle
    # to the entry for good (each get also lengthened its traceback).
    store = make_store(device_bytes="unlimited")
    t = torch.randn(1024)
    h = store.put(t)
    t.add_(1)
    for _ in range(3):
        with pytest.raises(tierstore.TensorModifiedError) as info:
            store.get(h)
    depth, tb = 0, info.value.__traceback__
    while tb is not None:
        depth, tb = depth + 1, tb.tb_next
    assert depth <= 5, "the traceback grows with every get"
    del info
    gc.disable()
    try:
        del h
        assert store.stats().live_entries == 0
    finally:
        gc.enable()


def test_a_get_whose_own_read_fails_raises(make_store: MakeStore) -> None:
    store = make_store(device_bytes=0, host_bytes=0, prefetch_bytes=0)
    held = install_faults(store, HeldReadEngine)
    h = store.put(torch.randn(MiB // 4))
    wait_for(lambda: store.tier_of(h) is Tier.DISK and settled(store))
    held.read_gate.set()
    with pytest.raises(tierstore.SpillIOError, match=f"tensor #{h.key}"):
        store.get(h)
    assert held.reads == 1


def test_a_read_buffer_that_cannot_be_allocated_fails_the_get_instead_of_hanging(
    make_store: MakeStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tierstore.tiers._readpool import ReadPool

    store = make_store(device_bytes=0, host_bytes=0, prefetch_bytes=0, timeout=20)
    t = torch.randn(MiB)  # a pooled read
    h = store.put(t)
    wait_for(lambda: store.tier_of(h) is Tier.DISK and settled(store))

    def no_memory(self: ReadPool, nbytes: int, **kwargs: int) -> None:
        raise MemoryError(f"cannot map {nbytes} bytes")

    monkeypatch.setattr(ReadPool, "take", no_memory)
    t0 = time.monotonic()
    with pytest.raises(tierstore.SpillIOError, match="cannot map"):
        store.get(h)
    assert time.monotonic() - t0 < 5  # it used to wait for the store's timeout
    monkeypatch.undo()
    assert store.tier_of(h) is Tier.DISK and _same_bits(store.get(h), t)  # nothing lost


def test_one_get_plans_a_step_of_prefetch_and_the_window_fills_behind_it(
    make_store: MakeStore,
) -> None:
    # Note: [Resumable prefetch walk]: planning a whole window of small fetches inside one get
    # held the lock long, and the first get of backward waited behind all of it.
    from tierstore.core._prefetch import STEP as _PREFETCH_STEP

    n = 3 * _PREFETCH_STEP + 10
    store = make_store(device_bytes=0, host_bytes=0, prefetch_bytes="unlimited")
    held = install_faults(store, HeldReadEngine)
    held.failing = 0
    ts = [torch.full((1024,), float(i)) for i in range(n)]  # 4 KiB each
    hs = [store.put(t) for t in ts]
    wait_for(lambda: all(store.tier_of(h) is Tier.DISK for h in hs), timeout=30)

    def fetching() -> int:
        busy = (TensorState.FETCHING, TensorState.FETCHED)
        return sum(store.state_of(h) in busy for h in hs)

    result: list[torch.Tensor] = []
    getter = threading.Thread(target=lambda: result.append(store.get(hs[-1])))
    getter.start()
    wait_for(lambda: fetching() > 0)
    time.sleep(0.05)  # reads are held: nothing more may start until one ends
    assert fetching() == 1 + _PREFETCH_STEP  # its own read and one step of the walk
    held.read_gate.set()
    getter.join(10)
    assert len(result) == 1 and torch.equal(result[0], ts[-1])
    # No other get comes, yet the walk goes on as fetches end, until the window holds them all.
    wait_for(lambda: fetching() == n - 1, timeout=30)
    for h, t in zip(reversed(hs[:-1]), reversed(ts[:-1]), strict=True):
        assert torch.equal(store.get(h), t)
    assert store.stats().prefetch_misses == 1


@pytest.mark.parametrize(
    "timeout", [float("inf"), -5, 0, float("nan"), "30", True, 2e9, 10**400], ids=repr
)
def test_a_bad_timeout_is_refused_at_construction(disk_dir: Path, timeout: object) -> None:
    """As every other knob: ConfigError naming it, before any directory is made."""
    with pytest.raises(tierstore.ConfigError) as info:
        TieredStore(disk_dir=disk_dir, timeout=timeout)  # type: ignore[arg-type]
    assert str(info.value).startswith(f"timeout={timeout!r}: ")
    with pytest.raises(tierstore.ConfigError, match="close_timeout="):
        tierstore.AsyncTieredStore(disk_dir=disk_dir, close_timeout=timeout)  # type: ignore[arg-type]
    assert list(disk_dir.iterdir()) == []


@pytest.mark.parametrize("timeout", [None, 30, 0.5, 1e9])
def test_good_timeouts_wait_and_close(make_store: MakeStore, timeout: float | None) -> None:
    store = make_store(device_bytes=0, host_bytes=0, timeout=timeout)
    h = store.put(torch.arange(1000.0))
    wait_for(lambda: store.tier_of(h) is Tier.DISK)
    assert torch.equal(store.get(h), torch.arange(1000.0))  # a get that waits for the disk
    (spill,) = store.spill_dirs
    store.close()
    assert not Path(spill).exists()


def test_a_close_that_outlasts_its_wait_raises_store_timeout_error(
    make_store: MakeStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A close whose transfers neither end nor cancel (a thread stuck in a disk call) raised
    a bare concurrent.futures.TimeoutError."""
    store = make_store(device_bytes=0, host_bytes=0, timeout=0.5)
    core = store._core
    assert core is not None
    real_finish = core.finish_close

    async def stuck(timeout: float) -> None:
        await asyncio.sleep(30)

    monkeypatch.setattr(core, "finish_close", stuck)
    with pytest.raises(tierstore.StoreTimeoutError, match=r"close\(\) waited 6s"):
        store.close()
    # Clean up as the exit hook would: run the real close on a loop of its own.
    asyncio.run(real_finish(0.5))


def test_copied_handles_are_the_handle_and_pickling_is_refused(make_store: MakeStore) -> None:
    import copy
    import pickle

    store = make_store(device_bytes=0, host_bytes=0)
    t = torch.randn(1000)
    h = store.put(t)
    for twin in (copy.copy(h), copy.deepcopy(h), copy.deepcopy({"h": [h]})["h"][0]):
        assert twin is h
        assert torch.equal(store.get(twin), t)
    with pytest.raises(TypeError, match=r"cannot be pickled.*Pickle the tensor instead"):
        pickle.dumps(h)
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps([h], protocol=2)
    assert store.state_of(h) is not TensorState.RELEASED
    store.release(h)


def test_a_copied_store_is_the_store_and_pickling_is_refused(disk_dir: Path) -> None:
    # Note: [A copy of a store is the store]: a deep copy of a model whose layers
    # checkpoint into a store raised on the store's lock.
    import copy
    import pickle

    for store in (
        tierstore.TieredStore(disk_dir=disk_dir),
        tierstore.AsyncTieredStore(disk_dir=disk_dir),
    ):
        held = {"store": [store]}
        assert copy.copy(store) is store and copy.deepcopy(held)["store"][0] is store
        with pytest.raises(TypeError, match=f"{type(store).__name__} cannot be pickled"):
            pickle.dumps(held)
        if isinstance(store, tierstore.TieredStore):
            store.close()
    sync = tierstore.TieredStore(disk_dir=disk_dir, min_bytes=0)
    h = copy.deepcopy(sync).put(torch.ones(4))
    assert torch.equal(sync.get(h), torch.ones(4))
    sync.close()


@pytest.mark.parametrize("call", ["release", "state_of", "tier_of", "get"])
def test_what_is_not_a_handle_is_a_type_error(make_store: MakeStore, call: str) -> None:
    store = make_store()
    for bad in (None, 3, torch.ones(2)):
        with pytest.raises(TypeError, match="expected a TensorHandle from put"):
            getattr(store, call)(bad)
    with pytest.raises(TypeError, match="expected a TensorHandle from put"):
        store.prefetch([None])  # type: ignore[list-item]


def test_a_put_waiting_for_its_spill_holds_its_disk_room(disk_dir: Path) -> None:
    """Note: [Room for a put]: a put admitted while the save semaphore held its spill back
    rests in host memory with no disk room reserved yet. Counting only the disk's free room,
    the next put (another thread's) was admitted too, and the store held twice what its
    disk tier could take: host bytes past a host tier of 0, kept there as if the disk were
    full. Now that put raises TierFullError."""
    store = tierstore.TieredStore(
        disk_dir=disk_dir,
        device_bytes=0,
        host_bytes=0,
        disk_bytes=9 * MiB,
        max_inflight_bytes=4 * MiB,
        min_bytes=0,
        timeout=30,
    )
    faulty = install_faults(store)
    faulty.write_delay = 0.5
    ts = [torch.full((MiB,), float(i)) for i in range(3)]  # 4 MiB each, over a pack
    first = store.put(ts[0])  # spilling, and the semaphore is full
    waited: list[tierstore.TensorHandle] = []
    behind = threading.Thread(target=lambda: waited.append(store.put(ts[1])))
    behind.start()  # admitted, then waits for the first spill to end
    wait_for(lambda: store.stats().live_entries == 2)
    with pytest.raises(tierstore.TierFullError, match="no tier has room"):
        store.put(ts[2])
    behind.join()
    wait_for(lambda: settled(store))
    stats = store.stats()
    assert stats.host.bytes == 0 and stats.kept_no_room == 0
    for h, t in zip((first, *waited), ts, strict=False):
        assert store.tier_of(h) is tierstore.Tier.DISK
        assert torch.equal(store.get(h), t)
    store.close()


def test_the_entry_backward_needs_next_is_fetched_even_if_its_spill_was_in_flight(
    disk_dir: Path,
) -> None:
    """Note: [An entry on its way down]: backward began while the last two spills were in
    flight. The walk at the first get passed the second newest (still spilling) and fetched
    the older ones, then resumed below them: the get of the second newest, the very next
    one, read it from disk itself."""
    store = tierstore.TieredStore(
        disk_dir=disk_dir, device_bytes=0, host_bytes=0, prefetch_bytes="64MiB", min_bytes=0
    )
    faulty = install_faults(store)
    ts = [torch.full((MiB,), float(i)) for i in range(10)]  # 4 MiB each: written in chunks
    hs = [store.put(t) for t in ts[:8]]
    wait_for(lambda: settled(store))
    faulty.write_delay = 0.5
    hs += [store.put(t) for t in ts[8:]]
    misses = []
    for i in reversed(range(10)):
        before = store.stats().prefetch_misses
        assert torch.equal(store.get(hs[i]), ts[i])
        if store.stats().prefetch_misses > before:
            misses.append(i)
        if i == 9:
            wait_for(lambda: store.stats().inflight_bytes == 0)  # tensor 8 is on disk now
    assert misses == [], misses
    store.close()


def test_prefetch_brings_back_a_tensor_bigger_than_the_window_once_it_is_empty(
    disk_dir: Path,
) -> None:
    """``prefetch([h])`` follows the walk's rule (Note: [A tensor bigger than the window]):
    the tensor comes alone when nothing else is fetched. It stayed on disk."""
    store = tierstore.TieredStore(
        disk_dir=disk_dir, device_bytes=0, host_bytes=0, prefetch_bytes="2MiB", min_bytes=0
    )
    t = torch.randn(MiB)  # 4 MiB, twice the window
    h = store.put(t)
    wait_for(lambda: settled(store))
    assert store.tier_of(h) is tierstore.Tier.DISK
    store.prefetch([h])
    wait_for(lambda: store.state_of(h) is tierstore.TensorState.FETCHED)
    before = store.stats().prefetch_hits
    assert torch.equal(store.get(h), t)
    assert store.stats().prefetch_hits == before + 1
    store.close()


def test_a_close_from_the_loop_thread_leaves_the_store_open(make_store: MakeStore) -> None:
    """It raised after marking the store closed: no later close, nor the exit hook's, then
    stopped its loop, and the store stayed registered with its directory."""
    store = make_store()
    h = store.put(torch.ones(4))
    loop = internals(store).loop

    async def inside() -> None:
        store.close()

    with pytest.raises(WrongThreadError, match="own loop thread"):
        asyncio.run_coroutine_threadsafe(inside(), loop).result(5)
    assert not store.closed
    assert torch.equal(store.get(h), torch.ones(4))
    (spill,) = store.spill_dirs
    store.close()
    assert store.closed and not Path(spill).exists()
    assert not internals(store).loop.is_running()


def test_a_second_close_waits_for_the_first(
    make_store: MakeStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It returned at once while the first was still deleting: "close() returned" did not
    mean the files were gone."""
    store = make_store(device_bytes=0, host_bytes=0)
    store.put(torch.randn(MiB // 4))
    (spill,) = store.spill_dirs
    core = store._core
    assert core is not None
    real = core.finish_close

    async def slow_close(timeout: float) -> None:
        await asyncio.sleep(0.5)
        await real(timeout)

    monkeypatch.setattr(core, "finish_close", slow_close)
    first = threading.Thread(target=store.close)
    first.start()
    wait_for(lambda: store.closed)
    store.close()
    assert not Path(spill).exists()
    first.join()


def test_stats_after_close_count_the_handles_dropped_before_it(disk_dir: Path) -> None:
    """The close's snapshot was taken before the releases of handles dropped just before it
    were drained: a live entry and no release, where ``stats()`` a moment earlier said 0
    and 1."""
    with tierstore.TieredStore(disk_dir=disk_dir, min_bytes=0) as store:
        h = store.put(torch.ones(1000))
        del h
        gc.collect()
    stats = store.stats()
    assert stats.live_entries == 0 and stats.releases == 1


def test_a_tensor_too_big_to_rest_in_the_host_tier_needs_the_disk_to_take_it(
    disk_dir: Path,
) -> None:
    """4.5 MiB into a 1 MiB host tier beside a 4 MiB disk tier: admitted, it was kept in
    host memory at 4.5 times the tier's capacity, the disk 'full' with nothing on it."""
    store = tierstore.TieredStore(
        disk_dir=disk_dir, device_bytes=0, host_bytes=MiB, disk_bytes=4 * MiB, min_bytes=0
    )
    with pytest.raises(TierFullError, match="no tier has room"):
        store.put(torch.randn(9 * MiB // 8))
    # 4 MiB less a page (a page more on disk for its lead): the disk takes it.
    h = store.put(torch.randn(MiB - 1024))
    wait_for(lambda: settled(store))
    assert store.tier_of(h) is Tier.DISK and store.stats().kept_no_room == 0
    store.close()


def test_a_small_put_that_would_push_a_big_entry_onto_a_full_disk_is_refused(
    disk_dir: Path,
) -> None:
    """A 4 MiB host tier holds one 4 MiB tensor; the disk tier takes 1 MiB. A 64 KiB put
    would push the 4 MiB tensor down (the cascade moves whole entries, oldest first), which
    the disk cannot take: it was admitted, and the host tier held 4.06 MiB of 4."""
    store = tierstore.TieredStore(
        disk_dir=disk_dir, device_bytes=0, host_bytes=4 * MiB, disk_bytes=MiB, min_bytes=0
    )
    big = store.put(torch.randn(MiB))  # 4 MiB of float32
    wait_for(lambda: settled(store))
    with pytest.raises(TierFullError, match="no tier has room"):
        store.put(torch.randn(16 * 1024))
    wait_for(lambda: settled(store))
    stats = store.stats()
    assert stats.host.bytes <= 4 * MiB and stats.kept_no_room == 0, stats
    assert store.tier_of(big) is Tier.HOST
    store.close()


def test_a_call_from_inside_the_store_never_waits_on_itself(make_store: MakeStore) -> None:
    """The collector runs a ``__del__`` on whatever thread allocates, one inside the store's
    lock included (``put`` allocates under it). A finalizer that released its handle there
    waited on its own thread for ever, and the process with it. Now a release is queued,
    and any other call raises WrongThreadError (Note: [A call from inside the store])."""
    store = make_store(host_bytes="64MiB")
    h = store.put(torch.ones(1024))
    kept = store.put(torch.arange(1024.0))
    outcome: list[object] = []

    def inside() -> None:  # what a finalizer run under the lock does
        assert store._core is not None
        with store._core.lock:
            store.release(h)
            for call in (lambda: store.get(kept), store.close):
                try:
                    call()
                except tierstore.WrongThreadError as err:
                    outcome.append(err)

    thread = threading.Thread(target=inside, daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "a call from inside the store waited on itself"
    assert len(outcome) == 2 and "inside it" in str(outcome[0]), outcome
    assert "inside the store" in str(outcome[1]) and not store.closed
    others = make_store(host_bytes="64MiB").put(torch.ones(1024))
    assert store._core is not None
    with pytest.raises(TensorReleasedError, match="not in this store"), store._core.lock:
        store.release(others)  # queued, and still refused
    wait_for(lambda: store.stats().live_entries == 1)
    assert store.state_of(h) is TensorState.RELEASED
    assert torch.equal(store.get(kept), torch.arange(1024.0))


def test_a_finalizer_that_releases_its_handle_raises_nothing(
    make_store: MakeStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a cycle the collector clears the handle's weak reference (which queues the entry's
    release) before it runs ``__del__``: a ``release`` there raised TensorReleasedError for
    the store's own handle."""
    store = make_store(host_bytes="64MiB")
    unraisable: list[object] = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)

    class Holder:
        def __init__(self) -> None:
            self.handle = store.put(torch.ones(1024))
            self.me = self  # a cycle: only the collector frees it

        def __del__(self) -> None:
            store.release(self.handle)

    Holder()
    gc.collect()
    assert unraisable == []
    wait_for(lambda: store.stats().live_entries == 0)


def test_an_async_store_first_used_on_two_loops_at_once_binds_to_one(disk_dir: Path) -> None:
    """Both loops found no core and each built one: the loser's spill directory and I/O
    threads, holding its tensor, were never closed."""
    before = set(threading.enumerate())
    store = tierstore.AsyncTieredStore(host_bytes=0, min_bytes=0, disk_dir=disk_dir)
    barrier = threading.Barrier(2)
    outcomes: dict[str, object] = {}

    async def use(name: str) -> None:
        barrier.wait()
        try:
            h = await store.put(torch.arange(1 << 18, dtype=torch.float32))
            outcomes[name] = float((await store.get(h)).sum())
        except WrongThreadError as err:
            outcomes[name] = err

    threads = [threading.Thread(target=asyncio.run, args=(use(n),)) for n in "AB"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    kinds = sorted(type(v).__name__ for v in outcomes.values())
    assert kinds == ["WrongThreadError", "float"], outcomes
    assert len(list(disk_dir.iterdir())) == 1
    asyncio.run(store.close())
    assert list(disk_dir.iterdir()) == []
    wait_for(
        lambda: not [t for t in set(threading.enumerate()) - before if t.name[:9] == "tierstore"]
    )


def test_an_async_store_called_from_inside_itself_never_enters_twice(
    disk_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A finalizer the collector runs on the loop thread inside the store (or while a first
    call makes the core) calling the store: with the lock reentrant it changed the table
    under the interrupted call, and while binding it waited on itself. Now a release is
    queued and other calls raise (Note: [A call from inside the store])."""
    from tierstore import _store

    store = tierstore.AsyncTieredStore(host_bytes="64MiB", disk_dir=disk_dir)
    real, seen = _store.StoreCore, []

    def making(*args: Any, **kwargs: Any) -> Any:
        try:  # what a finalizer run while the core is made would do
            store._bound()
        except WrongThreadError as err:
            seen.append(err)
        return real(*args, **kwargs)

    async def use() -> None:
        monkeypatch.setattr(_store, "StoreCore", making)
        h = await store.put(torch.ones(1024))
        monkeypatch.setattr(_store, "StoreCore", real)
        kept = await store.put(torch.arange(1024.0))
        assert store._core is not None
        with store._core.lock:
            await store.release(h)
            with pytest.raises(WrongThreadError, match="inside it"):
                await store.get(kept)
            with pytest.raises(WrongThreadError, match="inside the store"):
                await store.close()
        assert not store.closed
        for _ in range(1000):  # the queued release is drained on this loop
            if (await store.stats()).live_entries == 1:
                break
            await asyncio.sleep(0.01)
        assert await store.state_of(h) is TensorState.RELEASED
        assert torch.equal(await store.get(kept), torch.arange(1024.0))
        await store.close()

    done = threading.Thread(target=asyncio.run, args=(use(),), daemon=True)
    done.start()
    done.join(30)
    assert not done.is_alive(), "a call from inside the store waited on itself"
    assert len(seen) == 1 and "opening it" in str(seen[0])
    assert list(disk_dir.iterdir()) == []


def test_an_idle_store_polls_for_dropped_handles_rarely_and_still_releases_them(
    make_store: MakeStore,
) -> None:
    """Handles dropped with no store call after them are released by the loop's poll. It ran
    every 20 ms for as long as any entry existed: 50 wake-ups a second of the loop thread,
    the store's lock and the GIL, for a store left holding one tensor. It now backs off to
    once a second while nothing is dropped."""
    store = make_store(min_bytes=0)
    core = store._core
    assert core is not None
    kept = store.put(torch.ones(16))
    ticks: list[float] = []
    real = core._poll_dropped

    def counted() -> None:
        ticks.append(time.monotonic())
        real()

    core._poll_dropped = counted  # type: ignore[method-assign]
    time.sleep(3.0)
    assert len(ticks) <= 12, f"{len(ticks)} wake-ups in 3 s of idling"
    seen = len(ticks)
    wait_for(lambda: len(ticks) > seen)  # a tick just passed: the next is a second away
    dropped = store.put(torch.ones(16))  # a put brings the next poll forward
    key = dropped.key
    del dropped
    started = time.monotonic()
    while key in core.table.entries and time.monotonic() < started + 3:
        time.sleep(0.005)  # no store call: only the poll releases it
    assert key not in core.table.entries
    assert time.monotonic() - started < 0.3, "the poll stayed backed off after a put"
    assert store.get(kept).sum().item() == 16


def test_a_drain_that_raises_does_not_end_the_polling(
    make_store: MakeStore, caplog: pytest.LogCaptureFixture
) -> None:
    store = make_store(min_bytes=0)
    core = store._core
    assert core is not None
    real = core._release
    broke: list[bool] = []

    def breaks_once(e: Any) -> None:
        if not broke:
            broke.append(True)
            raise RuntimeError("a release that failed")
        real(e)

    core._release = breaks_once  # type: ignore[method-assign]
    hs = [store.put(torch.ones(16)) for _ in range(3)]
    with caplog.at_level(logging.ERROR):
        del hs[0]
        wait_for(lambda: bool(broke))
        keys = [h.key for h in hs]
        hs.clear()
        deadline = time.monotonic() + 5
        while any(k in core.table.entries for k in keys) and time.monotonic() < deadline:
            time.sleep(0.01)  # no store call: only the poll releases them
    assert not any(k in core.table.entries for k in keys)


def _one_fetched_ahead(make_store: MakeStore) -> tuple[TieredStore, list[Any], list[Any]]:
    """Four 1 MiB tensors on disk, a 1 MiB window: the get of the newest brings the next one
    back ahead, and the walk stops at the one after it."""
    store = make_store(device_bytes=0, host_bytes=0, prefetch_bytes=MiB)
    ts = [torch.full((MiB // 4,), float(i)) for i in range(4)]
    hs = [store.put(t) for t in ts]
    wait_for(lambda: all(store.tier_of(h) is Tier.DISK for h in hs))
    assert torch.equal(store.get(hs[3]), ts[3])
    wait_for(lambda: store.state_of(hs[2]) is TensorState.FETCHED and settled(store))
    assert store.state_of(hs[1]) is TensorState.DISK  # no room left in the window
    return store, hs, ts


def test_holding_back_a_copy_brought_back_gives_its_window_room_to_the_next(
    make_store: MakeStore,
) -> None:
    """Note: [Held back]: the room a dropped copy held goes to the entries the walk stopped
    at, at once, not at the next get."""
    store, hs, ts = _one_fetched_ahead(make_store)
    store.hold_back([hs[2]])
    assert store.state_of(hs[2]) is TensorState.DISK
    # Nothing but states is asked from here on.
    wait_for(lambda: store.state_of(hs[1]) is TensorState.FETCHED, what="hs[1] fetched ahead")
    for h, t in zip(reversed(hs[:3]), reversed(ts[:3]), strict=True):
        assert torch.equal(store.get(h), t)
    audit(store)


def test_releasing_a_copy_brought_back_gives_its_window_room_to_the_next(
    make_store: MakeStore,
) -> None:
    """The room a released entry's fetched copy held goes to the entries the walk stopped
    at, at once, not at the next get."""
    store, hs, ts = _one_fetched_ahead(make_store)
    store.release(hs[2])
    wait_for(lambda: store.state_of(hs[1]) is TensorState.FETCHED, what="hs[1] fetched ahead")
    for h, t in zip(reversed(hs[:2]), reversed(ts[:2]), strict=True):
        assert torch.equal(store.get(h), t)
    audit(store)


def test_a_read_of_exactly_pooled_read_bytes_lands_in_the_read_pool(
    make_store: MakeStore,
) -> None:
    """CPU reads of at least ``POOLED_READ_BYTES`` go into the read pool's reusable buffers,
    smaller ones into plain allocations. A tensor of exactly that size was read into a plain
    allocation, whose pages fault in afresh at every read."""
    from tierstore.core._transfers import POOLED_READ_BYTES

    store = make_store(device_bytes=0, host_bytes=0, prefetch_bytes=0)
    pool = internals(store).read_pool
    below = _random((POOLED_READ_BYTES // 4 - 1,), torch.float32, seed=50)
    at = _random((POOLED_READ_BYTES // 4,), torch.float32, seed=51)
    handles = [store.put(below), store.put(at)]
    wait_for(lambda: all(store.tier_of(h) is Tier.DISK for h in handles) and settled(store))
    assert _same_bits(store.get(handles[0]), below)
    assert pool.created == 0
    assert _same_bits(store.get(handles[1]), at)
    assert pool.created == 1


def test_the_last_reads_buffer_goes_when_its_task_lets_go_though_its_entry_stays(
    make_store: MakeStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A backward of a retained graph: the sweep's oldest tensor is got and dropped, its entry
    kept for the next backward. The loop thread that read it is made to hold it after
    answering the get until the getter has dropped it; the buffer is unmapped once the loop
    thread lets go. Checked only once the entry was released, it stayed mapped until the
    next call into the store."""
    store = make_store(device_bytes=0, host_bytes=0, prefetch_bytes=0)
    pool = internals(store).read_pool
    tensors = [_random((3 * MiB // 4,), torch.float32, seed=53 + i) for i in range(2)]
    handles = [store.put(t) for t in tensors]
    wait_for(lambda: all(store.tier_of(h) is Tier.DISK for h in handles) and settled(store))
    linger, dropped = _linger_after_answering_gets(monkeypatch)
    assert _same_bits(store.get(handles[1]), tensors[1])
    store.release(handles[1])
    linger.set()
    assert _same_bits(store.get(handles[0]), tensors[0])  # dropped at once, entry kept
    dropped.set()
    wait_for(lambda: pool.mapped_bytes == 0, timeout=5, what="the last buffer unmapped")
    store.release(handles[0])
