"""Visibility: peaks per tier and off the device, one StepStats per training step, the line it
prints, the summary's skip reasons, and the warning when offloading stores nothing."""

from __future__ import annotations

import asyncio
import logging
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import tierstore
from tierstore._stats import REASON_NAMES, format_size, format_skipped
from tierstore.adapters import _common
from tierstore.testing import audit, settled, wait_for

MiB = 1 << 20
GiB = 1 << 30


def _mib(i: int) -> torch.Tensor:
    return torch.full((MiB // 4,), float(i))  # 1 MiB of float32


# -- formatting ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (512, "512 B"),
        (1536, "1.5 KiB"),
        (12 * MiB, "12 MiB"),
        (int(3.1 * GiB), "3.1 GiB"),
        (1023 * MiB, "1023 MiB"),
        (5 << 40, "5.0 TiB"),
        ((1 << 63) - 1, "unlimited"),
    ],
)
def test_format_size_picks_the_largest_binary_unit(n: int, text: str) -> None:
    assert format_size(n) == text


def test_every_skip_reason_has_a_short_name() -> None:
    reasons = {_common.SMALL, _common.PARAMETER, _common.UNSUPPORTED, _common.NO_ROOM}
    assert reasons == set(REASON_NAMES)


def test_the_step_line_reads_as_documented() -> None:
    step = tierstore.StepStats(
        step=12,
        puts=40,
        bytes_offloaded=int(3.1 * GiB),
        bytes_to_disk=int(1.1 * GiB),
        peak_off_device_bytes=int(2.9 * GiB),
        get_wait_seconds=0.04,
        skipped={"parameter_or_buffer": 200, "below_min_bytes": 88},
        skipped_bytes={"parameter_or_buffer": 10 * MiB, "below_min_bytes": 2 * MiB},
    )
    assert str(step) == (
        "tierstore: step 12 offloaded 3.1 GiB (host 2.0, disk 1.1), peak off-device 2.9 GiB, "
        "backward waited 0.04 s, skipped 12 MiB (parameters 10, small 2.0)"
    )
    assert step.bytes_kept_in_host == int(3.1 * GiB) - int(1.1 * GiB)
    quiet = tierstore.StepStats(step=1, kept_no_room=3)
    assert str(quiet) == (
        "tierstore: step 1 offloaded 0 B, peak off-device 0 B, backward waited 0.00 s, "
        "skipped nothing, 3 kept in place for lack of room"
    )


def test_format_skipped_gives_reasons_with_counts_and_bytes() -> None:
    text = format_skipped(
        {"parameter_or_buffer": 200, "below_min_bytes": 88},
        {"parameter_or_buffer": 10 * MiB, "below_min_bytes": 2 * MiB},
    )
    assert text == "288 tensors, 12 MiB: parameters 200 (10 MiB), small 88 (2.0 MiB)"
    assert format_skipped({}, {}) == "nothing"


# -- peaks ----------------------------------------------------------------------------------


def test_peaks_per_tier_and_off_device_count_each_entry_once(make_store: Any) -> None:
    # CPU tensors: the host tier holds them, and they count as off the device (Note: [Off
    # the device]); a spill holds host and disk copies at once, but the entry counts once.
    store = make_store(device_bytes=0, host_bytes=2 * MiB, max_inflight_bytes=MiB)
    handles = [store.put(_mib(i)) for i in range(5)]
    wait_for(lambda: settled(store))
    audit(store)
    s = store.stats()
    assert s.bytes_offloaded == 5 * MiB and s.off_device_bytes == 5 * MiB
    assert s.peak_off_device_bytes == 5 * MiB
    assert 2 * MiB <= s.host.peak_bytes <= 4 * MiB and s.host.bytes <= 2 * MiB
    assert s.disk.peak_bytes >= 3 * MiB and s.device.peak_bytes == MiB
    step = store.step_stats()
    assert (step.step, step.puts, step.bytes_offloaded) == (1, 5, 5 * MiB)
    assert step.peak_off_device_bytes == 5 * MiB and step.bytes_to_disk == 3 * MiB
    assert step.peak_disk_bytes == s.disk.peak_bytes
    assert "offloaded 5.0 MiB (host 2.0, disk 3.0)" in str(step)

    # Backward: gets bring the entries back and release them; ending the step starts the
    # next one's peaks at what is held now, not at the last step's peak.
    for h in reversed(handles):
        assert torch.equal(store.get(h), _mib(handles.index(h)))
    del handles, h
    wait_for(lambda: settled(store) and store.stats().live_entries == 0)
    first = store.end_step()
    assert first.step == 1 and first.bytes_from_disk == 3 * MiB
    assert first.peak_off_device_bytes == 5 * MiB
    store.put(_mib(9))  # kept: the handle is dropped at once, the bytes stay counted in peaks
    second = store.end_step()
    assert second.step == 2 and second.puts == 1 and second.peak_off_device_bytes == MiB
    assert store.stats().peak_off_device_bytes == 5 * MiB  # the store's own peak stays
    audit(store)


def test_end_step_numbers_steps_and_checks_its_argument(make_store: Any) -> None:
    store = make_store()
    store.put(_mib(0))
    assert store.end_step(41).step == 41
    store.put(_mib(1))
    assert store.step_stats().step == 42 and store.end_step().step == 42
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(ValueError, match="step="):
            store.end_step(bad)


def test_async_store_ends_steps_too(disk_dir: Path) -> None:
    async def main() -> tierstore.StepStats:
        async with tierstore.AsyncTieredStore(disk_dir=disk_dir, min_bytes=0) as store:
            h = await store.put(_mib(0))
            assert (await store.step_stats()).puts == 1
            step = await store.end_step()
            await store.release(h)
            return step

    assert asyncio.run(main()).bytes_offloaded == MiB


# -- what close() logs ---------------------------------------------------------------------


def test_the_close_summary_gives_skip_reasons_and_bytes(
    make_store: Any, caplog: pytest.LogCaptureFixture
) -> None:
    store = make_store()
    store.put(_mib(0))
    for _ in range(200):
        store.note_skipped("parameter_or_buffer", 10 * MiB // 200)
    for _ in range(88):
        store.note_skipped("below_min_bytes", 2 * MiB // 88)
    with caplog.at_level(logging.INFO, logger="tierstore"):
        store.close()
    summary = [r.getMessage() for r in caplog.records if "stored;" in r.getMessage()][-1]
    assert "skipped 288 tensors, 12 MiB: parameters 200 (10 MiB), small 88 (2.0 MiB)" in summary
    assert "peak off-device 1.0 MiB" in summary


# -- the option that silently does nothing (Note: [Say when offloading does nothing]) -------


def test_a_step_that_stores_nothing_warns_once_naming_why(make_store: Any) -> None:
    store = make_store(min_bytes=MiB)
    store.note_skipped("below_min_bytes", 4096)
    with pytest.warns(RuntimeWarning, match="step 1 stored nothing") as record:
        store.end_step()
    message = str(record[0].message)
    assert "small 1 (4.0 KiB)" in message and "TIERSTORE_MIN_BYTES" in message
    assert "1.0 MiB" in message and "once per store" in message
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        store.end_step()  # said once: nothing again, no second warning
    other = make_store()
    with pytest.warns(RuntimeWarning, match="no tensor reached the store"):
        other.end_step()


def test_an_offload_block_that_stores_nothing_warns_once(make_store: Any) -> None:
    store = make_store(min_bytes=MiB)
    layer = torch.nn.Linear(64, 64)
    x = torch.randn(8, 64, requires_grad=True)
    with (
        pytest.warns(RuntimeWarning, match="offload_activations block stored nothing") as rec,
        tierstore.offload_activations(store),
    ):
        layer(x).relu().sum().backward()
    message = str(rec[0].message)
    assert "small" in message and "lower it" in message
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with tierstore.offload_activations(store):  # once per store
            layer(x).relu().sum().backward()


def test_no_warning_when_the_block_stores_or_cannot_save(make_store: Any) -> None:
    store = make_store(min_bytes=0)
    x = torch.randn(256, 1024, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with tierstore.offload_activations(store):
            loss = x.exp().sum()
        loss.backward()
        with torch.no_grad(), tierstore.offload_activations(store):  # evaluation saves nothing
            x.exp().sum()
        idle = make_store()
        with torch.no_grad(), tierstore.offload_activations(idle):
            x.exp().sum()
    assert store.stats().puts == 1
    assert store.end_step().puts == 1


def test_a_block_that_saves_nothing_warns(make_store: Any) -> None:
    store = make_store()
    x = torch.randn(16, requires_grad=True)
    with (
        pytest.warns(RuntimeWarning, match="no tensor reached the store"),
        tierstore.offload_activations(store),
        tierstore.no_offload(),
    ):
        x.exp().sum()


def test_a_step_that_holds_less_than_an_earlier_one_leaves_the_stores_peak(
    make_store: Any,
) -> None:
    """``peak_bytes`` is the most a tier ever held: a later step that rises above its own
    start, but not to the earlier peak, does not lower it."""
    store = make_store(device_bytes=0, host_bytes=16 * MiB)
    hs = [store.put(_mib(i)) for i in range(3)]
    for h in hs[1:]:
        store.release(h)
    store.end_step()
    store.put(_mib(3))  # the host tier holds 2 MiB: the step's peak, not the store's
    assert store.stats().host.peak_bytes == 3 * MiB
    audit(store)


def test_an_entry_read_back_from_disk_is_offloaded_once(make_store: Any) -> None:
    """Note: [Off the device]: ``bytes_offloaded`` counts each entry's move off the device
    once; the copy a get read back from disk leaving again is no second move."""
    store = make_store(device_bytes=0, host_bytes=0)
    t = _mib(1)
    h = store.put(t)
    wait_for(lambda: store.tier_of(h) is tierstore.Tier.DISK)
    assert torch.equal(store.get(h), t)
    wait_for(lambda: settled(store))
    st = store.stats()
    assert st.bytes_offloaded == MiB and st.off_device_bytes == MiB
    audit(store)


def test_a_steps_skip_counts_name_only_what_it_skipped(make_store: Any) -> None:
    """A reason that kept tensors in place in an earlier step but none in this one is not in
    this step's counts. Listed with a count of 0, the step's figures (and the warning of a
    step that stores nothing, with its advice) named reasons for tensors it never saw."""
    store = make_store()
    store.note_skipped("below_min_bytes", 4096)
    store.put(_mib(0))
    first = store.end_step()
    assert first.skipped == {"below_min_bytes": 1}
    assert first.skipped_bytes == {"below_min_bytes": 4096}
    store.put(_mib(1))
    second = store.end_step()
    assert second.skipped == {} and second.skipped_bytes == {}


def test_a_steps_reads_and_gets_count_from_the_steps_start(make_store: Any) -> None:
    """Step 1 reads a tensor back from disk; step 2 only puts one. Step 2's figures hold no
    read, miss or wait of step 1's: counted from the store's start instead, every later step
    reported step 1's reads as its own."""
    store = make_store(device_bytes=0, host_bytes=0, prefetch_bytes=0)
    h = store.put(_mib(0))
    wait_for(lambda: store.tier_of(h) is tierstore.Tier.DISK and settled(store))
    assert torch.equal(store.get(h), _mib(0))
    store.release(h)
    first = store.end_step()
    assert first.bytes_from_disk == MiB and first.prefetch_misses == 1
    h = store.put(_mib(1))
    wait_for(lambda: store.tier_of(h) is tierstore.Tier.DISK and settled(store))
    second = store.end_step()
    assert (second.puts, second.bytes_put, second.bytes_to_disk) == (1, MiB, MiB)
    assert (second.bytes_from_disk, second.prefetch_hits, second.prefetch_misses) == (0, 0, 0)
    assert second.get_wait_seconds == 0


def test_a_steps_kept_for_want_of_room_counts_from_the_steps_start(
    make_store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Step 1 keeps a tensor in host memory because the disk has no room; step 2 keeps
    nothing new. Counted from the store's start, step 2 reported step 1's tensor as kept
    again, and so did every later step."""
    from tierstore.core import _disk_room

    store = make_store(device_bytes=0, host_bytes=MiB)
    hs = [store.put(_mib(0))]  # the host tier full
    monkeypatch.setattr(_disk_room, "free_bytes", lambda dirs: MiB // 4)  # the disk filled
    hs.append(store.put(_mib(1)))  # the older one cannot go down
    wait_for(lambda: settled(store))
    first = store.end_step()
    assert first.kept_no_room == 1
    store.release(store.put(torch.ones(0)))  # empty: stored in place
    second = store.end_step()
    assert second.puts == 1 and second.kept_no_room == 0


def test_a_steps_peak_for_each_tier_is_that_tiers_own(make_store: Any) -> None:
    """Three tensors rest in the host tier of a CPU store, whose device tier holds each one
    only while its put runs. The step's host peak is what the host tier held at most; given
    another tier's peak, it read as one tensor, not three."""
    store = make_store(device_bytes=0, host_bytes=16 * MiB)
    handles = [store.put(_mib(i)) for i in range(3)]
    step = store.step_stats()
    assert (step.peak_device_bytes, step.peak_host_bytes, step.peak_disk_bytes) == (
        MiB,
        3 * MiB,
        0,
    )
    assert len(handles) == 3  # held: the bytes stay in the host tier
