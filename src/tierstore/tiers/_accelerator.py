"""The one module that talks to the accelerator runtime.

Every stream, event, current-stream and current-device call the store makes, and every pinned
host buffer it allocates, goes through these functions; nothing else in the package touches
``torch.cuda``. They use the device-generic API (``torch.Stream``, ``torch.Event``,
``torch.accelerator``) where torch has it (2.6 and later), so the same code serves CUDA, ROCm
(whose device type is also ``"cuda"``) and XPU, and fall back to ``torch.cuda`` on older
torch.

Every name is looked up on ``torch`` when called, never bound at import: the current stream is
per thread and changes under the caller (Note: [Copy ordering on an accelerator]), and the
stream simulator the tests run on replaces these entry points of torch for the length of a
test.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = [
    "accelerator_type",
    "current_stream",
    "device_names",
    "index_of",
    "is_accelerator",
    "new_event",
    "new_stream",
    "pinned_empty",
    "use_stream",
]

Stream = Any
"""A ``torch.Stream`` (or, on torch before 2.6, a ``torch.cuda.Stream``)."""
Event = Any
"""A ``torch.Event`` (or a ``torch.cuda.Event``)."""


def _generic() -> bool:
    # torch.accelerator arrived in 2.6, together with streams usable as context managers.
    return hasattr(torch, "accelerator") and hasattr(torch.Stream, "__enter__")


def accelerator_type() -> str | None:
    """The device type of this machine's accelerator (``"cuda"``, ``"xpu"``...), or None."""
    if _generic():
        if not torch.accelerator.is_available():
            return None
        device = torch.accelerator.current_accelerator()
        return None if device is None else device.type
    return "cuda" if torch.cuda.is_available() else None


def device_names() -> list[str]:
    """The names of the accelerator's devices, by index (empty without one)."""
    kind = accelerator_type()
    if kind is None:
        return []
    module: Any = torch.get_device_module(kind) if _generic() else torch.cuda
    return [str(module.get_device_name(i)) for i in range(module.device_count())]


def is_accelerator(device: torch.device) -> bool:
    """Whether ``device`` is on this machine's accelerator (the CPU never is)."""
    return device.type != "cpu" and device.type == accelerator_type()


def index_of(device: torch.device) -> int:
    """``device``'s index; the current device's when it names none (``cuda`` alone)."""
    index: int | None = device.index  # None for a bare "cuda"
    if index is not None:
        return index
    if _generic():
        return torch.accelerator.current_device_index()
    return torch.cuda.current_device()


def current_stream(device: torch.device) -> Stream:
    """The calling thread's current stream on ``device``, read now (it is per thread)."""
    if _generic():
        return torch.accelerator.current_stream(device)
    return torch.cuda.current_stream(device)


def new_stream(device: torch.device) -> Stream:
    """A new stream on ``device``. Streams from the pool are non-blocking: nothing orders
    them with the default stream but the events the caller records and waits on."""
    if _generic():
        return torch.Stream(device=device)
    return torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]


def new_event(device: torch.device) -> Event:
    """A new (unrecorded) event for ``device``."""
    if _generic():
        return torch.Event(device=device)
    return torch.cuda.Event()  # type: ignore[no-untyped-call]


@contextlib.contextmanager
def use_stream(stream: Stream) -> Iterator[None]:
    """Make ``stream`` (and its device) current in this thread for the ``with`` block.

    Work launched inside runs on ``stream``, and memory allocated inside belongs to it: the
    caching allocator may hand that memory to the next allocation on the same stream as
    soon as it is freed.
    """
    if _generic():
        with stream:
            yield
    else:
        with torch.cuda.stream(stream):
            yield


def pinned_empty(nbytes: int) -> torch.Tensor:
    """``nbytes`` of page-locked host memory, as a ``uint8`` tensor.

    Raises:
        RuntimeError: the memory could not be pinned (no accelerator, or the OS refused:
            WSL caps pinned memory at 1-2 GB, and containers may limit locked memory).
    """
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
