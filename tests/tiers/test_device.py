"""The byte-view helpers the store moves tensors with (tiers/_device.py), on the CPU."""

from __future__ import annotations

import torch

from tierstore.tiers._device import as_bytes, compact, from_bytes


def test_as_bytes_of_a_byte_tensor_is_the_tensor_itself() -> None:
    t = torch.arange(10, dtype=torch.uint8)
    assert as_bytes(t) is t


def test_as_bytes_views_any_other_tensor_without_a_copy() -> None:
    t = torch.randn(3, 5).to(torch.bfloat16)
    b = as_bytes(t)
    assert b.dtype == torch.uint8 and b.shape == (30,)
    assert b.data_ptr() == t.data_ptr()
    assert torch.equal(from_bytes(b, t.dtype, t.shape), t)


def test_from_bytes_skips_the_views_that_change_nothing() -> None:
    buf = torch.arange(8, dtype=torch.uint8)
    assert from_bytes(buf, torch.uint8, torch.Size([8])) is buf
    as_int = from_bytes(buf, torch.int32, torch.Size([2]))
    assert as_int.dtype == torch.int32 and as_int.shape == (2,)
    reshaped = from_bytes(buf, torch.uint8, torch.Size([2, 4]))
    assert reshaped.shape == (2, 4) and reshaped.data_ptr() == buf.data_ptr()


def test_compact_keeps_a_tensor_that_owns_its_storage_and_drops_autograd() -> None:
    leaf = torch.randn(16, requires_grad=True)
    kept = compact(leaf)
    assert not kept.requires_grad
    assert kept.data_ptr() == leaf.data_ptr()
    plain = torch.randn(16)
    assert compact(plain) is plain


def test_compact_copies_a_view_of_a_larger_base() -> None:
    base = torch.randn(64)
    view = base[8:24]
    small = compact(view)
    assert small.untyped_storage().nbytes() == 16 * 4
    assert torch.equal(small, view)
