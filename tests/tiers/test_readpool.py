"""ReadPool: a read buffer is reused only once no tensor or view refers to it."""

from __future__ import annotations

import gc
import threading
from pathlib import Path

import pytest
import torch

from tierstore.tiers import _readpool
from tierstore.tiers._readpool import ReadPool

MiB = 1 << 20


def test_buffers_are_page_aligned_and_sized() -> None:
    pool = ReadPool(keep_bytes=64 * MiB)
    for n in (1, 4095, 4096, 4097, 3 * MiB + 5):
        window, t = pool.take(n)
        assert window is t
        assert t.dtype is torch.uint8 and t.numel() == n
        assert t.data_ptr() % 4096 == 0


def test_a_buffer_in_use_is_never_handed_out_again() -> None:
    pool = ReadPool(keep_bytes=64 * MiB)
    a = pool.take(MiB)[1]
    a.fill_(7)
    view = a[100:200].view(torch.int16)  # a view alone keeps the buffer busy
    del a
    gc.collect()
    _, b = pool.take(MiB)
    b.fill_(9)
    assert torch.all(view == 0x0707), "a buffer still used by a view was overwritten"
    assert pool.created == 2 and pool.reused == 0


def test_a_freed_buffer_is_reused() -> None:
    pool = ReadPool(keep_bytes=64 * MiB)
    a = pool.take(MiB)[1]
    ptr = a.data_ptr()
    del a
    b = pool.take(MiB - 10)[1]  # same page-rounded size class
    assert b.data_ptr() == ptr
    assert pool.reused == 1 and pool.created == 1


def test_free_buffers_beyond_keep_bytes_are_unmapped() -> None:
    pool = ReadPool(keep_bytes=4 * MiB)
    held = [pool.take(MiB) for _ in range(4)]
    del held
    pool.take(2 * MiB)  # another size: the four free 1 MiB buffers make room
    assert pool.mapped_bytes <= 4 * MiB
    busy = [pool.take(3 * MiB)[1] for _ in range(3)]  # buffers in use are never unmapped
    assert all(int(t.sum()) == 0 for t in busy)
    assert pool.mapped_bytes >= 9 * MiB


def test_data_at_a_lead_owns_exactly_its_bytes() -> None:
    """Note: [What get returns]: the data is a storage of its own bytes inside the window."""
    pool = ReadPool(keep_bytes=64 * MiB)
    n, lead = 3 * MiB + 5, 64
    window, data = pool.take(n, lead=lead, span=n + lead + 4000)
    assert window.data_ptr() % 4096 == 0 and window.numel() == n + lead + 4000
    assert data.storage_offset() == 0 and data.untyped_storage().nbytes() == n
    assert data.data_ptr() == window.data_ptr() + lead
    window[lead : lead + n].fill_(3)
    window[:lead].fill_(1)
    assert torch.all(data == 3)  # the bytes around it are not part of it


def test_the_data_alone_keeps_the_buffer_busy() -> None:
    pool = ReadPool(keep_bytes=64 * MiB)
    window, data = pool.take(MiB, lead=128, span=MiB + 4096)
    del window
    gc.collect()
    _, other = pool.take(MiB, lead=128, span=MiB + 4096)
    assert other.data_ptr() != data.data_ptr()
    del data, other
    _, again = pool.take(MiB, lead=128, span=MiB + 4096)
    assert pool.reused == 1 and again.numel() == MiB


def test_a_lead_that_does_not_fit_is_refused() -> None:
    pool = ReadPool(keep_bytes=64 * MiB)
    with pytest.raises(ValueError, match="do not fit"):
        pool.take(MiB, lead=64, span=MiB)


def test_shrink_unmaps_free_buffers_largest_first_and_never_a_busy_one() -> None:
    """Note: [A finished sweep hands its buffers back]."""
    pool = ReadPool(keep_bytes=64 * MiB)
    busy = pool.take(4 * MiB)[1]
    busy.fill_(5)
    free = [pool.take(n)[1] for n in (8 * MiB, 4 * MiB, 64 * 1024, 64 * 1024)]
    del free
    assert pool.mapped_bytes == 16 * MiB + 128 * 1024
    assert pool.shrink(keep_free=MiB) == 12 * MiB  # the two big free ones, not the small ones
    assert pool.mapped_bytes == 4 * MiB + 128 * 1024
    assert pool.shrink(keep_free=0) == 128 * 1024
    assert pool.mapped_bytes == 4 * MiB and torch.all(busy == 5)
    del busy
    assert pool.shrink(keep_free=0) == 4 * MiB and pool.mapped_bytes == 0


def test_shrink_keeps_free_buffers_within_keep_free() -> None:
    pool = ReadPool(keep_bytes=64 * MiB)
    pool.take(256 * 1024)  # taken and dropped at once
    assert pool.shrink() == 0  # SWEEP_KEEP_BYTES: one small buffer stays for reuse
    pool.take(256 * 1024)
    assert pool.reused == 1


def test_a_buffer_freed_in_another_thread_is_reused() -> None:
    """The release callback runs in whatever thread drops the last tensor (autograd's own)."""
    pool = ReadPool(keep_bytes=64 * MiB)
    got = pool.take(64 * 1024)
    assert got is not None
    ptr = got[1].data_ptr()
    holder = [got]
    del got
    worker = threading.Thread(target=holder.clear)
    worker.start()
    worker.join()
    again = pool.take(64 * 1024)
    assert again is not None and again[1].data_ptr() == ptr
    assert pool.reused == 1 and pool.created == 1


def test_take_costs_the_same_however_many_buffers_are_held() -> None:
    """Free buffers wait on lists: with thousands of small tensors read back and held, the pool
    no longer looks at any busy buffer to find a free one."""
    pool = ReadPool(keep_bytes=64 * MiB)
    held = [pool.take(64 * 1024) for _ in range(2000)]
    assert len(pool._busy) == 2000 and not any(pool._free.values())
    last = held.pop()
    assert last is not None
    ptr = last[1].data_ptr()
    del last
    assert [len(f) for f in pool._free.values()] == [1]  # handed back at once, no scan
    again = pool.take(64 * 1024)
    assert again is not None and again[1].data_ptr() == ptr


def test_a_pool_at_its_buffer_cap_gives_none() -> None:
    pool = ReadPool(keep_bytes=64 * MiB, max_buffers=2)
    a, b = pool.take(MiB), pool.take(2 * MiB)
    assert a is not None and b is not None
    assert pool.take(MiB) is None  # the caller allocates plainly
    del a
    assert pool.take(MiB) is not None  # a free one of that size is still handed out
    del b
    c = pool.take(3 * MiB)  # the free 2 MiB one is unmapped to make room
    assert c is not None and pool.buffers == 2 and pool.mapped_bytes == 4 * MiB


def test_a_tensor_dying_after_clear_does_not_come_back() -> None:
    pool = ReadPool(keep_bytes=64 * MiB)
    got = pool.take(3 * MiB)
    assert got is not None
    pool.clear()
    del got
    gc.collect()
    assert pool.take(3 * MiB) is not None
    assert pool.created == 2 and pool.reused == 0 and pool.mapped_bytes == 3 * MiB


def test_a_tensor_dying_while_clear_runs_has_its_buffer_unmapped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A tensor dies on another thread while ``clear`` unmaps the free buffers: its buffer
    went back into the free list being iterated ("deque mutated during iteration", and the
    store's close failed), or, after the lists were swapped, stayed mapped. Here the death
    comes from inside the first unmap, as a thread switch would put it."""
    pool = ReadPool(keep_bytes=64 * MiB)
    first, second = pool.take(3 * MiB), pool.take(3 * MiB)
    assert first is not None and second is not None
    busy_address = second[0].data_ptr()
    del first  # free
    held = [second]
    del second
    real = _readpool._unmap

    def unmap_then_a_tensor_dies(buffer: object) -> None:
        real(buffer)  # type: ignore[arg-type]
        held.clear()

    monkeypatch.setattr(_readpool, "_unmap", unmap_then_a_tensor_dies)
    pool.clear()
    assert not held and not _mapped(busy_address)
    assert pool.mapped_bytes == 0 and pool.buffers == 0


# -- Note: [Small buffers share huge pages] ---------------------------------------------------


def _mapped(address: int) -> bool:
    """Whether ``address`` lies in a mapping of this process."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        start, end = (int(x, 16) for x in line.split()[0].split("-"))
        if start <= address < end:
            return True
    return False


def test_buffers_of_512_kib_to_1_mib_are_pieces_of_one_huge_page_slab() -> None:
    pool = ReadPool(keep_bytes=64 * MiB)
    a, b = pool.take(MiB)[1], pool.take(MiB)[1]
    assert abs(a.data_ptr() - b.data_ptr()) == MiB  # the two halves of one 2 MiB slab
    assert pool.mapped_bytes == 2 * MiB and pool.buffers == 2 and pool.created == 2
    a.fill_(1)
    b.fill_(2)
    c = pool.take(512 * 1024)[1]  # another size: a slab of its own
    c.fill_(3)
    assert pool.mapped_bytes == 4 * MiB
    ptr = a.data_ptr()
    del a
    again = pool.take(MiB)[1]  # the freed piece comes back; its neighbour is untouched
    assert again.data_ptr() == ptr and pool.reused == 1
    assert torch.all(b == 2) and torch.all(c == 3)


def test_a_slab_is_unmapped_when_its_last_piece_goes_and_never_under_a_busy_one() -> None:
    pool = ReadPool(keep_bytes=64 * MiB)
    a, b = pool.take(MiB)[1], pool.take(MiB)[1]
    b.fill_(7)
    address = a.data_ptr()
    del a
    assert pool.shrink(keep_free=0) == MiB  # the free piece is let go, its slab stays
    assert _mapped(address) and torch.all(b == 7)
    del b
    gc.collect()
    assert pool.shrink(keep_free=0) == MiB and pool.mapped_bytes == 0
    assert not _mapped(address)


def test_a_slab_placed_off_a_huge_page_boundary_is_cut_at_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Kernels before 6.7 place a 2 MiB mapping on any page, where no huge page fits in it;
    the first mapping is made to look so, as there."""
    real = _readpool._address
    looked: list[int] = []

    def off_the_boundary_first(view: memoryview) -> int:
        looked.append(real(view))
        return looked[-1] + (4096 if len(looked) in (1, 3) else 0)

    monkeypatch.setattr(_readpool, "_address", off_the_boundary_first)
    pool = ReadPool(keep_bytes=64 * MiB)
    a, b = pool.take(MiB)[1], pool.take(MiB)[1]
    assert len(looked) == 2  # mapped again, twice as large
    assert min(a.data_ptr(), b.data_ptr()) % (2 * MiB) == 0
    assert abs(a.data_ptr() - b.data_ptr()) == MiB
    a.fill_(1)
    b.fill_(2)
    assert torch.all(a == 1) and torch.all(b == 2)
    assert pool.mapped_bytes == 2 * MiB  # the half never touched is not counted
    address = a.data_ptr()
    del a, b
    gc.collect()
    assert pool.shrink(keep_free=0) == 2 * MiB and not _mapped(address)
    big = pool.take(6 * MiB)[1]  # a buffer of its own, cut at a boundary too
    assert len(looked) == 4 and big.data_ptr() % (2 * MiB) == 0
    big.fill_(3)
    assert torch.all(big == 3) and pool.mapped_bytes == 6 * MiB


@pytest.mark.parametrize("size", [256 * 1024, 768 * 1024, MiB + 4096])
def test_other_sizes_under_2_mib_get_maps_of_their_own(size: int) -> None:
    pool = ReadPool(keep_bytes=64 * MiB)
    held = [pool.take(size)[1] for _ in range(2)]
    assert pool.mapped_bytes == 2 * size and len(held) == 2


def test_shrink_unmaps_a_slabs_pieces_never_taken() -> None:
    """One 512 KiB read cuts a 2 MiB slab in four pieces; three were never taken. They are
    free memory like the freed piece, and the sweep's end unmaps them all. Counted as busy,
    the slab's untouched pieces kept it mapped after the sweep."""
    pool = ReadPool(keep_bytes=64 * MiB)
    window, data = pool.take(512 << 10)
    del window, data
    assert pool.shrink(keep_free=0) == 2 * MiB
    assert pool.mapped_bytes == 0 and pool.buffers == 0


def test_a_mapping_off_a_huge_page_boundary_is_cut_at_the_next_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every mapping lands one page past a 2 MiB boundary (as older kernels may place it):
    the wider mapping made again must be cut at the next boundary, not as far before one."""
    real_new_map = _readpool._new_map
    huge = 2 * MiB
    kept: list[object] = []

    def one_page_off(size: int) -> memoryview:
        whole = memoryview(real_new_map(size + 2 * huge))
        kept.append(whole)
        start = -_readpool._address(whole) % huge + _readpool._PAGE
        return whole[start : start + size]

    monkeypatch.setattr(_readpool, "_new_map", one_page_off)
    cut = _readpool._new_huge(4 * MiB)
    assert len(cut) == 4 * MiB and _readpool._address(cut) % huge == 0
