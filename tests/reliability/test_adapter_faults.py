"""Disk faults under the training adapter: gradients stay bit-exact, errors name the tensor."""

from __future__ import annotations

import errno
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn

import tierstore
from tierstore import SpillIOError, TieredStore
from tierstore.core import _disk_room as disk_room
from tierstore.testing import audit, install_faults, settled, wait_for

KiB = 1 << 10
MakeStore = Callable[..., TieredStore]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(128, 128), nn.Tanh())])


def _grads(model: nn.Module, store: TieredStore | None) -> list[torch.Tensor]:
    x = torch.randn(256, 128, generator=torch.Generator().manual_seed(1))
    model.zero_grad()
    if store is None:
        loss = model(x).square().sum()
    else:
        with tierstore.offload_activations(store, min_bytes=0):
            loss = model(x).square().sum()
        wait_for(lambda: settled(store))
    loss.backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_failing_disk_writes_keep_gradients_bit_exact(
    make_store: MakeStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(disk_room, "RETRY_SECONDS", 0.01)
    expected = _grads(_model(), None)
    store = make_store(device_bytes=0, host_bytes=256 * KiB)
    faulty = install_faults(store)
    faulty.fail_writes(errno.ENOSPC)
    with warnings.catch_warnings():
        # The adapter warns once when a tensor stays in place for lack of room.
        warnings.filterwarnings("ignore", "tierstore: no tier had room", RuntimeWarning)
        got = _grads(_model(), store)
    assert faulty.failed_writes > 0
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)
    audit(store)


def test_failing_disk_read_in_backward_raises_naming_the_tensor(make_store: MakeStore) -> None:
    store = make_store(device_bytes=0, host_bytes=0)
    faulty = install_faults(store)
    model = _model()
    x = torch.randn(256, 128)
    with tierstore.offload_activations(store, min_bytes=0):
        loss = model(x).square().sum()
    wait_for(lambda: settled(store) and store.stats().disk.entries > 0)
    faulty.fail_reads(errno.EIO)
    with pytest.raises(SpillIOError, match=r"tensor #\d+"):
        loss.backward()
