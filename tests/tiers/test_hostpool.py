"""HostPool: a read buffer is reused only once no tensor or view refers to it."""

from __future__ import annotations

import gc

import torch

from tierstore.tiers._hostpool import HostPool

MiB = 1 << 20


def test_buffers_are_page_aligned_and_sized() -> None:
    pool = HostPool(keep_bytes=64 * MiB)
    for n in (1, 4095, 4096, 4097, 3 * MiB + 5):
        t = pool.take(n)
        assert t.dtype is torch.uint8 and t.numel() == n
        assert t.data_ptr() % 4096 == 0


def test_a_buffer_in_use_is_never_handed_out_again() -> None:
    pool = HostPool(keep_bytes=64 * MiB)
    a = pool.take(MiB)
    a.fill_(7)
    view = a[100:200].view(torch.int16)  # a view alone keeps the buffer busy
    del a
    gc.collect()
    b = pool.take(MiB)
    b.fill_(9)
    assert torch.all(view == 0x0707), "a buffer still used by a view was overwritten"
    assert pool.created == 2 and pool.reused == 0


def test_a_freed_buffer_is_reused() -> None:
    pool = HostPool(keep_bytes=64 * MiB)
    a = pool.take(MiB)
    ptr = a.data_ptr()
    del a
    b = pool.take(MiB - 10)  # same page-rounded size class
    assert b.data_ptr() == ptr
    assert pool.reused == 1 and pool.created == 1


def test_free_buffers_beyond_keep_bytes_are_unmapped() -> None:
    pool = HostPool(keep_bytes=4 * MiB)
    held = [pool.take(MiB) for _ in range(4)]
    del held
    pool.take(2 * MiB)  # another size: the four free 1 MiB buffers make room
    assert pool.mapped_bytes <= 4 * MiB
    busy = [pool.take(3 * MiB) for _ in range(3)]  # buffers in use are never unmapped
    assert all(int(t.sum()) == 0 for t in busy)
    assert pool.mapped_bytes >= 9 * MiB
