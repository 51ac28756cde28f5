"""The store's GPU path on the stream simulator (tests/gpusim): exact bytes, no unordered access.

Every test runs under both schedules (Note: [Copy ordering on an accelerator] in
``tiers/_device.py`` says what each ordering rule protects; the lazy schedule shows a missing
wait as stale bytes, the eager one shows an early free or overwrite as poison), and the
simulator's race checker fails the test on any access it cannot order, whichever schedule
hid it. Tensors live on ``cuda:0`` and ``cuda:1`` and come contiguous and strided.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

import tierstore
from tierstore import Tier
from tierstore.tiers import _accelerator, _device

gpusim = pytest.importorskip("gpusim")

MiB = 1 << 20
DEVICES = ("cuda:0", "cuda:1")
LAYOUTS = ("contiguous", "strided")


@pytest.fixture(params=["lazy", "eager"])
def gpu(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[gpusim.Simulator]:
    """A simulated pair of GPUs; the race checker must stay silent for the test to pass."""
    from tierstore import _core
    from tierstore.adapters import _storage

    check, reason = _core._check_tensor, _storage.unsupported_reason

    # The store refuses tensor subclasses; the simulator's stands in for a plain device tensor.
    def check_tensor(t: object) -> None:
        if isinstance(t, gpusim.SimTensor):
            if not _accelerator.is_accelerator(t.device):
                raise tierstore.UnsupportedTensorError(f"{t.device} is no accelerator")
            return
        check(t)

    def unsupported(t: torch.Tensor) -> str | None:
        return None if isinstance(t, gpusim.SimTensor) else reason(t)

    monkeypatch.setattr(_core, "_check_tensor", check_tensor)
    monkeypatch.setattr(_storage, "unsupported_reason", unsupported)
    _device._side_streams.clear()
    try:
        with gpusim.simulate(request.param, legacy=True) as sim:
            yield sim
    except gpusim.Unsupported as exc:
        pytest.skip(str(exc))
    finally:
        _device._side_streams.clear()


@pytest.fixture
def stores(gpu: gpusim.Simulator, disk_dir: Path) -> Iterator[Callable[..., tierstore.TieredStore]]:
    """Stores on the simulated GPUs, closed (and audited) before the simulator ends."""
    made: list[tierstore.TieredStore] = []

    def make(tier: str = "host", **overrides: object) -> tierstore.TieredStore:
        settings: dict[str, object] = {
            "device": {"device_bytes": "unlimited"},
            "host": {"device_bytes": 0, "host_bytes": 64 * MiB},
            "disk": {"device_bytes": 0, "host_bytes": 0},
        }[tier]
        settings = {**settings, "min_bytes": 0, "disk_dir": disk_dir, **overrides}
        store = tierstore.TieredStore(**settings)  # type: ignore[arg-type]
        made.append(store)
        return store

    yield make
    gc.collect()
    for store in made:
        store._core.audit()
        store.close()


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


def test_a_missing_wait_shows_in_the_bytes_or_the_checker(gpu: gpusim.Simulator) -> None:
    x = torch.ones(1024, device="cuda:0") * 2
    side = torch.Stream(device="cuda:0")
    host = torch.empty(1024, pin_memory=True)
    with side:  # no side.wait_stream(...) before reading x
        host.copy_(x, non_blocking=True)
    side.synchronize()
    stale = not torch.equal(host, torch.full((1024,), 2.0))
    assert stale == (gpu.schedule == "lazy")
    assert gpu.errors, "the race checker missed a read of memory another stream writes"
    gpu.errors.clear()


def test_an_early_free_shows_in_the_bytes_or_the_checker(gpu: gpusim.Simulator) -> None:
    side = torch.Stream(device="cuda:1")
    x = torch.full((256,), 5.0, device="cuda:1")
    side.wait_stream(torch.accelerator.current_stream("cuda:1"))
    host = torch.empty(256, pin_memory=True)
    with side:
        host.copy_(x, non_blocking=True)
    del x  # freed while the side stream may still read it; no record_stream
    side.synchronize()
    poisoned = bool(torch.isnan(host).any())
    assert poisoned == (gpu.schedule == "eager")
    assert gpu.errors, "the race checker missed a free before a read on another stream ended"
    gpu.errors.clear()


def test_query_says_not_ready_first_and_the_stream_is_per_thread(gpu: gpusim.Simulator) -> None:
    import threading

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


# ------------------------------------------------------------------ device copies


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_put_get_through_each_tier(
    stores: Callable[..., tierstore.TieredStore], device: str, layout: str
) -> None:
    """Note: [Copy ordering on an accelerator]: each tier returns the bytes compute wrote,
    on the tensor's own device index, as a tensor that owns exactly its bytes."""
    for tier in ("device", "host", "disk"):
        store = stores(tier)
        t, want = produced(device, layout, seed=len(tier))
        h = store.put(t)
        expected = {"device": Tier.DEVICE, "host": Tier.HOST, "disk": Tier.DISK}[tier]
        assert rests(store, h) is expected
        got = store.get(h)
        assert got.device == torch.device(device)
        assert got.is_contiguous() and got.storage_offset() == 0
        assert got.untyped_storage().nbytes() == want.numel() * want.element_size()
        assert torch.equal(on_host(got), want), tier
        del got
        store.release(h)
