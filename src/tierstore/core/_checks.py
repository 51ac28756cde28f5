"""What the store accepts, and whether a tensor it holds changed after put.

Note: [Writes after put]
    On the CPU, and on a device until its copy is made, the store holds the caller's own
    tensor rather than a copy. Writing it in place, or resizing its storage (as FSDP frees a
    flat parameter with ``storage.resize_(0)``), after ``put`` breaks the contract, and the
    store cannot give back what was put. It notices instead of returning other bytes, crashing,
    or blaming the disk: the version counter recorded at put is compared whenever the store
    copies, spills or returns the tensor, and the storage's size and address are checked first
    (the raw engine checks them again on its I/O threads, right before touching the memory):
    a storage freed and allocated again (``resize_(0)``, then ``resize_(n)``) keeps its
    version and size but not its address. Should the new memory land at the old address,
    nothing tells, and what the memory then holds is what the store writes or returns. The entry
    then fails with an error saying so, which its gets raise. It is not logged as an error:
    a tensor written after put and never read back harms nothing, as a tensor autograd saved
    and then written in place raises only if backward needs it.

Note: [A spill's source cannot be freed]
    A tensor the disk engine reads from its own pages (on the CPU, the caller's tensor: written
    alone, copied into a pack, or handed to zarr) goes through ``Tensor.numpy()`` first, which
    marks its storage not resizable, for good, as it does for any tensor shared with numpy.
    So a caller freeing that storage (``resize_(0)``) while I/O threads read it gets
    ``RuntimeError: Trying to resize storage that is not resizable``, and the spill goes on.
    Without the mark the threads read freed memory: the process crashed (zarr; a pack's copy,
    which lets the GIL go from 256 KiB, and which a check just before cannot protect, since
    another thread may run between the two), or the disk was blamed (EFAULT in a buffered
    write). The price: the storage stays not resizable after the release, so a later
    ``resize_`` that must grow it, or ``resize_(0)``, raises too. Copies of the store's own
    (a host copy of a GPU tensor, a compacted view) leave the caller's storage as it was.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tierstore._handle import TensorHandle
from tierstore.errors import TensorModifiedError, UnsupportedTensorError
from tierstore.tiers import _accelerator

if TYPE_CHECKING:
    from collections.abc import Callable

    from tierstore.core._entries import Entry

__all__ = [
    "PLAIN_SUBCLASSES",
    "change_of",
    "changed_error",
    "check_handle",
    "check_min_bytes",
    "check_tensor",
    "unsupported",
    "version_of",
]

_functorch_wrapped: Callable[[torch.Tensor], bool] = getattr(
    getattr(torch._C, "_functorch", None), "is_functorch_wrapped_tensor", lambda t: False
)

PLAIN_SUBCLASSES: set[type[torch.Tensor]] = set()
"""Tensor subclasses stored as plain tensors besides ``nn.Parameter``: tests add the stream
simulator's stand-in for device tensors here (``tierstore.testing.plain_tensor_type``)."""


def unsupported(t: object) -> str | None:
    """Why the store cannot hold ``t`` as plain strided bytes on this machine (with what to do
    instead), or None when it can."""
    if not isinstance(t, torch.Tensor):
        return f"put() takes a torch.Tensor, got {type(t).__name__}"
    kind = type(t)
    if (
        kind is not torch.Tensor
        and not isinstance(t, torch.nn.Parameter)
        and kind not in PLAIN_SUBCLASSES
    ):
        return (
            f"tensor subclass {kind.__name__} is not supported; store its plain data "
            "(e.g. t.as_subclass(torch.Tensor)) or keep it in memory"
        )
    if t.layout is not torch.strided:
        return f"{t.layout} tensors are not supported; convert with .to_dense() or keep in memory"
    if t.is_nested:
        return "nested tensors are not supported; keep them in memory"
    if t.is_quantized:
        return "quantized tensors are not supported; store .int_repr() and the scales instead"
    if _functorch_wrapped(t):
        # Inside torch.func's transforms (jvp, vmap) a tensor is a wrapper of type Tensor
        # with no storage: asking for its bytes raised NotImplementedError.
        return (
            "a tensor inside a torch.func transform (jvp, vmap) has no storage of its own; "
            "keep it in memory"
        )
    if t._is_zerotensor():
        # Forward-mode AD's stand-in for zeros has no memory: its write to disk failed and
        # paused the disk tier.
        return "a ZeroTensor (forward-mode AD's zeros) has no bytes to store; keep it in memory"
    if not t.is_cpu and not _accelerator.is_accelerator(t.device):
        return (
            f"tensors on device {str(t.device)!r} are not supported; tierstore moves CPU "
            f"tensors and tensors on this machine's accelerator "
            f"({_accelerator.accelerator_type() or 'none here'})"
        )
    return None


def check_tensor(t: object) -> None:
    """Refuse what :func:`unsupported` names.

    Raises:
        UnsupportedTensorError: ``t`` is not a plain strided tensor on the CPU or this
            machine's accelerator.
    """
    why = unsupported(t)
    if why is not None:
        raise UnsupportedTensorError(why)


def check_handle(handle: object) -> None:
    """Raises:
    TypeError: ``handle`` is not a :class:`~tierstore.TensorHandle`.
    """
    if not isinstance(handle, TensorHandle):
        raise TypeError(f"expected a TensorHandle from put(), got {type(handle).__name__}")


def version_of(t: torch.Tensor) -> int | None:
    """``t``'s version counter, or None for tensors that keep none (inference mode)."""
    try:
        return t._version
    except RuntimeError:
        return None


def change_of(e: Entry, t: torch.Tensor) -> str | None:
    """How ``t`` changed since ``e`` was put, or None (Note: [Writes after put])."""
    # The bytes of storage the tensor reaches (an expanded view reaches fewer than it shows).
    # Checked on every move of every tensor, so the common contiguous case skips the sum:
    # there the last element reached is the numel-th.
    numel = t.numel()
    need: int | torch.SymInt = 0
    if numel and t.is_contiguous():
        need = (t.storage_offset() + numel) * t.element_size()
    elif numel:
        reach = sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))
        need = (t.storage_offset() + reach + 1) * t.element_size()
    have = t.untyped_storage().nbytes()
    if have < need:
        return f"its storage was resized to {have} bytes (it needs {need}), as resize_(0) does"
    if e.address is not None and numel and t.data_ptr() != e.address:
        return (
            "its storage was freed and allocated again (resize_(0), then resize_(n), as FSDP "
            "frees and regathers a flat parameter): its bytes moved and are not those put"
        )
    if e.version is not None and version_of(t) != e.version:
        # The counter is shared by every view of the storage: a write to the part of a base
        # this view does not cover counts too, and the store, holding no copy, cannot tell.
        return (
            "it, or a tensor sharing its storage (its base, another view of it, or what get() "
            f"returned), was written in place (version {e.version} at put, {version_of(t)} now)"
        )
    return None


def changed_error(e: Entry, why: str) -> TensorModifiedError:
    """The error every get of ``e`` raises once its tensor changed after put."""
    return TensorModifiedError(
        f"{e.describe()} changed after put(): {why}. The store holds that tensor itself, not a "
        "copy, so it cannot vouch for the bytes that were put. Leave the tensor, its base and "
        "what get() returns untouched until the handle is released, or put a clone()"
    )


def check_min_bytes(min_bytes: object) -> None:
    """Raise ValueError unless ``min_bytes`` is None or a non-negative integer."""
    if min_bytes is not None and (
        isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 0
    ):
        raise ValueError(f"min_bytes={min_bytes!r}: expected a non-negative number of bytes")
