"""A tensor written or freed after put: a clear error for that tensor, nothing else harmed.

See Note: [Writes after put].
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tierstore import TensorModifiedError, TensorState, Tier, TieredStore
from tierstore.config import StoreConfig
from tierstore.testing import install_faults, internals, settled, wait_for
from tierstore.tiers._engine import WriteRequest
from tierstore.tiers.raw import SPILL_FILE, RawEngine

MiB = 1 << 20
MakeStore = Callable[..., TieredStore]

ENGINES = {
    "raw-direct": {},
    "raw-buffered": {"direct_io": "off"},
    "zarr": {"disk_format": "zarr"},
}
SIZES = {"packed": 64 << 10, "chunked": 20 * MiB + 4}


def _disk_store(make_store: MakeStore, engine: str) -> TieredStore:
    return make_store(device_bytes=0, host_bytes=0, io_chunk_bytes="8MiB", **ENGINES[engine])


@pytest.mark.parametrize("size", SIZES.values(), ids=SIZES.keys())
@pytest.mark.parametrize("engine", ENGINES)
def test_a_storage_freed_before_its_spill_fails_that_tensor_alone(
    make_store: MakeStore, engine: str, size: int
) -> None:
    """FSDP frees a flat parameter with ``storage.resize_(0)``; the raw engine used to crash."""
    store = _disk_store(make_store, engine)
    faulty = install_faults(store)
    tensors = [torch.full((size,), i, dtype=torch.uint8) for i in range(4)]
    victim = 2

    def free_one(key: int) -> None:
        if key == handles[victim].key:
            tensors[victim].untyped_storage().resize_(0)

    faulty.before_write = free_one
    faulty.write_gate = threading.Event()  # no write starts before every handle is known
    handles = [store.put(t) for t in tensors]
    faulty.write_gate.set()
    wait_for(lambda: settled(store))
    with pytest.raises(TensorModifiedError, match=r"resized to 0 bytes"):
        store.get(handles[victim])
    assert store.state_of(handles[victim]) is TensorState.FAILED
    for i, h in enumerate(handles):
        if i != victim:
            assert store.tier_of(h) is Tier.DISK
            assert torch.equal(store.get(h), torch.full((size,), i, dtype=torch.uint8))
    stats = store.stats()
    assert stats.write_errors == 0 and stats.disk_available  # not the disk's fault


def test_a_storage_resized_before_its_spill_starts_fails_that_tensor_alone(
    make_store: MakeStore,
) -> None:
    """A 2-D float tensor is spilled through a byte view of its storage, which cannot be made
    once the storage is resized to 0: that used to kill the whole batch's write task, leaving
    every tensor of it moving to disk for ever."""
    store = make_store(device_bytes=0, host_bytes=0)
    hold = threading.Event()
    # The loop waits, so every spill below starts after the resize.
    internals(store).loop.call_soon_threadsafe(lambda: hold.wait(10))
    try:
        tensors = [torch.full((256, 1024), float(i)) for i in range(3)]  # 1 MiB each: one batch
        handles = [store.put(t) for t in tensors]
        tensors[1].untyped_storage().resize_(0)
    finally:
        hold.set()
    wait_for(lambda: settled(store))
    with pytest.raises(TensorModifiedError, match=r"resized to 0 bytes"):
        store.get(handles[1])
    for i in (0, 2):
        assert store.tier_of(handles[i]) is Tier.DISK
        assert torch.equal(store.get(handles[i]), torch.full((256, 1024), float(i)))
    assert store.stats().write_errors == 0


@pytest.mark.parametrize("engine", ENGINES)
def test_a_tensor_written_in_place_during_its_spill_is_named_not_blamed_on_the_disk(
    make_store: MakeStore, engine: str
) -> None:
    store = _disk_store(make_store, engine)
    faulty = install_faults(store)
    t = torch.zeros(3 * MiB)
    faulty.before_write = lambda key: t.add_(1)
    h = store.put(t)
    wait_for(lambda: settled(store))
    with pytest.raises(TensorModifiedError, match=r"written in place \(version 0 at put, 1 now\)"):
        store.get(h)
    with pytest.raises(TensorModifiedError):  # for good, not only once
        store.get(h)
    assert store.stats().read_errors == 0 and store.stats().write_errors == 0


def test_a_tensor_written_in_place_while_it_rests_in_host_memory(make_store: MakeStore) -> None:
    store = make_store(device_bytes=0, host_bytes="unlimited")
    t = torch.zeros(MiB)
    h = store.put(t)
    t[7] = 1.0
    with pytest.raises(TensorModifiedError, match=r"tensor #1 .* written in place"):
        store.get(h)
    assert store.stats().host.bytes == 0  # the failed entry holds nothing


def test_a_view_written_through_its_base_is_noticed(make_store: MakeStore) -> None:
    store = make_store(device_bytes="unlimited")
    base = torch.zeros(4, MiB // 4)
    h = store.put(base[1])
    base[1, 3] = 2.0  # the view shares its base's version counter
    with pytest.raises(TensorModifiedError):
        store.get(h)


def test_a_write_beside_a_view_in_its_base_says_what_the_store_cannot_tell(
    make_store: MakeStore,
) -> None:
    """A write to the part of the base the view does not cover moves the counter the view
    shares; the store, holding the view itself, cannot tell it from a write to the view. The
    error used to say the store no longer held the bytes that were put, which was false."""
    store = make_store(device_bytes="unlimited")
    base = torch.zeros(4, MiB // 4)
    h = store.put(base[1])
    base[2, 3] = 2.0
    with pytest.raises(
        TensorModifiedError, match=r"a tensor sharing its storage .* cannot vouch for the bytes"
    ):
        store.get(h)


def test_an_untouched_tensor_and_an_inference_tensor_come_back(make_store: MakeStore) -> None:
    store = make_store(device_bytes=0, host_bytes=0)
    with torch.inference_mode():
        inference = torch.arange(MiB, dtype=torch.float32)  # keeps no version counter
    plain = torch.arange(MiB, dtype=torch.float32)
    handles = [store.put(inference), store.put(plain)]
    wait_for(lambda: settled(store))
    for h in handles:
        assert torch.equal(store.get(h), plain)


async def test_the_raw_engine_checks_a_source_on_its_io_thread(tmp_path: Path) -> None:
    """A pack fails only the blob whose storage went away; its neighbours are written."""
    d = tmp_path / "d"
    d.mkdir()
    engine = RawEngine((d,), StoreConfig.from_env(disk_dir=tmp_path))
    try:
        sources = [torch.full((64 << 10,), i, dtype=torch.uint8) for i in range(3)]
        big = torch.full((3 * MiB,), 9, dtype=torch.uint8)
        requests = [WriteRequest(i, s) for i, s in enumerate([*sources, big])]
        # Freed before the engine sees them: once queued, their storage can no longer be
        # freed (Note: [A spill's source cannot be freed]).
        sources[1].untyped_storage().resize_(0)
        big.untyped_storage().resize_(0)
        outcomes = await engine.write_many(requests)
        assert outcomes[0] is None and outcomes[2] is None
        assert isinstance(outcomes[1], TensorModifiedError)
        assert isinstance(outcomes[3], TensorModifiedError)
        for i in (0, 2):
            out = torch.empty(64 << 10, dtype=torch.uint8)
            await engine.read(i, out)
            assert torch.equal(out, torch.full((64 << 10,), i, dtype=torch.uint8))
        # The failed blobs' space is free again: all the file holds is the two written.
        assert engine.reusable_bytes() == (d / SPILL_FILE).stat().st_size - 2 * (64 << 10)
    finally:
        await engine.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_a_change_never_read_back_logs_no_error(
    make_store: MakeStore, engine: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A tensor written after put and released unread harms nothing: no ERROR is logged (a
    graph never run back whose saved tensor was written in place is a program torch accepts).
    A get still raises the error, which a DEBUG line also records."""
    import logging

    store = _disk_store(make_store, engine)
    faulty = install_faults(store)
    t = torch.ones(2 * MiB + 4, dtype=torch.uint8)  # over 1 MiB
    faulty.write_gate = threading.Event()
    with caplog.at_level(logging.DEBUG, logger="tierstore"):
        h = store.put(t)
        t.add_(1)  # before its spill starts
        faulty.write_gate.set()
        wait_for(lambda: settled(store))
        with pytest.raises(TensorModifiedError, match="written in place"):
            store.get(h)
        store.release(h)
    changed = [r for r in caplog.records if "changed after put" in r.getMessage()]
    assert changed and all(r.levelno == logging.DEBUG for r in changed), caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def _free_and_regrow(t: torch.Tensor) -> None:
    """Free the storage and allocate it again, as FSDP's ``_free_storage`` and
    ``_alloc_storage`` do: new memory, the version counter untouched."""
    storage = t.untyped_storage()
    n = storage.nbytes()
    storage.resize_(0)
    keep = torch.empty(n, dtype=torch.uint8)  # takes the freed memory's place, if malloc would
    storage.resize_(n)
    storage.fill_(0xAB)  # whatever new memory holds, not what was put
    del keep


@pytest.mark.parametrize("size", SIZES.values(), ids=SIZES.keys())
def test_a_storage_freed_and_regrown_in_host_memory_is_noticed(
    make_store: MakeStore, size: int
) -> None:
    store = make_store(device_bytes=0, host_bytes="unlimited")
    t = torch.arange(size // 4, dtype=torch.float32)
    h = store.put(t)
    _free_and_regrow(t)
    assert t._version == 0  # so the version counter alone cannot tell
    with pytest.raises(TensorModifiedError, match=r"its storage was freed and allocated again"):
        store.get(h)


@pytest.mark.parametrize("size", SIZES.values(), ids=SIZES.keys())
@pytest.mark.parametrize("engine", ENGINES)
def test_a_storage_freed_and_regrown_before_its_spill_is_noticed(
    make_store: MakeStore, engine: str, size: int
) -> None:
    store = _disk_store(make_store, engine)
    hold = threading.Event()
    internals(store).loop.call_soon_threadsafe(lambda: hold.wait(10))  # the spill waits
    try:
        t = torch.arange(size // 4, dtype=torch.float32)
        h = store.put(t)
        _free_and_regrow(t)
    finally:
        hold.set()
    wait_for(lambda: settled(store))
    with pytest.raises(TensorModifiedError, match=r"its storage was freed and allocated again"):
        store.get(h)
    assert store.stats().write_errors == 0


@pytest.mark.parametrize("size", SIZES.values(), ids=SIZES.keys())
@pytest.mark.parametrize("engine", ENGINES)
def test_a_storage_freed_while_its_spill_reads_it_is_refused_at_the_caller(
    make_store: MakeStore, engine: str, size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Note: [A spill's source cannot be freed]. Without the mark, the zarr engine's threads
    read freed memory (the process died) and a buffered write failed with EFAULT, counted as
    the disk's error (the disk tier paused)."""
    from tierstore.tiers import _zarr
    from tierstore.tiers.raw import _chunk_io

    reading, go_on = threading.Event(), threading.Event()

    def held(real: Callable[..., object]) -> Callable[..., object]:
        def wait_then(*args: object) -> object:
            reading.set()
            go_on.wait(10)
            return real(*args)

        return wait_then

    if engine == "zarr":  # right after the engine took its view of the tensor
        monkeypatch.setattr(_zarr, "numpy_dtype", held(_zarr.numpy_dtype))
    else:  # before a chunk is written, or a pack is copied and written
        for name in ("write_chunk", "write_pack"):
            monkeypatch.setattr(_chunk_io.ChunkIO, name, held(getattr(_chunk_io.ChunkIO, name)))
    store = _disk_store(make_store, engine)
    t = torch.arange(size // 4, dtype=torch.float32)
    expected = t.clone()
    h = store.put(t)
    try:
        assert reading.wait(10)
        with pytest.raises(RuntimeError, match="not resizable"):
            t.untyped_storage().resize_(0)
    finally:
        go_on.set()
    wait_for(lambda: store.tier_of(h) is Tier.DISK)
    assert torch.equal(store.get(h), expected)
    stats = store.stats()
    assert stats.write_errors == 0 and stats.disk_available


def test_a_write_the_engine_refused_as_changed_fails_the_tensor_though_it_looks_unchanged(
    make_store: MakeStore,
) -> None:
    """The engine found the tensor's storage moved or shrunk while it waited to be written,
    but by the time the store records that, the tensor looks as it was put (a storage freed
    and allocated again at the same address). The engine's word must fail the entry: taken
    for a disk error, the entry went back to host memory, was written again, and a get
    returned bytes that were not those put, with no error."""
    store = make_store(device_bytes=0, host_bytes=0)
    faulty = install_faults(store)
    faulty.fail_writes(
        TensorModifiedError(
            "its storage was resized to 0 bytes or moved while waiting to be written"
        ),
        times=1,
    )
    h = store.put(torch.arange(1 << 18, dtype=torch.float32))
    wait_for(lambda: settled(store))
    assert store.state_of(h) is TensorState.FAILED
    with pytest.raises(TensorModifiedError, match="moved while waiting to be written"):
        store.get(h)
    assert store.stats().write_errors == 0


def test_a_view_written_on_the_device_tier_fails_when_the_cascade_moves_it(
    make_store: MakeStore,
) -> None:
    """A view put into a CPU store rests on the device tier as the caller's own tensor; its
    base is written in place, then a later put pushes it down. The move must fail it: moving
    it makes the store's compact copy of the written bytes, which is the store's own from then
    on, and a get returned those bytes as if they were the ones put."""
    store = make_store(device_bytes=8 * 2000, host_bytes="unlimited")
    base = torch.zeros(8000)
    h = store.put(base[::2])  # 16000 bytes: room on the device tier
    base.add_(1)
    store.put(torch.zeros(4000))  # the view, the oldest, goes down
    with pytest.raises(TensorModifiedError, match="written in place"):
        store.get(h)
