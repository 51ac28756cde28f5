"""The simulator's scenarios and training checks on a real GPU, under PyTorch's CUDA Stream
Sanitizer (skipped without CUDA). Run them on any machine that has one:

    TORCH_CUDA_SANITIZER=1 python -m pytest tests/tiers/test_device_gpu.py
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import tierstore

from .test_device_sim import (
    Env,
    assert_same,
    batch_on,
    get_from_host,
    model_on,
    prefetched_on_another_stream,
    prefetched_then_released,
    put_get_each_tier,
    spilled_through_pinned_memory,
    step,
)

pytestmark = pytest.mark.gpu

SCENARIOS = {
    f.__name__: f
    for f in (
        put_get_each_tier,
        get_from_host,
        prefetched_on_another_stream,
        prefetched_then_released,
        spilled_through_pinned_memory,
    )
}


def devices() -> list[str]:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 1
    return sorted({"cuda:0", f"cuda:{count - 1}"})


@pytest.fixture
def env(disk_dir: Path) -> Iterator[Env]:
    from torch.cuda import _sanitizer

    if not _sanitizer.cuda_sanitizer.enabled:
        _sanitizer.enable_cuda_sanitizer()
    e = Env(None, disk_dir)  # type: ignore[arg-type]
    with contextlib.ExitStack() as stack:
        stack.callback(lambda: [s.close() for s in e.made])
        yield e
    torch.cuda.synchronize()


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_device_copies_on_a_gpu(env: Env, scenario: str, device: str, layout: str) -> None:
    SCENARIOS[scenario](env, device, layout)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_training_on_a_gpu_equals_no_offloading(env: Env, device: str, layout: str) -> None:
    model, x = model_on(device), batch_on(device, layout)
    plain = step(model, x)
    store = env.store("tiered")
    hooks = step(model, x, wrap=lambda: tierstore.offload_activations(store, min_bytes=0))
    ckpt = step(model, x, layer=lambda block, h: tierstore.checkpoint(block, h, store=store))
    assert_same(hooks, plain)
    assert_same(ckpt, plain)


@pytest.mark.parametrize("bit", ["conj", "neg"])
def test_a_tensor_with_a_lazy_bit_comes_back_resolved_on_a_gpu(env: Env, bit: str) -> None:
    """What the simulator assumes of CUDA: a non-blocking copy into pinned memory loses a
    lazy conj or neg bit; the store resolves it first."""
    x = torch.complex(torch.arange(8.0), torch.arange(8.0) + 0.5).to("cuda:0")
    t = x.conj() if bit == "conj" else torch._neg_view(torch.arange(8.0, device="cuda:0"))
    want = t.resolve_conj().resolve_neg().cpu()
    store = env.store("host", host_bytes="unlimited")
    h = store.put(t)
    assert torch.equal(store.get(h).cpu(), want)
