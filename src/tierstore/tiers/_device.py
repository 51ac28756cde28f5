"""Moving a tensor's bytes between its device and host memory.

On the CPU the host tier holds the tensor itself; a copy is made only when the tensor is a
view that would keep a larger storage alive, or carries a lazy conjugate/negative bit.
On CUDA, device-to-host copies run on a side stream ordered by events (see Note: [Copy
ordering on CUDA]).

Note: [Copy ordering on CUDA]
    ``put`` records an event on the *current* stream of the calling thread, read afresh every
    time (autograd's backward threads have their own current streams), and the side-stream
    copy waits on it, so the copy never reads bytes that compute has not finished writing.
    The entry keeps its device tensor until the copy's own event has completed, so the caching
    allocator cannot hand that memory to another tensor while the copy still reads it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

import torch

__all__ = [
    "as_bytes",
    "compact",
    "copy_to_device",
    "copy_to_host",
    "from_bytes",
    "host_buffer",
    "ready_event",
]

log = logging.getLogger("tierstore")

_side_streams: dict[int, Any] = {}
_side_lock = threading.Lock()
_pin_state: dict[str, bool] = {}


def compact(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when it owns exactly its storage; otherwise a compact contiguous copy.

    Keeping a view of a larger base would keep the whole base alive (Note: DESIGN invariant 2).
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
    """For a CUDA tensor, an event recorded on the caller's current stream; else None."""
    if t.device.type != "cuda":
        return None
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record(torch.cuda.current_stream(t.device))
    return event


def _side_stream(device: torch.device) -> Any:
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _side_lock:
        stream = _side_streams.get(index)
        if stream is None:
            stream = torch.cuda.Stream(device=index)  # type: ignore[no-untyped-call]
            _side_streams[index] = stream
        return stream


def host_buffer(nbytes: int, *, pinned: bool) -> torch.Tensor:
    """A ``uint8`` host buffer; pinned when asked and possible (warns once when not)."""
    if pinned and _pin_state.get("ok", True):
        try:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        except RuntimeError as exc:
            _pin_state["ok"] = False
            log.warning(
                "tierstore: pinning host memory failed (%s); falling back to pageable memory, "
                "so copies will be slower and synchronous",
                exc,
            )
    return torch.empty(nbytes, dtype=torch.uint8)


async def copy_to_host(t: torch.Tensor, ready: Any) -> torch.Tensor:
    """Copy a CUDA tensor into a new host buffer on a side stream; return the host tensor."""
    stream = _side_stream(t.device)
    buf = host_buffer(t.numel() * t.element_size(), pinned=True)
    host = from_bytes(buf, t.dtype, t.shape)
    src = t if t.is_contiguous() else t.contiguous()
    with torch.cuda.stream(stream):
        if ready is not None:
            stream.wait_event(ready)
        host.copy_(src, non_blocking=True)
        done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        done.record(stream)
    await _wait_event(done)
    return host


def copy_to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a host tensor to ``device`` on the caller's current stream (allocated there too)."""
    if device.type == "cpu":
        return host
    out = torch.empty(host.shape, dtype=host.dtype, device=device)
    out.copy_(host, non_blocking=False)
    return out


async def _wait_event(event: Any) -> None:
    # Polling keeps the event loop free; the first checks are cheap and copies are short.
    delay = 20e-6
    while not event.query():
        await asyncio.sleep(delay)
        delay = min(delay * 2, 1e-3)
