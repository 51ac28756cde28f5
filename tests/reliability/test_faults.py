"""Faults injected at the disk engine's boundary: ENOSPC, EIO, short I/O, corruption.

Invariant 7 of the design: a failed disk write or read never loses data or returns garbage.
Each test wraps the store's real engine with ``faults.FaultyEngine`` (``wrap_engine``), so the
bytes that do reach the disk go through the real engine.
"""

from __future__ import annotations

import errno
import gc
import mmap
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tierstore import (
    CorruptTensorError,
    SpillIOError,
    TensorState,
    Tier,
    TieredStore,
    TierFullError,
)
from tierstore.core import _disk_room as disk_room
from tierstore.testing import (
    FaultyEngine,
    audit,
    backdoor_files,
    install_faults,
    internals,
    settled,
    short_io,
    wait_for,
)

MiB = 1 << 20
MakeStore = Callable[..., TieredStore]

FORMATS = ["raw", "zarr"]


def _pattern(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g)


@pytest.fixture
def free_space(monkeypatch: pytest.MonkeyPatch) -> dict[str, int | None]:
    """Control what the store believes is free on disk (None: the real statvfs answer)."""
    box: dict[str, int | None] = {"free": None}
    real = disk_room.free_bytes

    def fake(dirs: Any) -> int:
        value = box["free"]
        return real(dirs) if value is None else value

    monkeypatch.setattr(disk_room, "free_bytes", fake)
    monkeypatch.setattr(disk_room, "RETRY_SECONDS", 0.05)
    return box


# --------------------------------------------------------------------------- write faults


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO], ids=["ENOSPC", "EIO"])
def test_failed_write_keeps_the_tensor_in_host_memory(make_store: MakeStore, code: int) -> None:
    store = make_store(device_bytes=0, host_bytes=MiB)
    faulty = install_faults(store)
    faulty.fail_writes(code)
    ts = [_pattern(MiB // 8, i) for i in range(3)]  # 512 KiB each: two fit in the host tier
    hs = [store.put(t) for t in ts]
    wait_for(lambda: faulty.failed_writes == 1 and settled(store), what="a failed write")
    st = store.stats()
    assert st.write_errors == 1 and not st.disk_available
    assert st.disk.entries == 0 and st.disk.bytes == 0
    assert st.host.bytes == 3 * MiB // 2  # over capacity, but nothing is lost
    assert all(store.state_of(h) is TensorState.HOST for h in hs)
    assert all(store.tier_of(h) is Tier.HOST for h in hs)
    # While the disk tier is paused, a put with no room left raises instead of piling up.
    with pytest.raises(TierFullError, match="disk tier unavailable"):
        store.put(_pattern(MiB // 8, 9))
    audit(store)
    for h, t in zip(hs, ts, strict=True):
        assert torch.equal(store.get(h), t)
    assert faulty.written == set()


@pytest.mark.parametrize(
    "code", [errno.EIO, errno.ENOSPC, errno.EDQUOT], ids=["EIO", "ENOSPC", "EDQUOT"]
)
def test_a_failed_spill_is_tried_again_after_the_pause_with_no_other_call(
    make_store: MakeStore, free_space: dict[str, int | None], code: int
) -> None:
    """A spill that failed left its tensor in host memory, past ``host_bytes``, until the
    next put, get or release ran the cascade: a process that then only waited (evaluating,
    saving a checkpoint) held it there for as long. The store now tries again on its own once
    the pause is over."""
    store = make_store(device_bytes=0, host_bytes=MiB)
    faulty = install_faults(store)
    faulty.fail_writes(code, times=1)
    ts = [_pattern(MiB // 8, i) for i in range(3)]  # 512 KiB each: two fit in the host tier
    hs = [store.put(t) for t in ts]
    wait_for(lambda: faulty.failed_writes == 1 and settled(store), what="a failed write")
    assert store.stats().host.bytes == 3 * MiB // 2
    # From here on nothing but stats(), which moves nothing.
    wait_for(
        lambda: (st := store.stats()).disk.entries == 1 and st.inflight_bytes == 0,
        what="the spill tried again",
    )
    st = store.stats()
    assert st.host.bytes == MiB and st.disk_available and st.write_errors == 1
    assert store.state_of(hs[0]) is TensorState.DISK
    audit(store)
    for h, t in zip(hs, ts, strict=True):
        assert torch.equal(store.get(h), t)


@pytest.mark.parametrize("code", [errno.EINVAL, errno.ENOSPC], ids=["EINVAL", "ENOSPC"])
def test_tier_full_says_why_the_disk_takes_nothing_and_what_to_do(
    make_store: MakeStore, free_space: dict[str, int | None], code: int
) -> None:
    """A disk that fails its writes is not helped by a bigger TIERSTORE_DISK_BYTES."""
    store = make_store(device_bytes=0, host_bytes=MiB)
    faulty = install_faults(store)
    faulty.fail_writes(OSError(code, f"growing spill.raw by 67108864 bytes: {os.strerror(code)}"))
    hs = [store.put(_pattern(MiB // 8, i)) for i in range(3)]
    wait_for(lambda: faulty.failed_writes == 1 and settled(store), what="a failed write")
    free_space["free"] = 0
    with pytest.raises(TierFullError, match="disk tier unavailable") as info:
        store.put(_pattern(MiB // 8, 9))
    msg = str(info.value)
    if code == errno.EINVAL:
        assert "paused after a write error: EINVAL: growing spill.raw" in msg, msg
        assert "fix what the write error names" in msg and "TIERSTORE_DISK_BYTES" not in msg
    else:
        assert "full until" in msg and "free disk space" in msg, msg
        assert "TIERSTORE_DISK_BYTES" not in msg
    for i, h in enumerate(hs):
        assert torch.equal(store.get(h), _pattern(MiB // 8, i))


def test_enospc_makes_disk_unavailable_until_space_returns(
    make_store: MakeStore, free_space: dict[str, int | None]
) -> None:
    store = make_store(device_bytes=0, host_bytes=MiB)
    faulty = install_faults(store)
    faulty.fail_writes(errno.ENOSPC)
    free_space["free"] = 0  # what statvfs says once the write has hit ENOSPC
    hs = [store.put(_pattern(MiB // 8, i)) for i in range(2)]
    free_space["free"] = None  # the check before the spill sees room; the write then fails
    hs.append(store.put(_pattern(MiB // 8, 2)))
    wait_for(lambda: faulty.failed_writes >= 1 and settled(store), what="ENOSPC")
    free_space["free"] = 0
    attempts = faulty.writes
    # Well past the retry pause (0.05 s), the disk is still full: no new write is attempted,
    # the tier reports unavailable, and a put with no room left anywhere raises instead of
    # piling up.
    time.sleep(0.2)
    assert not store.stats().disk_available
    with pytest.raises(TierFullError, match="disk tier unavailable"):
        store.put(_pattern(MiB // 4, 99))
    assert faulty.writes == attempts, "wrote to a disk that has no space"
    assert store.stats().live_entries == 3
    # Space comes back (another process deleted files): the tier resumes on the next put and
    # the entries that were kept in memory move down too.
    faulty.heal()
    free_space["free"] = None
    wait_for(lambda: store.stats().disk_available, what="disk available again")
    hs.append(store.put(_pattern(MiB // 8, 3)))
    wait_for(lambda: settled(store) and store.stats().host.bytes <= MiB, what="spill resumed")
    assert store.stats().disk.entries >= 2
    audit(store)
    for i, h in enumerate(hs):
        assert torch.equal(store.get(h), _pattern(MiB // 8, i))


class _ScatteredSpace(FaultyEngine):
    """Holds a GiB of free pieces in its files, none of which a blob fits in."""

    def reusable_bytes(self) -> int:
        return 1 << 30

    def placeable_bytes(self) -> int:
        return 0


def test_enospc_with_free_space_only_in_pieces_keeps_the_tier_off(
    make_store: MakeStore, free_space: dict[str, int | None]
) -> None:
    store = make_store(device_bytes=0, host_bytes=MiB)
    faulty = install_faults(store, _ScatteredSpace)
    faulty.fail_writes(errno.ENOSPC)
    free_space["free"] = 0
    hs = [store.put(_pattern(MiB // 8, i)) for i in range(3)]
    wait_for(lambda: faulty.failed_writes >= 1 and settled(store), what="ENOSPC")
    attempts = faulty.writes
    # Well past the retry pause (0.05 s): the scattered pieces do not count as room, so no
    # write is tried again and the tier stays off.
    time.sleep(0.2)
    assert not store.stats().disk_available
    assert faulty.writes == attempts, "retried a disk whose free space is only in pieces"
    faulty.heal()
    free_space["free"] = None  # the filesystem has room again
    wait_for(lambda: store.stats().disk_available, what="disk available again")
    for i, h in enumerate(hs):
        assert torch.equal(store.get(h), _pattern(MiB // 8, i))


def test_every_tensor_kept_for_lack_of_room_counts_once(
    make_store: MakeStore, free_space: dict[str, int | None]
) -> None:
    """Note: [Counting what stays for want of room]: a put that pushes the host tier two
    tensors over its capacity, the disk then found full, keeps both. The spill plan names
    only the oldest: one was counted."""
    store = make_store(device_bytes=0, host_bytes=MiB, disk_bytes="1GiB")
    faulty = install_faults(store)
    hs = [store.put(_pattern(MiB // 8, i)) for i in range(2)]  # 512 KiB each: the tier full
    free_space["free"] = MiB // 4  # another process filled the disk
    hs.append(store.put(_pattern(MiB // 4, 2)))  # 1 MiB: the two older ones are over
    wait_for(lambda: settled(store))
    assert faulty.writes == 0
    assert store.stats().kept_no_room == 2
    for _ in range(3):  # each runs the cascade again
        store.release(store.put(torch.ones(0)))  # empty: stored in place, never refused
    assert store.stats().kept_no_room == 2
    for i, h in enumerate(hs):
        assert torch.equal(store.get(h), _pattern(MiB // (8 if i < 2 else 4), i))


def test_free_space_is_checked_before_each_spill(
    make_store: MakeStore, free_space: dict[str, int | None]
) -> None:
    store = make_store(device_bytes=0, host_bytes=MiB, disk_bytes="1GiB")
    faulty = install_faults(store)
    free_space["free"] = MiB // 4  # less than one tensor: another process filled the disk
    hs = [store.put(_pattern(MiB // 8, i)) for i in range(3)]
    wait_for(lambda: settled(store))
    assert faulty.writes == 0, "spilled without checking the free space first"
    st = store.stats()
    assert st.kept_no_room == 1 and not st.disk_available and st.write_errors == 0
    with pytest.raises(TierFullError, match="disk tier unavailable"):
        store.put(_pattern(MiB // 8, 3))
    for _ in range(3):  # each runs the cascade, which finds no room for the same tensor
        store.release(store.put(torch.ones(0)))  # empty: stored in place, never refused
    assert store.stats().kept_no_room == 1  # counted per tensor, not per cascade
    free_space["free"] = None
    wait_for(lambda: store.stats().disk_available)
    hs.append(store.put(_pattern(MiB // 8, 3)))
    wait_for(lambda: settled(store) and store.tier_of(hs[0]) is Tier.DISK)
    assert faulty.writes >= 2
    for i, h in enumerate(hs):
        assert torch.equal(store.get(h), _pattern(MiB // 8, i))


def test_transient_eio_pauses_then_retries(
    make_store: MakeStore, free_space: dict[str, int | None]
) -> None:
    store = make_store(device_bytes=0, host_bytes=0)
    faulty = install_faults(store)
    faulty.fail_writes(errno.EIO, times=1)
    h1 = store.put(_pattern(MiB // 4, 1))
    wait_for(lambda: faulty.failed_writes == 1 and settled(store))
    assert store.tier_of(h1) is Tier.HOST
    # EIO is not "full": after the pause the next put spills both.
    wait_for(lambda: store.stats().disk_available)
    h2 = store.put(_pattern(MiB // 4, 2))
    wait_for(lambda: store.tier_of(h1) is Tier.DISK and store.tier_of(h2) is Tier.DISK)
    assert torch.equal(store.get(h1), _pattern(MiB // 4, 1))
    assert torch.equal(store.get(h2), _pattern(MiB // 4, 2))
    audit(store)


def test_no_tier_with_room_raises_tier_full_and_drops_nothing(
    make_store: MakeStore, free_space: dict[str, int | None]
) -> None:
    store = make_store(device_bytes=0, host_bytes=MiB, disk_bytes=2 * MiB)
    hs = [store.put(_pattern(MiB // 4, i)) for i in range(3)]  # 3 MiB: 1 host + 2 disk
    wait_for(lambda: settled(store))
    assert store.stats().disk.bytes >= 2 * MiB
    with pytest.raises(TierFullError, match="no tier has room") as info:
        store.put(_pattern(MiB // 4, 9))
    assert isinstance(info.value, MemoryError)
    assert store.stats().live_entries == 3
    for i, h in enumerate(hs):
        assert torch.equal(store.get(h), _pattern(MiB // 4, i))
    # Releasing makes room again (once a prefetch of it that get() started has ended).
    store.release(hs[0])
    wait_for(lambda: store.stats().host.bytes + store.stats().disk.bytes <= 2 * MiB)
    store.put(_pattern(MiB // 4, 10))
    audit(store)


# --------------------------------------------------------------------------- read faults


def test_eio_on_read_names_the_tensor_and_keeps_it(make_store: MakeStore) -> None:
    store = make_store(device_bytes=0, host_bytes=0)
    faulty = install_faults(store)
    t = _pattern(3 * MiB // 16, 7)
    h = store.put(t.view(3, -1))
    wait_for(lambda: store.tier_of(h) is Tier.DISK and settled(store))
    faulty.fail_reads(errno.EIO, times=1)
    with pytest.raises(SpillIOError) as info:
        store.get(h)
    msg = str(info.value)
    assert f"tensor #{h.key}" in msg and "float32" in msg and "reading" in msg, msg
    assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == errno.EIO
    assert store.state_of(h) is TensorState.DISK, "a failed read must not lose the entry"
    assert store.stats().read_errors == 1
    assert torch.equal(store.get(h), t.view(3, -1))  # the next try reads it
    audit(store)


class _BatchBreaks(FaultyEngine):
    """An engine whose ``write_many`` or ``read_many`` raises, or answers fewer requests than
    asked, instead of one outcome per request (an engine's bug), once, when ``how`` is set."""

    how: str | None = None

    async def _broken(self, call: Callable[[Any], Any], requests: Any) -> Any:
        how, self.how = self.how, None
        if how == "raises":
            raise OSError(errno.EIO, f"{call.__name__} itself failed")
        outcomes = await call(requests)
        return outcomes[:-1] if how == "short" else outcomes

    async def write_many(self, requests: Any) -> Any:
        return await self._broken(super().write_many, requests)

    async def read_many(self, requests: Any) -> Any:
        return await self._broken(super().read_many, requests)


@pytest.mark.parametrize("how", ["raises", "short"])
def test_a_read_many_that_breaks_its_contract_fails_the_get_and_the_next_one_reads(
    make_store: MakeStore, how: str
) -> None:
    """The entries stayed FETCHING for the store's life: every get of them waited its whole
    timeout, and again after the engine recovered."""
    store = make_store(device_bytes=0, host_bytes=0, prefetch_bytes=0, timeout=30)
    engine = install_faults(store, _BatchBreaks)
    t = _pattern(MiB // 4, 3)
    h = store.put(t)
    wait_for(lambda: store.tier_of(h) is Tier.DISK and settled(store))
    engine.how = how
    started = time.monotonic()
    with pytest.raises(SpillIOError) as info:
        store.get(h)
    assert time.monotonic() - started < 10, "the get waited for its timeout"
    assert f"tensor #{h.key}" in str(info.value)
    assert store.state_of(h) is TensorState.DISK
    assert torch.equal(store.get(h), t)
    audit(store)


@pytest.mark.parametrize("how", ["raises", "short"])
def test_a_write_many_that_breaks_its_contract_keeps_the_tensors_and_the_store_goes_on(
    make_store: MakeStore, how: str
) -> None:
    """A short answer left every entry of the batch moving to disk for the store's life, the
    save window never given back: every later put waited its whole timeout."""
    store = make_store(device_bytes=0, host_bytes=0, max_inflight_bytes=2 * MiB, timeout=30)
    engine = install_faults(store, _BatchBreaks)
    engine.how = how
    first = [_pattern(MiB // 4, 1)]  # one put: a second could meet the pause (TierFullError)
    handles = [store.put(t) for t in first]
    wait_for(lambda: settled(store), timeout=10)
    assert store.stats().write_errors >= 1
    # The disk tier pauses after a write error (puts with no room raise meanwhile), then the
    # store spills again.
    wait_for(lambda: store.stats().disk_available, timeout=10)
    later = [_pattern(MiB // 4, seed) for seed in range(2, 6)]
    handles += [store.put(t) for t in later]
    wait_for(lambda: settled(store), timeout=10)
    for h, t in zip(handles, first + later, strict=True):
        assert torch.equal(store.get(h), t)
    audit(store)


@pytest.mark.parametrize("size", [3 * MiB, 256 * 1024], ids=["3MiB-chunked", "256KiB-packed"])
def test_a_read_error_kept_by_the_caller_keeps_no_read_buffer(
    make_store: MakeStore, size: int
) -> None:
    """Note: [A failed read keeps no buffer]: the engine's traceback held the read's pooled
    buffer, and the SpillIOError chains it, so a caller keeping the error kept the buffer."""
    store = make_store(device_bytes=0, host_bytes=0, prefetch_bytes=0)
    pool = internals(store).read_pool
    faulty = install_faults(store)
    t = _pattern(size // 4, 11)
    h = store.put(t)
    wait_for(lambda: store.tier_of(h) is Tier.DISK and settled(store))
    faulty.fail_reads(errno.EIO, times=1)
    with pytest.raises(SpillIOError) as info:
        store.get(h)
    kept = info.value
    assert isinstance(kept.__cause__, OSError) and kept.__cause__.errno == errno.EIO
    wait_for(lambda: settled(store))
    gc.collect()
    assert not pool._busy, "a kept read error holds the read buffer"
    pool.shrink(keep_free=0)
    assert pool.mapped_bytes == 0
    assert torch.equal(store.get(h), t)  # the next try reads it
    del kept


def test_close_hands_the_read_pools_buffers_back(make_store: MakeStore) -> None:
    """A sweep stopped half way (an exception in backward), then close: the closed store,
    still referenced, kept its free read buffers mapped. The window (two tensors) keeps the
    walk from reaching the oldest entry in four gets: a walk that did ended the sweep, which
    may unmap the free buffers before the close (the test then failed now and then)."""
    store = make_store(device_bytes=0, host_bytes=0, prefetch_bytes=4 * MiB)
    pool = internals(store).read_pool
    tensors = [_pattern(MiB // 2, 20 + i) for i in range(8)]
    handles = [store.put(t) for t in tensors]
    wait_for(lambda: all(store.tier_of(h) is Tier.DISK for h in handles) and settled(store))
    held = []  # backward's tensors, alive until the exception unwinds: their own buffers
    for h, t in list(zip(handles, tensors, strict=True))[::-1][:4]:
        held.append(store.get(h))
        assert torch.equal(held[-1], t)
        store.release(h)
    fetching = {TensorState.FETCHING}
    wait_for(lambda: settled(store) and not fetching & set(map(store.state_of, handles[:4])))
    del held
    free = [m for maps in pool._free.values() for m in maps]
    assert free and pool.mapped_bytes > 0
    store.close()
    assert pool.mapped_bytes == 0
    # A map of its own is closed; a buffer cut from a wider map (a huge-page slab's piece, a
    # buffer cut at a 2 MiB boundary) is a view, released so that its map can go.
    assert all(m.closed if isinstance(m, mmap.mmap) else _released(m) for m in free), (
        "a free read buffer is still mapped after close"
    )


def _released(view: memoryview) -> bool:
    try:
        len(view)
    except ValueError:
        return True
    return False


def test_eio_on_prefetch_surfaces_at_get(make_store: MakeStore) -> None:
    store = make_store(device_bytes=0, host_bytes=0, prefetch_bytes=8 * MiB)
    faulty = install_faults(store)
    hs = [store.put(_pattern(MiB // 4, i)) for i in range(4)]
    wait_for(lambda: all(store.tier_of(h) is Tier.DISK for h in hs) and settled(store))
    faulty.fail_reads(errno.EIO)
    store.prefetch(hs)
    wait_for(lambda: faulty.failed_reads >= 4 and settled(store))
    for h in hs:
        with pytest.raises(SpillIOError, match=f"tensor #{h.key}"):
            store.get(h)
    faulty.heal()
    for i, h in enumerate(hs):
        assert torch.equal(store.get(h), _pattern(MiB // 4, i))
    audit(store)


# --------------------------------------------------------------------------- short I/O


@pytest.mark.parametrize("nbytes", [4096, 4097, MiB + 1, 3 * MiB + 4095])
def test_short_writes_and_reads_are_retried(make_store: MakeStore, nbytes: int) -> None:
    store = make_store(device_bytes=0, host_bytes=0, io_chunk_bytes="1MiB")
    t = torch.randint(
        0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes)
    )
    with short_io(4096) as counts:
        h = store.put(t)
        wait_for(lambda: store.tier_of(h) is Tier.DISK and settled(store))
        out = store.get(h)
    assert torch.equal(out, t)
    if nbytes > 4096:
        assert counts["short_writes"] > 0 and counts["short_reads"] > 0, counts


# --------------------------------------------------------------------------- corruption


def _spill_one(store: TieredStore, seed: int) -> tuple[Any, torch.Tensor]:
    t = _pattern(MiB // 4 + 5, seed)
    h = store.put(t)
    wait_for(lambda: store.tier_of(h) is Tier.DISK and settled(store))
    return h, t


def _flip_every_byte(path: Path) -> None:
    data = np.fromfile(path, dtype=np.uint8)
    data ^= 0x5A
    with open(path, "r+b") as f:  # in place: the engine keeps its descriptor
        f.write(data.tobytes())
        f.flush()
        os.fsync(f.fileno())


def _data_files(store: TieredStore) -> list[Path]:
    """The spill files holding tensor bytes (zarr's JSON metadata left alone)."""
    files = [f for f in backdoor_files(store) if not f.name.endswith(".json")]
    assert files, "no spill file found to corrupt"
    return files


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("direct_io", ["auto", "off"])
def test_corrupted_spill_file_raises_never_garbage(
    make_store: MakeStore, fmt: str, direct_io: str
) -> None:
    store = make_store(device_bytes=0, host_bytes=0, disk_format=fmt, direct_io=direct_io)
    h, _t = _spill_one(store, 11)
    for f in _data_files(store):
        _flip_every_byte(f)
    with pytest.raises(CorruptTensorError, match=f"tensor #{h.key}"):
        store.get(h)
    assert store.state_of(h) is TensorState.FAILED
    with pytest.raises(CorruptTensorError):  # stays failed, never turns into garbage later
        store.get(h)
    st = store.stats()
    assert st.read_errors == 1 and st.disk.bytes == 0
    audit(store)


@pytest.mark.parametrize("fmt", FORMATS)
def test_truncated_spill_file_raises_never_garbage(make_store: MakeStore, fmt: str) -> None:
    store = make_store(device_bytes=0, host_bytes=0, disk_format=fmt)
    h, _t = _spill_one(store, 12)
    for f in _data_files(store):
        # Keep at most one page: the blob (about 1 MiB, first in a fresh file) is cut short.
        os.truncate(f, min(4096, f.stat().st_size // 2))
    with pytest.raises(CorruptTensorError, match=f"tensor #{h.key}"):
        store.get(h)
    assert store.state_of(h) is TensorState.FAILED
    audit(store)


# --------------------------------------------------------------------------- released in flight


def _block_loop(store: TieredStore) -> threading.Event:
    """Hold the store's loop thread until the returned event is set."""
    go, held = threading.Event(), threading.Event()

    def hold() -> None:
        held.set()
        go.wait(30)

    internals(store).loop.call_soon_threadsafe(hold)
    assert held.wait(10)
    return go


def test_released_before_its_read_starts_is_never_read(make_store: MakeStore) -> None:
    store = make_store(device_bytes=0, host_bytes=0, prefetch_bytes=8 * MiB)
    faulty = install_faults(store)
    hs = [store.put(_pattern(MiB // 4, i)) for i in range(3)]
    wait_for(lambda: all(store.tier_of(h) is Tier.DISK for h in hs) and settled(store))
    go = _block_loop(store)
    store.prefetch(hs)
    assert all(store.state_of(h) is TensorState.FETCHING for h in hs)
    for h in hs:
        store.release(h)
    go.set()
    wait_for(lambda: store.stats().disk.bytes == 0 and faulty.deletes == 3)
    assert faulty.reads == 0
    audit(store)


def test_a_put_that_fits_the_device_tier_is_admitted_while_the_disk_is_paused(
    make_store: MakeStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Note: [Room for a put]: a put that fits in ``device_bytes`` rests on its device and
    moves nothing down, so it is admitted even while the host tier is past its capacity
    (a spill failed) and the disk tier is paused: one that fits exactly too."""
    monkeypatch.setattr(disk_room, "RETRY_SECONDS", 600.0)  # the pause outlasts the test
    n = 256 * 1024 // 4  # 256 KiB of float32
    store = make_store(device_bytes=4 * n, host_bytes=2 * 4 * n)
    faulty = install_faults(store)
    faulty.fail_writes(errno.EIO)
    hs = [store.put(_pattern(n, i)) for i in range(4)]  # the oldest spill fails
    wait_for(lambda: faulty.failed_writes >= 1 and settled(store), what="a failed write")
    st = store.stats()
    assert st.host.bytes == 3 * 4 * n and not st.disk_available  # past the host tier
    store.release(hs.pop())  # the device tier is empty
    t = _pattern(n, 9)
    h = store.put(t)  # exactly device_bytes: it rests on its device
    assert store.state_of(h) is TensorState.DEVICE
    assert torch.equal(store.get(h), t)
    audit(store)


def test_seconds_from_disk_count_the_time_the_reads_take(make_store: MakeStore) -> None:
    """``stats().seconds_from_disk`` is the time spent reading back from disk: a read the
    engine holds for half a second counts at least that."""
    store = make_store(device_bytes=0, host_bytes=0, prefetch_bytes=0)
    faulty = install_faults(store)
    t = _pattern(MiB // 4, 1)
    h = store.put(t)
    wait_for(lambda: store.state_of(h) is TensorState.DISK and settled(store), what="on disk")
    faulty.read_delay = 0.5
    assert torch.equal(store.get(h), t)
    st = store.stats()
    assert st.bytes_from_disk == MiB and st.seconds_from_disk >= 0.5
    audit(store)


def test_a_failed_read_moves_no_bytes_from_disk(make_store: MakeStore) -> None:
    """``stats().bytes_from_disk`` counts what was read back: a read that failed read
    nothing, and the one that succeeds after it counts once."""
    store = make_store(device_bytes=0, host_bytes=0, prefetch_bytes=0)
    faulty = install_faults(store)
    t = _pattern(MiB // 4, 2)
    h = store.put(t)
    wait_for(lambda: store.state_of(h) is TensorState.DISK and settled(store), what="on disk")
    faulty.fail_reads(errno.EIO, times=1)
    with pytest.raises(SpillIOError):
        store.get(h)
    st = store.stats()
    assert st.read_errors == 1 and st.bytes_from_disk == 0
    assert torch.equal(store.get(h), t)  # the entry stayed on disk: the retry works
    assert store.stats().bytes_from_disk == MiB
    audit(store)
