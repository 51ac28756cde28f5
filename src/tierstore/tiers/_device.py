"""Moving a tensor's bytes between its device and host memory.

On the CPU the host tier holds the tensor itself; a copy is made only when the tensor is a
view that would keep a larger storage alive, or carries a lazy conjugate/negative bit.
On an accelerator, copies run on per-device side streams ordered by events (Note: [Copy
ordering on an accelerator]); every runtime call goes through ``_accelerator.py``.

Note: [Copy ordering on an accelerator]
    Down (device to host): ``put`` records ``ready`` on the *current* stream of the calling
    thread, read afresh every time (autograd's backward threads have their own current
    streams). The copy runs on its device's "down" side stream, which first waits on
    ``ready``; everything the copy needs, making a non-contiguous source contiguous included,
    runs on that stream after the wait. (It once ran on the loop thread's current stream,
    after ``ready`` and outside the side stream: pool streams are non-blocking, so nothing
    ordered the copy after it, and the host received bytes that were not written yet.) The
    source stays referenced until the copy's own event has completed, even when the task is
    cancelled, so the caching allocator cannot give its memory to another tensor while the
    copy still reads it.

    Up (host to device, :func:`upload`): the destination is allocated on the consumer's
    stream, so that it is freed in the consumer's stream order after the consumer's reads.
    The caching allocator may hand out memory whose previous user's kernels are still queued
    on that stream, so the copy first waits on an event recorded there at allocation time.
    The copy runs on the device's "up" side stream, and its host source is kept busy until
    the copy's event has completed (``PinnedPool.hold``; PyTorch's own pinned allocator
    does the same for its buffers). Whoever takes the tensor waits on the copy's event on its
    own current stream (:func:`hand_over`); when that is not the stream the memory belongs
    to, the tensor is also recorded on it, so that its free waits for those reads too. A
    copy nobody takes (its entry released first) makes its memory's stream wait on the copy's
    event before the store drops it (:func:`discard`): the allocator would otherwise hand the
    memory to the next tensor on that stream while the copy still writes it.

Note: [Every stream that takes an upload]
    One upload can be taken on several streams: the adapters keep the tensor a get returned
    while any view of it lives, and two saved tensors of one storage may be unpacked by
    backward ops on different streams. The first hand-over used to forget the upload, so a
    second stream read the bytes with nothing ordering it after the copy. The upload is now
    remembered while the tensor lives, with the streams already ordered after it, and each
    new stream waits on its event once.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from tierstore._fork_safe_lock import ForkSafeLock
from tierstore.tiers import _accelerator

if TYPE_CHECKING:
    from tierstore.tiers._pinned import PinnedPool

__all__ = [
    "as_bytes",
    "compact",
    "copy_to_device",
    "copy_to_host",
    "current_stream",
    "discard",
    "forget_streams",
    "from_bytes",
    "hand_over",
    "host_buffer",
    "ready_event",
    "side_streams",
    "upload",
]

log = logging.getLogger("tierstore")

_side_streams: dict[tuple[str, int, str], Any] = {}
_side_lock = ForkSafeLock()
_pin_state: dict[str, bool] = {}
# Uploads while their tensor lives: the tensor -> (the copy's event, the stream it was allocated
# on, the streams already ordered after it; Note: [Every stream that takes an upload]).
_uploads: WeakIdKeyDictionary = WeakIdKeyDictionary()
_uploads_lock = ForkSafeLock()
# Host sources of uploads that have no pool to hold them: kept until their copy's event ends.
_held: list[tuple[Any, torch.Tensor]] = []


def compact(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when it owns exactly its storage; otherwise a compact contiguous copy.

    Keeping a view of a larger base would keep the whole base alive: releasing a tensor must
    free its storage, views of a larger base included.
    """
    if t.requires_grad:
        t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if (
        t.is_contiguous()
        and t.storage_offset() == 0
        and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    ):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A 1-D ``uint8`` view of a contiguous tensor's bytes (no copy; ``t`` if it is one)."""
    # Skipping the no-op views saves two tensor objects per spill (see from_bytes).
    if t.dtype == torch.uint8 and t.dim() == 1 and t.stride(0) == 1:
        return t
    # Not reshape(-1): a contiguous tensor may carry any stride on a dimension of size 1, and
    # reshape keeps it, which view(uint8) then refuses. Its bytes are in order either way.
    return t.as_strided((t.numel(),), (1,)).view(torch.uint8)


def from_bytes(buf: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """The tensor of ``dtype`` and ``shape`` whose bytes are ``buf`` (no copy; ``buf`` if it is).

    A view that changes nothing is skipped: each one is a tensor object made and tracked by
    the garbage collector, per tensor brought back.
    """
    t = buf if buf.dtype == dtype else buf.view(dtype)
    return t if t.shape == shape else t.reshape(shape)


def ready_event(t: torch.Tensor) -> Any:
    """For an accelerator tensor, an event recorded on the caller's current stream; else None."""
    if t.device.type == "cpu":
        return None
    event = _accelerator.new_event(t.device)
    event.record(_accelerator.current_stream(t.device))
    return event


def order_after_put(t: torch.Tensor, ready: Any, producer: Any) -> None:
    """Order the caller's current stream after ``ready``, the event recorded on ``producer``
    when ``t`` was put, where the caller's stream is another; ``t``'s memory, the producer's,
    is then freed only after the caller's work on it. A no-op on the CPU, on the producer's
    stream, or with no event.

    Note: [A get from another stream]
        A get of an entry still on its device hands back the caller's tensor (or a compact
        copy made on the caller's stream): the caller's stream must wait for the work that
        made it, as it waits for an upload from the other tiers (``hand_over``), and the
        memory must not return to the producer's stream while the caller's work reads it.
    """
    if t.device.type == "cpu" or ready is None:
        return
    cur = _accelerator.current_stream(t.device)
    if cur == producer:
        return
    cur.wait_event(ready)
    t.record_stream(cur)


def current_stream(device: torch.device) -> Any:
    """The calling thread's current stream on ``device`` (None on the CPU)."""
    if device.type == "cpu":
        return None
    return _accelerator.current_stream(device)


def _side_stream(device: torch.device, role: str) -> Any:
    """The side stream for ``role`` ("down" or "up") of ``device``: one of each per device."""
    key = (device.type, _accelerator.index_of(device), role)
    with _side_lock:
        stream = _side_streams.get(key)
        if stream is None:
            stream = _accelerator.new_stream(torch.device(device.type, key[1]))
            _side_streams[key] = stream
        return stream


def side_streams() -> dict[tuple[str, int, str], Any]:
    """The side streams made so far, by device type, device index and role."""
    with _side_lock:
        return dict(_side_streams)


def forget_streams() -> None:
    """Forget the side streams (after a fork, or when the runtime behind them was replaced)."""
    with _side_lock:
        _side_streams.clear()


def host_buffer(nbytes: int, *, pinned: bool) -> torch.Tensor:
    """A ``uint8`` host buffer; pinned when asked and possible (warns once when not)."""
    if pinned and _pin_state.get("ok", True):
        try:
            return _accelerator.pinned_empty(nbytes)
        except RuntimeError as exc:
            _pin_state["ok"] = False
            log.warning(
                "tierstore: pinning host memory failed (%s); falling back to pageable memory, "
                "so copies will be slower and synchronous",
                exc,
            )
    return torch.empty(nbytes, dtype=torch.uint8)


def _host_target(nbytes: int, pool: PinnedPool | None) -> torch.Tensor:
    if pool is not None:
        got = pool.take(nbytes)
        if got is not None:
            return got[1]
    return host_buffer(nbytes, pinned=pool is None)


async def copy_to_host(t: torch.Tensor, ready: Any, pool: PinnedPool | None = None) -> torch.Tensor:
    """Copy an accelerator tensor into host memory on a side stream; return the host tensor.

    Args:
        t: the tensor; it must stay alive until this returns (Note: [Copy ordering on an
            accelerator]).
        ready: the event ``put`` recorded on the stream that produced ``t``, or None.
        pool: the pinned pool to take the host buffer from (default: a pinned buffer of
            its own). A full pool falls back to pageable memory.

    Returns:
        A contiguous host tensor of ``t``'s dtype and shape, once the copy has completed.
    """
    stream = _side_stream(t.device, "down")
    buf = _host_target(t.numel() * t.element_size(), pool)
    host = from_bytes(buf, t.dtype, tuple(t.shape))
    done = _accelerator.new_event(t.device)
    # A lazy conj or neg bit is resolved before the copy: a non-blocking copy into pinned
    # memory moves the bytes and loses the bit (its host fix-up runs before the bytes land).
    with _accelerator.use_stream(stream):
        if ready is not None:
            stream.wait_event(ready)
        # After the wait, on the side stream (Note: [Copy ordering on an accelerator]).
        src = t.resolve_conj().resolve_neg()
        src = src if src.is_contiguous() else src.contiguous()
        host.copy_(src, non_blocking=True)
        done.record(stream)
    del src
    await _wait_event(done)
    return host


def upload(
    host: torch.Tensor, device: torch.device, consumer: Any, pool: PinnedPool | None = None
) -> torch.Tensor:
    """Start copying ``host`` to ``device`` for ``consumer``; return the device tensor at once.

    The destination is allocated on ``consumer`` (a stream of ``device``), and whoever takes
    the tensor must first call :func:`hand_over` in its own thread (Note: [Copy ordering on
    an accelerator]). ``host`` is kept busy until the copy has completed: by ``pool`` when
    given, else by this module.
    """
    side = _side_stream(device, "up")
    with _accelerator.use_stream(consumer):
        out = torch.empty(host.shape, dtype=host.dtype, device=device)
        allocated = _accelerator.new_event(device)
        allocated.record(consumer)
    done = _accelerator.new_event(device)
    with _accelerator.use_stream(side):
        side.wait_event(allocated)
        out.copy_(host, non_blocking=True)
        done.record(side)
    if pool is not None:
        pool.hold(host, done)
    else:
        _hold(host, done)
    with _uploads_lock:
        _uploads[out] = (done, consumer, [])
    return out


def hand_over(t: torch.Tensor) -> None:
    """Order the caller's current stream after the upload that made ``t`` (no-op otherwise).

    Call it in the thread that will use ``t``, before using it, on every stream that will
    use it: each stream is ordered once (Note: [Every stream that takes an upload]).
    """
    if t.device.type == "cpu":
        return
    # Under the lock, the wait queued before the stream is marked: a second thread on the
    # same stream must not find it marked and read before the wait is in the stream's order.
    # These calls only enqueue work.
    with _uploads_lock:
        _order_after_upload(t, _accelerator.current_stream(t.device))


def discard(t: torch.Tensor) -> None:
    """Let ``t``, an upload nobody took, be freed: its memory's stream waits for the copy.

    The caching allocator reuses freed memory on the stream it belongs to at once; without
    this, a later tensor there could be written by the copy still running on the up stream.
    The upload stays remembered while ``t`` lives: a getter that took it just before its
    entry was released (or the store closed) still hands it over on its own stream.
    """
    if t.device.type == "cpu":
        return
    with _uploads_lock:
        pending = _uploads.get(t, None)  # type: ignore[no-untyped-call]
        if pending is not None:
            _order_after_upload(t, pending[1])


def _order_after_upload(t: torch.Tensor, stream: Any) -> None:
    """Make ``stream`` wait on the copy that made ``t``, once (``_uploads_lock`` held)."""
    pending = _uploads.get(t, None)  # type: ignore[no-untyped-call]
    if pending is None:
        return
    done, owner, ordered = pending
    if any(stream == s for s in ordered):
        return
    stream.wait_event(done)
    if stream != owner:
        # Its memory returns to ``owner``'s pool when freed; make the free wait for us too.
        t.record_stream(stream)
    ordered.append(stream)


def copy_to_device(
    host: torch.Tensor, device: torch.device, pool: PinnedPool | None = None
) -> torch.Tensor:
    """``host`` on ``device``, for the caller's current stream (``host`` itself on the CPU).

    On an accelerator the copy is asynchronous: it is queued and ordered before the caller's
    later work on its current stream, and this returns without waiting for it. ``pool``
    holds ``host`` until the copy has ended (default: this module does).
    """
    if device.type == "cpu":
        return host
    out = upload(host, device, _accelerator.current_stream(device), pool)
    hand_over(out)
    return out


def _hold(t: torch.Tensor, event: Any) -> None:
    with _uploads_lock:
        _held[:] = [(ev, h) for ev, h in _held if not ev.query()]
        _held.append((event, t))


async def _wait_event(event: Any) -> None:
    # Polling keeps the event loop free; the first checks are cheap and copies are short.
    delay = 20e-6
    try:
        while not event.query():
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1e-3)
    except asyncio.CancelledError:
        # The caller drops the source and the destination once we return: not before the
        # copy that reads and writes them has ended.
        event.synchronize()
        raise
