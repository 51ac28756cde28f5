"""What a get of one entry returns right now, or the future it waits on.

Note: [What get returns]
    ``get`` returns a contiguous tensor with the dtype, shape and device of the tensor that
    was put, bit for bit, whose storage holds exactly its bytes: ``storage_offset() == 0``
    and ``untyped_storage().nbytes() == nbytes``. Nothing of any other tensor can be reached
    through it (``torch.save`` writes exactly its bytes), and code that rebuilds views of it
    with ``as_strided`` may count offsets from 0. Every path keeps this: a read from disk
    lands in a pooled buffer wider than the tensor (the engine reads whole pages) and hands
    back a tensor made on exactly the tensor's bytes inside it; a tensor still resting where
    it was put comes back as itself when it already owns exactly its storage, and as a
    compact copy when it is a view. Storage from the read pool cannot grow (as with
    ``torch.frombuffer``): ``resize_`` to a larger size raises, so ``clone()`` it first to use
    it as a resizable ``out=``. The adapters rely on this contract, and the differential tests
    in ``tests/adapters/test_bitexact.py`` cover every path it has.
"""

from __future__ import annotations

import concurrent.futures as cf
from typing import TYPE_CHECKING

from tierstore._state import TRANSIT, TensorState
from tierstore.tiers._device import compact, copy_to_device, hand_over, order_after_put

if TYPE_CHECKING:
    import torch

    from tierstore.core._core import StoreCore
    from tierstore.core._entries import Entry

__all__ = ["read_now"]

S = TensorState


def read_now(core: StoreCore, e: Entry) -> torch.Tensor | cf.Future[torch.Tensor]:
    """The tensor a get of ``e`` returns, or the future of it (the store's lock held).

    Raises:
        CorruptTensorError: the spilled copy was found corrupt.
        TensorModifiedError: the tensor the store holds changed after put (Note: [Writes
            after put]).
    """
    st = core.counters
    state = e.state
    if state is S.FAILED:
        raise e.failure()  # Note: [A failed entry raises a copy]
    if state is S.FETCHED:
        assert e.fetched is not None
        out = e.fetched
        hand_over(out)  # the caller's stream waits for the copy (no-op on the CPU)
        core.consume(e)
        st.prefetch_hits += 1
        st.gets += 1
        return out
    if state is S.FETCHING:
        if e.fetch_future is None:  # a prefetch nobody waited on so far
            e.fetch_future = cf.Future()
        st.prefetch_hits += 1
        return e.fetch_future
    source = e.data if e.data is not None else e.host
    if source is not None and (source.device == e.device or e.on_cpu):
        # Resting on its device, or on the CPU where host memory is the device, or moving
        # down with its source still intact.
        if not core.table.check_unchanged(e, source, io_done=state not in TRANSIT):
            raise e.failure()
        st.prefetch_hits += 1
        st.gets += 1
        if not e.on_cpu:
            # Before the compact copy, which runs on the caller's stream.
            order_after_put(source, e.ready, e.stream)  # Note: [A get from another stream]
        return compact(source)  # Note: [What get returns]
    if source is not None and state in (S.HOST, S.MOVING_TO_DISK):
        # An accelerator tensor in host memory (perhaps being written to disk): queue the
        # copy back on the caller's stream and return; nothing waits for it here.
        st.prefetch_misses += 1
        st.gets += 1
        st.bytes_to_device += e.nbytes
        return copy_to_device(source, e.device, core.pinned)
    st.prefetch_misses += 1
    fut: cf.Future[torch.Tensor] = cf.Future()
    core.start_fetch(e, fut)
    return fut
