"""gpusim: two simulated CUDA devices on the CPU, to test the store's GPU path without a GPU.

What it models (``simulate()`` installs it for the length of a ``with`` block):

- Device tensors. :class:`SimTensor` reports ``cuda:0`` or ``cuda:1`` and keeps its bytes in
  CPU memory. Factory calls with ``device="cuda:N"`` (``torch.empty``, ``zeros``, ``.to``,
  ``.cuda``...) and with ``pin_memory=True`` are redirected, in every thread; a dispatch mode
  in the creating thread also catches factories that C++ code calls.
- Streams are queues. Every op on a device tensor is queued on the calling thread's current
  stream of its device (current stream and device are per thread, as in CUDA) and runs only
  when the host must wait: an event's or a stream's ``query`` or ``synchronize``, a blocking
  copy, ``.item()``, anything whose result is a Python value. ``query`` answers "not ready"
  at least once. Output memory is handed out at once, as the caching allocator does.
- Two schedules, both legal executions of the same program. ``lazy`` runs only the work that
  what the host waits for depends on (stream order plus the events its streams waited on),
  so a consumer that skipped its wait reads stale or poisoned bytes. ``eager`` first runs
  every other stream to its end (except streams held back by :meth:`Simulator.hold`), so
  memory overwritten too early shows.
- Poison. Device memory and pinned buffers start as 0xFF bytes (NaN as floats). Freeing a
  device tensor queues a poisoning write on the stream that allocated it, as the caching
  allocator's reuse would (after the work of streams named by ``record_stream``). A pinned
  or device buffer read by a queued copy is held by address only, as by a DMA engine: Python
  references do not keep it alive for the copy. A pinned block whose storage dies is freed as
  the caching host allocator frees it: copies made through that storage recorded themselves
  on it and run first; any other queued copy that touches the block afterwards (one through a
  view made from its address, as a pool of pinned pieces makes) is an error, and the block is
  poisoned.
- Copies. Device-to-host into pinned memory and host-to-device from pinned memory with
  ``non_blocking=True`` are queued and touch host memory when they run; into or from
  pageable memory they are staged (host-to-device) or blocking (device-to-host), as in CUDA.
- A race checker. Every queued op, allocation (as a write by the allocating stream), free,
  event record, event wait and host synchronization is fed to
  ``torch.cuda._sanitizer.EventHandler``, the happens-before analysis of PyTorch's CUDA
  Stream Sanitizer. Any access not ordered after the conflicting one before it is an error
  (:meth:`Simulator.check`), whichever schedule hid it.

What it cannot prove: anything about the driver or the hardware (DMA engines and copy/compute
overlap, pinned-memory limits, the caching allocator's real reuse pattern, speed), memory
models below the stream level, autograd's per-device backward threads (backward runs on the
thread that calls it here), and random numbers drawn on the device (each random kernel gets
its own seed, drawn when it is queued). Tensor ``set_`` to a storage returns a new tensor
instead of changing its receiver. Timings raise.

The C++ side of torch needs a CUDA device guard and accelerator to run autograd over these
tensors; ``_native.py`` provides both for the simulator's lifetime and takes them back.
"""

from __future__ import annotations

import contextlib
import functools
import os
import traceback
from collections.abc import Iterator
from typing import Any

import torch

if not hasattr(torch._C, "_acc"):
    # pytest.importorskip turns this into a skip that names the reason.
    raise ImportError(
        f"gpusim needs torch's Python accelerator hooks (torch._C._acc); torch {torch.__version__} "
        "has none"
    )

from torch.cuda import _sanitizer as csan
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from gpusim import _native, _sim
from gpusim._native import Unsupported
from gpusim._sim import SimEvent, SimStream, SimTensor, SimulationError, Simulator

__all__ = [
    "SimEvent",
    "SimStream",
    "SimTensor",
    "SimulationError",
    "Simulator",
    "Unsupported",
    "simulate",
]

_EMPTY = {"empty", "empty_strided", "empty_like", "new_empty"}
_FACTORIES = (
    "empty",
    "empty_strided",
    "zeros",
    "ones",
    "full",
    "rand",
    "randn",
    "randint",
    "arange",
    "tensor",
    "as_tensor",
    "empty_like",
    "zeros_like",
    "ones_like",
    "full_like",
    "rand_like",
    "randn_like",
)


def _is_cuda(device: Any) -> bool:
    if device is None:
        return False
    if isinstance(device, int):
        return True
    return torch.device(device).type == "cuda"


class _Patches:
    def __init__(self) -> None:
        self._undo: list[tuple[Any, str, Any, bool]] = []
        self._calls: list[tuple[Any, tuple[Any, ...]]] = []

    def set(self, obj: Any, name: str, value: Any) -> None:
        had = name in vars(obj) if isinstance(obj, type) else hasattr(obj, name)
        self._undo.append((obj, name, getattr(obj, name, None), had))
        setattr(obj, name, value)

    def call_at_undo(self, fn: Any, *args: Any) -> None:
        self._calls.append((fn, args))

    def undo(self) -> None:
        while self._undo:
            obj, name, old, had = self._undo.pop()
            if had:
                setattr(obj, name, old)
            else:
                delattr(obj, name)
        while self._calls:
            fn, args = self._calls.pop()
            fn(*args)


def _factory(s: Simulator, name: str, orig: Any) -> Any:
    @functools.wraps(orig)
    def factory(*args: Any, **kwargs: Any) -> Any:
        device = kwargs.get("device")
        if _is_cuda(device):
            index = s.device_index(device)
            requires_grad = kwargs.pop("requires_grad", False)
            kwargs.pop("pin_memory", None)
            kwargs["device"] = "cpu"
            cpu = orig(*args, **kwargs)
            out = s.empty(cpu.shape, cpu.stride(), cpu.dtype, index)
            if name not in _EMPTY:
                elem = out._elem
                s.launch(
                    s.current_stream(index),
                    f"{name} fill",
                    lambda: elem.copy_(cpu),
                    writes={out._alloc.id},
                )
            return out.requires_grad_() if requires_grad else out
        if kwargs.get("pin_memory"):
            kwargs.pop("pin_memory")
            cpu = orig(*args, **kwargs)
            pinned = s.pinned_empty(cpu.numel() * cpu.element_size())
            out = pinned.view(cpu.dtype).view(cpu.shape) if cpu.numel() else cpu
            if name not in _EMPTY and cpu.numel():
                out.copy_(cpu)
            return out
        return orig(*args, **kwargs)

    return factory


def _h2d(
    s: Simulator, t: torch.Tensor, device: torch.device, dtype: Any, non_blocking: bool
) -> Any:
    if t.requires_grad and torch.is_grad_enabled():
        raise SimulationError("a differentiable host-to-device copy is not modelled")
    src = t if dtype is None or dtype == t.dtype else t.to(dtype)
    index = s.device_index(device)
    stride = src.stride() if src.is_contiguous() else torch.empty(src.shape).stride()
    with s.device_ctx(index):
        out = s.empty(src.shape, stride, src.dtype, index)
    return s.dispatch(torch.ops.aten.copy_.default, (out, src, non_blocking), {})


def _tensor_methods(s: Simulator, p: _Patches) -> None:
    T = torch.Tensor
    orig_to, orig_set, orig_cuda = T.to, T.set_, T.cuda

    def to(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(self, SimTensor):
            device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
            if device is not None and device.type == "cuda":
                return _h2d(s, self, device, dtype, non_blocking)
        return orig_to(self, *args, **kwargs)

    def cuda(self: torch.Tensor, device: Any = None, non_blocking: bool = False, **_: Any) -> Any:
        target = torch.device("cuda", s.device_index(device))
        if isinstance(self, SimTensor) and self.device == target:
            return self
        return to(self, target, non_blocking=non_blocking)

    def set_(self: torch.Tensor, source: Any = None, *args: Any, **kwargs: Any) -> Any:
        if isinstance(self, SimTensor) and isinstance(source, torch.UntypedStorage):
            ref = s.by_storage.get(source._cdata)
            alloc = ref() if ref is not None else None
            if alloc is None:
                raise SimulationError("set_ to a storage of no simulated tensor")
            offset = args[0] if args else kwargs.get("storage_offset", 0)
            size = (
                args[1]
                if len(args) > 1
                else kwargs.get("size", (alloc.backing.numel() // self.element_size(),))
            )
            stride = args[2] if len(args) > 2 else kwargs.get("stride")
            if stride is None:
                stride = torch.empty(size, device="meta").stride()
            return s.tensor_on(alloc, self.dtype, size, stride, offset)
        return orig_set(self, source, *args, **kwargs)

    def pin_memory(self: torch.Tensor, *_: Any) -> torch.Tensor:
        out = s.pinned_empty(self.numel() * self.element_size()).view(self.dtype).view(self.shape)
        return out.copy_(self)

    def is_pinned(self: torch.Tensor, *_: Any) -> bool:
        return s.is_pinned(self)

    p.set(T, "to", to)
    p.set(T, "cuda", cuda)
    p.set(T, "set_", set_)
    p.set(T, "pin_memory", pin_memory)
    p.set(T, "is_pinned", is_pinned)
    del orig_cuda


def _runtime(s: Simulator, p: _Patches, legacy: bool) -> None:
    def synchronize(device: Any = None) -> None:
        index = s.device_index(device)
        with s.lock:
            for stream in list(s.streams.values()):
                if stream.device_index == index:
                    s.force(stream, stream.end)
            s.checker._handle_device_synchronization()

    @contextlib.contextmanager
    def stream_ctx(stream: SimStream | None) -> Iterator[None]:
        if stream is None:
            yield
            return
        with stream:
            yield

    p.set(torch, "Stream", SimStream)
    p.set(torch, "Event", SimEvent)
    acc = torch.accelerator
    p.set(acc, "current_accelerator", lambda check_available=False: torch.device("cuda"))
    p.set(acc, "is_available", lambda: True)
    p.set(acc, "device_count", lambda: s.devices)
    p.set(acc, "current_device_index", s.current_device)
    p.set(acc, "current_device_idx", s.current_device)
    p.set(acc, "set_device_index", s.set_device)
    p.set(acc, "set_device_idx", s.set_device)
    p.set(acc, "current_stream", lambda device=None: s.current_stream(device))
    p.set(acc, "set_stream", s.set_stream)
    p.set(acc, "synchronize", synchronize)
    if legacy:
        cuda = torch.cuda
        p.set(cuda, "is_available", lambda: True)
        p.set(cuda, "device_count", lambda: s.devices)
        p.set(cuda, "current_device", s.current_device)
        p.set(cuda, "set_device", s.set_device)
        p.set(cuda, "current_stream", lambda device=None: s.current_stream(device))
        p.set(cuda, "Stream", SimStream)
        p.set(cuda, "Event", SimEvent)
        p.set(cuda, "stream", stream_ctx)
        p.set(cuda, "synchronize", synchronize)
        p.set(
            cuda, "get_device_name", lambda device=None: f"simulated GPU {s.device_index(device)}"
        )


class _FactoryMode(TorchDispatchMode):
    """In the simulator's thread: factories that C++ calls with a ``cuda`` device."""

    def __init__(self, s: Simulator) -> None:
        super().__init__()
        self.s = s

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if _is_cuda(kwargs.get("device")) and not any(
            isinstance(x, SimTensor) for x in tree_flatten((args, kwargs))[0]
        ):
            s = self.s
            index = s.device_index(kwargs["device"])
            cpu = func(*args, **{**kwargs, "device": torch.device("cpu")})
            out = s.empty(cpu.shape, cpu.stride(), cpu.dtype, index)
            elem = out._elem
            s.launch(
                s.current_stream(index), str(func), lambda: elem.copy_(cpu), writes={out._alloc.id}
            )
            return out
        return func(*args, **kwargs)


class _QuietTraceback:
    """Stands in for ``traceback`` inside the race checker: its stack walks cost ~0.25 ms per
    op; set GPUSIM_STACKS=1 to keep them in the error reports."""

    class StackSummary:
        @staticmethod
        def extract(frames: Any, lookup_lines: bool = True) -> traceback.StackSummary:
            return traceback.StackSummary()

    @staticmethod
    def walk_stack(frame: Any) -> Any:
        return iter(())


@contextlib.contextmanager
def simulate(
    schedule: str = "lazy", *, devices: int = 2, legacy: bool = False
) -> Iterator[Simulator]:
    """Two simulated GPUs for the ``with`` block; everything queued runs at its end.

    Args:
        schedule: ``"lazy"`` (default) or ``"eager"`` (see the module docstring).
        devices: how many ``cuda`` devices exist (default 2).
        legacy: also stand in for the ``torch.cuda`` stream API (torch before 2.6).

    Raises:
        Unsupported: this torch build cannot host the simulator.
        SimulationError: nesting, or the race checker found errors (at exit).
    """
    if _sim._active is not None:
        raise SimulationError("simulators do not nest")
    _native.install()
    s = Simulator(schedule, devices)
    p = _Patches()
    _sim._active = s
    try:
        s._defaults = [SimStream(device=i) for i in range(devices)]
        _runtime(s, p, legacy)
        _tensor_methods(s, p)
        for name in _FACTORIES:
            p.set(torch, name, _factory(s, name, getattr(torch, name)))
        if not os.environ.get("GPUSIM_STACKS"):
            p.set(csan, "traceback", _QuietTraceback)
        # The kernels are tiny: OpenMP's thread team only adds its wake-ups, which cost
        # milliseconds per op on a loaded two-core machine.
        p.call_at_undo(torch.set_num_threads, torch.get_num_threads())
        torch.set_num_threads(1)
        # Module.to() would otherwise pour a SimTensor into the existing CPU Parameter object
        # (param.data = ...), leaving a tensor that reports cuda but is no SimTensor.
        overwrite = torch.__future__.get_overwrite_module_params_on_conversion()
        torch.__future__.set_overwrite_module_params_on_conversion(True)
        p.call_at_undo(torch.__future__.set_overwrite_module_params_on_conversion, overwrite)
        with torch.autograd.set_multithreading_enabled(False), _FactoryMode(s):
            yield s
        s.drain()
        s.check()
    finally:
        with s.lock:
            s.drain()
            _sim._active = None
        p.undo()
        _native.uninstall()
