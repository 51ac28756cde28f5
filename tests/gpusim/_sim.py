"""A deterministic model of CUDA's stream semantics on the CPU (see ``gpusim/__init__.py``)."""

from __future__ import annotations

import collections
import contextlib
import ctypes
import functools
import itertools
import mmap
import random
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.cuda import _sanitizer as csan
from torch.utils._pytree import tree_flatten, tree_map

aten = torch.ops.aten
_POISON = 0xFF
# Keys of device memory in the race checker; host memory is keyed by its address, below 2**48.
_alloc_ids = itertools.count(1 << 50)
_stream_ids = itertools.count(1)
_event_ids = itertools.count(1)

_active: Simulator | None = None


class SimulationError(AssertionError):
    """The simulated program did something a GPU would not allow or could not do."""


def sim() -> Simulator:
    if _active is None:
        raise SimulationError("no simulated GPU is active")
    return _active


# ---------------------------------------------------------------------------------- streams


class _Op:
    """One queued unit of work: first reach ``waits`` (stream, position) pairs, then ``run``."""

    __slots__ = ("name", "run", "waits")

    def __init__(
        self,
        name: str,
        run: Callable[[], None] | None,
        waits: tuple[tuple[SimStream, int], ...] = (),
    ) -> None:
        self.name = name
        self.run = run
        self.waits = waits


class SimStream(torch.Stream):
    """A stream: a queue of work that runs only when the host has to wait for it.

    Stands in for ``torch.Stream`` and ``torch.cuda.Stream``; a real ``torch.Stream`` of the
    same id is what C++ sees (``record_stream``), and is mapped back to this object.
    """

    device_index: int
    stream_id: int

    def __new__(cls, device: Any = None, priority: int = 0, **_: Any) -> SimStream:
        index = sim().device_index(device)
        return super().__new__(cls, stream_id=next(_stream_ids), device_index=index, device_type=1)

    def __init__(self, device: Any = None, priority: int = 0, **_: Any) -> None:
        s = sim()
        self.ops: collections.deque[_Op] = collections.deque()
        self.base = 0
        """Absolute position of ``ops[0]``: positions count every op ever queued here."""
        self.queries = 0
        s.streams[(self.device_index, self.stream_id)] = self
        s.checker._handle_stream_creation(self.stream_id)

    @property
    def end(self) -> int:
        return self.base + len(self.ops)

    @property
    def cuda_stream(self) -> int:
        return self.stream_id

    def wait_event(self, event: SimEvent) -> None:  # type: ignore[override]
        s = sim()
        with s.lock:
            if event.at is not None:
                self.ops.append(_Op("wait", None, (event.at,)))
            s.checker._handle_event_wait(event.id, self.stream_id)

    def wait_stream(self, stream: SimStream) -> None:  # type: ignore[override]
        self.wait_event(stream.record_event())

    def record_event(self, event: SimEvent | None = None) -> SimEvent:  # type: ignore[override]
        event = event if event is not None else SimEvent(device=self.device)
        event.record(self)
        return event

    def query(self) -> bool:
        s = sim()
        with s.lock:
            self.queries += 1
            if self.queries % 2 or s.waits_for_held(self, self.end):
                return False  # "not ready" at least once: polling loops get exercised
            s.force(self, self.end)
            s.checker._handle_stream_synchronization(self.stream_id)
            return True

    def synchronize(self) -> None:
        s = sim()
        with s.lock:
            s.force(self, self.end)
            s.checker._handle_stream_synchronization(self.stream_id)

    def __enter__(self) -> SimStream:
        s = sim()
        saved = (s.current_device(), s.current_stream(self.device_index))
        s.tls_stack().append(saved)
        s.set_stream(self)
        return self

    def __exit__(self, *exc: object) -> None:
        s = sim()
        device, stream = s.tls_stack().pop()
        s.set_stream(stream)
        s.set_device(device)

    def __repr__(self) -> str:
        return f"SimStream(cuda:{self.device_index}, id={self.stream_id})"


class SimEvent:
    """An event: records a position in a stream; stands in for ``torch.Event``."""

    def __init__(self, device: Any = None, **_: Any) -> None:
        s = sim()
        self.device_index = None if device is None else s.device_index(device)
        self.id = next(_event_ids)
        self.at: tuple[SimStream, int] | None = None
        self.queries = 0
        s.checker._handle_event_creation(self.id)

    def record(self, stream: SimStream | None = None) -> None:
        s = sim()
        with s.lock:
            if stream is None:
                index = s.current_device() if self.device_index is None else self.device_index
                stream = s.current_stream(index)
            self.at = (stream, stream.end)
            self.queries = 0
            s.checker._handle_event_record(self.id, stream.stream_id)

    def query(self) -> bool:
        s = sim()
        with s.lock:
            if self.at is None:
                return True
            self.queries += 1
            if self.queries == 1 or s.waits_for_held(*self.at):
                return False  # "not ready" at least once: polling loops get exercised
            s.force(*self.at)
            s.checker._handle_event_synchronization(self.id)
            return True

    def synchronize(self) -> None:
        s = sim()
        with s.lock:
            if self.at is not None:
                s.force(*self.at)
                s.checker._handle_event_synchronization(self.id)

    def wait(self, stream: SimStream | None = None) -> None:
        stream = stream if stream is not None else sim().current_stream(self.device_index)
        stream.wait_event(self)

    def elapsed_time(self, other: SimEvent) -> float:
        raise SimulationError("the simulator has no clock: timings need a real GPU")


# ---------------------------------------------------------------------------------- memory


class _Allocation:
    """Device memory: CPU bytes underneath, owned by the stream it was allocated on."""

    __slots__ = ("__weakref__", "backing", "device", "id", "recorded", "root", "stream")

    def __init__(self, device: int, stream: SimStream, nbytes: int) -> None:
        self.device = device
        self.stream = stream
        self.id = next(_alloc_ids)
        # Fresh device memory holds whatever the last user left: poison, so it shows.
        self.backing = torch.full((nbytes,), _POISON, dtype=torch.uint8)
        # Every tensor on this memory shares the (data-less) storage of this wrapper.
        self.root = SimTensor._wrap(None, self.backing, torch.device("cuda", device))
        self.recorded: set[SimStream] = set()


class _PinnedBlock:
    """Page-locked host memory from the simulated host allocator, and the queued copies that
    recorded themselves on it (as CUDA's caching host allocator records an event for a copy
    made through the allocation's own storage, and reuses the block only after it)."""

    __slots__ = ("freed", "nbytes", "pending", "start", "storage")

    def __init__(self, start: int, nbytes: int, storage: int) -> None:
        self.start = start
        self.nbytes = nbytes
        self.storage = storage
        """``_cdata`` of the storage the allocator handed out: copies through it record."""
        self.freed = False
        self.pending: list[tuple[SimStream, int]] = []


def _elem(
    alloc_backing: torch.Tensor, dtype: torch.dtype, size: Any, stride: Any, offset: int
) -> torch.Tensor:
    return torch.empty(0, dtype=dtype).set_(alloc_backing.untyped_storage(), offset, size, stride)


class SimTensor(torch.Tensor):
    """A tensor that reports ``cuda:N`` and keeps its bytes in CPU memory."""

    _alloc: _Allocation | None
    _elem: torch.Tensor
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @staticmethod
    def _wrap(
        alloc: _Allocation | None,
        elem: torch.Tensor,
        device: torch.device,
        requires_grad: bool = False,
    ) -> SimTensor:
        t = torch.Tensor._make_wrapper_subclass(
            SimTensor,
            elem.size(),
            strides=elem.stride(),
            storage_offset=elem.storage_offset(),
            dtype=elem.dtype,
            device=device,
            requires_grad=requires_grad,
        )
        if alloc is not None:
            torch._functionalize_unsafe_set(t, alloc.root)
        # The lazy bits show on the stand-in as on a device tensor: code that tests is_conj()
        # or is_neg(), or calls resolve_conj(), sees what it would on CUDA.
        torch._C._set_conj(t, elem.is_conj())
        torch._C._set_neg(t, elem.is_neg())
        t._alloc = alloc
        t._elem = elem
        return t  # type: ignore[no-any-return]

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return sim().dispatch(func, args, kwargs or {})

    def __repr__(self) -> str:  # never force work just to print
        return f"SimTensor({tuple(self.shape)}, {self.dtype}, {self.device})"


def _to_launch_arg(x: Any) -> Any:
    if isinstance(x, SimTensor):
        return x._elem
    # A CPU tensor argument of a kernel (a scalar) is read at launch, as CUDA copies it.
    return x.clone() if isinstance(x, torch.Tensor) else x


# ---------------------------------------------------------------------------------- the runtime


class _Tls(threading.local):
    def __init__(self) -> None:
        self.device = 0
        self.streams: dict[int, SimStream] = {}
        self.stack: list[tuple[int, SimStream]] = []


class Simulator:
    """Two simulated GPUs, their streams, a scheduler and a race checker.

    Args:
        schedule: ``"lazy"`` runs only the work that what the host waits for depends on;
            ``"eager"`` first runs every other stream to its end.
    """

    def __init__(self, schedule: str, devices: int = 2) -> None:
        if schedule not in ("lazy", "eager"):
            raise ValueError(f"schedule {schedule!r}: expected 'lazy' or 'eager'")
        self.schedule = schedule
        self.devices = devices
        self.lock = threading.RLock()
        self.checker = csan.EventHandler()
        self.errors: list[str] = []
        self.streams: dict[tuple[int, int], SimStream] = {}
        self.held: set[SimStream] = set()
        self.pinned: list[tuple[int, int, Any]] = []
        self.pinned_blocks: list[_PinnedBlock] = []
        self.by_storage: dict[int, weakref.ref[_Allocation]] = {}
        self._by_backing: dict[int, weakref.ref[_Allocation]] = {}
        self.rng = random.Random(0)
        self.launches = 0
        self._tls = _Tls()
        self._defaults: list[SimStream] = []

    # -- per-thread state

    def tls_stack(self) -> list[tuple[int, SimStream]]:
        return self._tls.stack

    def device_index(self, device: Any) -> int:
        if device is None:
            return self.current_device()
        if isinstance(device, int):
            index = device
        else:
            d = torch.device(device)
            if d.type != "cuda":
                raise SimulationError(f"{d} is not a simulated device")
            index = self.current_device() if d.index is None else d.index
        if not 0 <= index < self.devices:
            raise SimulationError(f"cuda:{index} does not exist (the simulator has {self.devices})")
        return index

    def current_device(self) -> int:
        return self._tls.device

    def set_device(self, device: Any) -> None:
        self._tls.device = self.device_index(device)

    def current_stream(self, device: Any = None) -> SimStream:
        index = self.device_index(device)
        return self._tls.streams.get(index, self._defaults[index])

    def set_stream(self, stream: SimStream) -> None:
        self._tls.streams[stream.device_index] = stream
        self._tls.device = stream.device_index

    # -- scheduling

    def launch(
        self,
        stream: SimStream,
        name: str,
        run: Callable[[], None] | None,
        reads: set[int] = frozenset(),  # type: ignore[assignment]
        writes: set[int] = frozenset(),  # type: ignore[assignment]
        waits: tuple[tuple[SimStream, int], ...] = (),
    ) -> None:
        """Queue ``run`` on ``stream`` and tell the race checker what it reads and writes."""
        with self.lock:
            stream.ops.append(_Op(name, run, waits))
            self.launches += 1
            aliases = {k: [] for k in reads | writes}
            errors = self.checker._handle_kernel_launch(
                stream.stream_id, set(reads) - set(writes), set(writes), set(), name, aliases
            )
            for e in errors:
                self.errors.append(str(e))

    def force(self, stream: SimStream, pos: int) -> None:
        """Run what the host now waits for: ``stream`` up to ``pos`` (and, eagerly, the rest)."""
        with self.lock:
            if self.schedule == "eager":
                for other in list(self.streams.values()):
                    if other is not stream and other not in self.held:
                        self._run_to(other, other.end)
            self._run_to(stream, pos)

    def _run_to(self, stream: SimStream, pos: int) -> None:
        todo = [(stream, pos)]
        while todo:
            s, p = todo[-1]
            if s.base >= p:
                todo.pop()
                continue
            op = s.ops[0]
            blocked = next(((ws, wp) for ws, wp in op.waits if ws.base < wp), None)
            if blocked is not None:
                todo.append(blocked)
                continue
            s.ops.popleft()
            s.base += 1
            if op.run is not None:
                op.run()

    def drain(self) -> None:
        """Run everything queued, on every stream."""
        with self.lock:
            for s in list(self.streams.values()):
                self._run_to(s, s.end)

    @contextlib.contextmanager
    def hold(self, stream: SimStream) -> Iterator[None]:
        """Hold ``stream`` back, as a GPU busy with long kernels would, for the ``with`` block.

        Eager scheduling runs none of its work, and an event or stream whose completion
        needs that work answers "not ready" to every ``query``. A ``synchronize`` still runs
        it: the host blocks until the GPU gets there.
        """
        self.held.add(stream)
        try:
            yield
        finally:
            self.held.discard(stream)

    def waits_for_held(self, stream: SimStream, pos: int) -> bool:
        """Whether reaching ``pos`` on ``stream`` needs queued work of a held stream."""
        if not self.held:
            return False
        todo, seen = [(stream, pos)], set()
        while todo:
            s, p = todo.pop()
            if s.base >= p or (s, p) in seen:
                continue
            seen.add((s, p))
            if s in self.held:
                return True
            for op in itertools.islice(s.ops, 0, p - s.base):
                todo.extend((ws, wp) for ws, wp in op.waits if ws.base < wp)
        return False

    def check(self) -> None:
        """Raise if the race checker saw an access not ordered after the one before it."""
        if self.errors:
            raise SimulationError(
                f"{len(self.errors)} unordered accesses or accesses to freed memory; the first:"
                f"\n{self.errors[0]}"
            )

    # -- memory

    def allocate(self, device: int, nbytes: int) -> _Allocation:
        """Device memory from the current stream's pool (as the caching allocator's)."""
        stream = self.current_stream(device)
        alloc = _Allocation(device, stream, nbytes)
        self.by_storage[alloc.root.untyped_storage()._cdata] = weakref.ref(alloc)
        self._register_backing(alloc)
        self.checker._handle_memory_allocation(alloc.id)
        # The memory is this stream's now: any other stream must order itself after this
        # point before touching it, since the block may still be in use by work queued here.
        self.launch(stream, "allocate", None, writes={alloc.id})
        weakref.finalize(alloc, self._free, alloc.id, alloc.backing, stream, alloc.recorded)
        return alloc

    def _free(
        self, alloc_id: int, backing: torch.Tensor, stream: SimStream, recorded: set[SimStream]
    ) -> None:
        """The last tensor on some memory died: the allocator may reuse it on its stream."""
        if _active is not self:
            return
        with self.lock:
            for other in recorded:  # record_stream: the reuse waits for that stream's work
                ev = SimEvent()
                ev.record(other)
                stream.wait_event(ev)
            self.launch(
                stream, "free", functools.partial(backing.fill_, _POISON), writes={alloc_id}
            )
            self.checker._handle_memory_deallocation(alloc_id)

    def tensor_on(
        self,
        alloc: _Allocation,
        dtype: torch.dtype,
        size: Any,
        stride: Any,
        offset: int,
        requires_grad: bool = False,
    ) -> SimTensor:
        return SimTensor._wrap(
            alloc,
            _elem(alloc.backing, dtype, size, stride, offset),
            torch.device("cuda", alloc.device),
            requires_grad,
        )

    def empty(
        self,
        size: Any,
        stride: Any,
        dtype: torch.dtype,
        device: int,
        offset: int = 0,
        nbytes: int | None = None,
    ) -> SimTensor:
        if nbytes is None:
            reach = sum((n - 1) * s for n, s in zip(size, stride, strict=True)) if all(size) else -1
            nbytes = (offset + reach + 1) * dtype.itemsize
        return self.tensor_on(self.allocate(device, nbytes), dtype, size, stride, offset)

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        """Page-locked host memory: page-aligned and poisoned.

        Its mapping stays for the simulator's life (a queued copy holds it by address), but
        when its storage dies the block counts as freed, as the caching host allocator would
        hand it to the next ``pin_memory`` caller: it is poisoned once the copies recorded on
        it have run, and any other queued copy that touches it later is an error.
        """
        if not nbytes:
            return torch.empty(0, dtype=torch.uint8)
        m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        # The storage holds this array, not the map: its death is the block's free.
        exported = (ctypes.c_uint8 * nbytes).from_buffer(m)
        t = torch.frombuffer(exported, dtype=torch.uint8)
        t.fill_(_POISON)
        block = _PinnedBlock(t.data_ptr(), nbytes, t.untyped_storage()._cdata)
        weakref.finalize(exported, self._free_pinned, block)
        del exported
        with self.lock:
            self.pinned.append((block.start, nbytes, m))
            self.pinned_blocks.append(block)
        return t

    def _free_pinned(self, block: _PinnedBlock) -> None:
        if _active is not self:
            return
        with self.lock:
            block.freed = True
            block.pending = [(s, p) for s, p in block.pending if s.base < p]
            if not block.pending:
                self._poison_pinned(block)

    def _poison_pinned(self, block: _PinnedBlock) -> None:
        ctypes.memset(block.start, _POISON, block.nbytes)

    def pinned_block(self, t: torch.Tensor) -> _PinnedBlock | None:
        """The pinned block under ``t``, freed or not, or None for pageable memory."""
        if t.device.type != "cpu" or t.numel() == 0:
            return None
        p = t.data_ptr()
        return next((b for b in self.pinned_blocks if b.start <= p < b.start + b.nbytes), None)

    def is_pinned(self, t: torch.Tensor) -> bool:
        block = self.pinned_block(t)
        return block is not None and not block.freed

    def _pinned_copy(
        self, stream: SimStream, name: str, host: torch.Tensor, copy: Callable[[], None]
    ) -> Callable[[], None]:
        """``copy``, a queued copy to or from pinned ``host``, checked when it runs: its block
        must not have been freed since, unless the copy recorded itself on the block (made
        through the allocation's own storage), which makes the allocator wait for it."""
        block = self.pinned_block(host)
        assert block is not None
        recorded = host.untyped_storage()._cdata == block.storage
        at = host.data_ptr()

        def run() -> None:
            if block.freed and not recorded:
                self.errors.append(
                    f"{name} on stream {stream.stream_id} touched pinned memory at {at:#x} "
                    "after its block was freed: the host allocator may have handed it to "
                    "another tensor"
                )
            copy()
            if recorded:
                block.pending = [(s, p) for s, p in block.pending if s.base < p]
                if block.freed and not block.pending:
                    self._poison_pinned(block)

        return run

    def _record_pinned(self, stream: SimStream, host: torch.Tensor) -> None:
        block = self.pinned_block(host)
        if block is not None and host.untyped_storage()._cdata == block.storage:
            block.pending.append((stream, stream.end))

    # -- dispatch of aten ops on simulated tensors

    def dispatch(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        with self.lock:
            if func is aten.copy_.default:
                return self._copy(*args, **kwargs)
            if func is aten._to_copy.default:
                return self._to_copy(*args, **kwargs)
            if func is aten.record_stream.default:
                t, s = args
                t._alloc.recorded.add(self.streams[(s.device_index, s.stream_id)])
                return None
            schema = func._schema
            if any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns):
                return self._view(func, args, kwargs)
            return self._kernel(func, args, kwargs)

    def _device_of(self, args: Any) -> int:
        devices = {x.device.index for x in tree_flatten(args)[0] if isinstance(x, SimTensor)}
        if not devices:
            return self.current_device()
        if len(devices) > 1:
            raise SimulationError(
                f"Expected all tensors to be on the same device, got cuda:{sorted(devices)}"
            )
        return devices.pop()

    def _view(self, func: Any, args: Any, kwargs: Any) -> Any:
        device = self._device_of(args)
        out = func(*tree_map(_to_elem, args), **tree_map(_to_elem, kwargs))
        return tree_map(functools.partial(self._as_view, device, args), out)

    def _as_view(self, device: int, args: Any, out: Any) -> Any:
        if not isinstance(out, torch.Tensor):
            return out
        ref = self._by_backing.get(out.untyped_storage()._cdata)
        alloc = ref() if ref is not None else None
        if alloc is None:
            raise SimulationError("a view op returned memory of no simulated tensor")
        return SimTensor._wrap(alloc, out, torch.device("cuda", device))

    def _register_backing(self, alloc: _Allocation) -> None:
        self._by_backing[alloc.backing.untyped_storage()._cdata] = weakref.ref(alloc)

    def _kernel(self, func: Any, args: Any, kwargs: Any) -> Any:
        """Any other op: outputs allocated now, computed when the stream gets there."""
        device = self._device_of((args, kwargs))
        for x in tree_flatten((args, kwargs))[0]:
            if type(x) is torch.Tensor and x.dim() and x.device.type == "cpu":
                raise SimulationError(
                    f"{func}: a CPU tensor of shape {tuple(x.shape)} given with cuda tensors"
                )
        stream = self.current_stream(device)
        schema = func._schema
        written = set()
        flat_args = dict(
            zip(
                [a.name for a in schema.arguments],
                list(args) + [None] * (len(schema.arguments) - len(args)),
                strict=False,
            )
        )
        flat_args.update(kwargs)
        for a in schema.arguments:
            if a.alias_info is not None and a.alias_info.is_write:
                for x in tree_flatten(flat_args.get(a.name))[0]:
                    if isinstance(x, SimTensor):
                        written.add(x)
        reads = {x._alloc.id for x in tree_flatten((args, kwargs))[0] if isinstance(x, SimTensor)}
        try:
            meta = func(*tree_map(_to_meta, args), **tree_map(_to_meta, kwargs))
        except Exception:  # no meta kernel, or a data-dependent shape: the host must wait
            return self._sync_kernel(func, args, kwargs, device)
        outs, spec = tree_flatten(meta)
        results: list[Any] = []
        fresh: list[tuple[int, SimTensor]] = []
        for i, (o, r) in enumerate(zip(outs, _flat_returns(schema, len(outs)), strict=True)):
            if not isinstance(o, torch.Tensor):
                results.append(o)
                continue
            if r is not None and r.is_write:
                target = next(x for x in written if _same_meta(x, o))
                results.append(target)
                continue
            t = self.empty(
                o.shape,
                o.stride(),
                o.dtype,
                device,
                o.storage_offset(),
                o.untyped_storage().nbytes(),
            )
            fresh.append((i, t))
            results.append(t)
        if not any(isinstance(o, torch.Tensor) for o in outs) and outs:
            return self._sync_kernel(func, args, kwargs, device)
        cpu_args = tree_map(_to_launch_arg, args)
        cpu_kwargs = tree_map(_to_launch_arg, kwargs)
        out_elems = [(i, t._elem) for i, t in fresh]
        seed = (
            self.rng.randrange(1 << 62) if torch.Tag.nondeterministic_seeded in func.tags else None
        )

        def run() -> None:
            if seed is None:
                res = func(*cpu_args, **cpu_kwargs)
            else:
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(seed)
                    res = func(*cpu_args, **cpu_kwargs)
            flat = tree_flatten(res)[0]
            for i, e in out_elems:
                e.copy_(flat[i])

        writes = {x._alloc.id for x in written} | {t._alloc.id for _, t in fresh}
        self.launch(stream, str(func), run, reads - writes, writes)
        return spec.unflatten(results) if spec is not None else results

    def _sync_kernel(self, func: Any, args: Any, kwargs: Any, device: int) -> Any:
        """An op whose result the host needs (a scalar, a data-dependent shape): wait for it."""
        stream = self.current_stream(device)
        cell: list[Any] = []
        cpu_args, cpu_kwargs = tree_map(_to_elem, args), tree_map(_to_elem, kwargs)
        reads = {x._alloc.id for x in tree_flatten((args, kwargs))[0] if isinstance(x, SimTensor)}
        self.launch(stream, str(func), lambda: cell.append(func(*cpu_args, **cpu_kwargs)), reads)
        self.force(stream, stream.end)
        self.checker._handle_stream_synchronization(stream.stream_id)
        result = cell[0]
        return tree_map(
            lambda x: self.upload_now(x, device) if isinstance(x, torch.Tensor) else x, result
        )

    def upload_now(self, cpu: torch.Tensor, device: int) -> SimTensor:
        """A new device tensor holding ``cpu``'s values (a pageable host-to-device copy)."""
        out = self.empty(
            cpu.shape,
            cpu.stride(),
            cpu.dtype,
            device,
            cpu.storage_offset(),
            cpu.untyped_storage().nbytes(),
        )
        snap = cpu.clone()
        elem = out._elem
        self.launch(
            self.current_stream(device), "upload", lambda: elem.copy_(snap), writes={out._alloc.id}
        )
        return out

    # -- copies

    def _copy(self, dst: Any, src: Any, non_blocking: bool = False) -> Any:
        if isinstance(dst, SimTensor) and isinstance(src, SimTensor):
            stream = self.current_stream(dst.device.index)
            if src.device != dst.device:
                other = self.current_stream(src.device.index)
                ev = SimEvent()
                ev.record(other)
                stream.wait_event(ev)
            d, s = dst._elem, src._elem
            self.launch(stream, "copy d2d", lambda: d.copy_(s), {src._alloc.id}, {dst._alloc.id})
            return dst
        if isinstance(src, SimTensor):  # device to host
            stream = self.current_stream(src.device.index)
            s = src._elem
            if non_blocking and self.is_pinned(dst):
                d = _alias(dst)
                # As CUDA does: the copy moves the bytes, and the fix-up for a lazy conj/neg
                # bit runs on the host before the bytes land, so it is lost.
                raw = s.conj() if s.is_conj() else s
                raw = raw._neg_view() if raw.is_neg() else raw
                run = self._pinned_copy(stream, "copy d2h", dst, lambda: d.copy_(raw))
                self.launch(stream, "copy d2h", run, {src._alloc.id}, {dst.data_ptr()})
                self._record_pinned(stream, dst)
            else:
                self.launch(stream, "copy d2h (blocking)", lambda: dst.copy_(s), {src._alloc.id})
                self.force(stream, stream.end)
                self.checker._handle_stream_synchronization(stream.stream_id)
            return dst
        # host to device
        stream = self.current_stream(dst.device.index)
        d = dst._elem
        if non_blocking and self.is_pinned(src):
            s = _alias(src)
            run = self._pinned_copy(stream, "copy h2d", src, lambda: d.copy_(s))
            self.launch(stream, "copy h2d", run, {src.data_ptr()}, {dst._alloc.id})
            self._record_pinned(stream, src)
        else:
            snap = src.clone()  # a pageable source is staged before the call returns
            self.launch(stream, "copy h2d (staged)", lambda: d.copy_(snap), set(), {dst._alloc.id})
            if not non_blocking:
                self.force(stream, stream.end)
                self.checker._handle_stream_synchronization(stream.stream_id)
        return dst

    def _to_copy(self, src: SimTensor, **kw: Any) -> Any:
        device = kw.get("device")
        dtype = kw.get("dtype") or src.dtype
        if device is not None and torch.device(device).type == "cpu":
            out = torch.empty(src.shape, dtype=dtype)
            if kw.get("pin_memory"):
                out = (
                    self.pinned_empty(out.numel() * out.element_size()).view(dtype).view(src.shape)
                )
            return self._copy(out, src, bool(kw.get("non_blocking")))
        index = src.device.index if device is None else self.device_index(device)
        fmt = kw.get("memory_format") or torch.preserve_format
        like = torch.empty_like(
            torch.empty_strided(src.shape, src.stride(), dtype=dtype, device="meta"),
            memory_format=fmt,
        )
        with self.device_ctx(index):
            out = self.empty(like.shape, like.stride(), dtype, index)
        if dtype == src.dtype:
            return self._copy(out, src, bool(kw.get("non_blocking")))
        stream = self.current_stream(index)
        d, s = out._elem, src._elem
        self.launch(stream, "to", lambda: d.copy_(s), {src._alloc.id}, {out._alloc.id})
        return out

    @contextlib.contextmanager
    def device_ctx(self, index: int) -> Iterator[None]:
        saved = self._tls.device
        self._tls.device = index
        try:
            yield
        finally:
            self._tls.device = saved


def _flat_returns(schema: Any, n: int) -> list[Any]:
    rets = [r.alias_info for r in schema.returns]
    if len(rets) == n:
        return rets
    return [rets[0] if rets else None] * n


def _same_meta(x: torch.Tensor, o: torch.Tensor) -> bool:
    return x.shape == o.shape and x.dtype == o.dtype


def _to_elem(x: Any) -> Any:
    return x._elem if isinstance(x, SimTensor) else x


def _to_meta(x: Any) -> Any:
    if isinstance(x, SimTensor):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    if type(x) is torch.Tensor and x.device.type == "cpu":
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    if isinstance(x, torch.device) and x.type == "cuda":
        return torch.device("meta")
    return x


def _alias(t: torch.Tensor) -> torch.Tensor:
    """``t`` seen through its address only: what a DMA engine holds (no reference to ``t``)."""
    if t.numel() == 0:
        return t.new_empty(t.shape)
    reach = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True)) + 1
    raw = (ctypes.c_uint8 * (reach * t.element_size())).from_address(t.data_ptr())
    u8 = torch.frombuffer(raw, dtype=torch.uint8)
    return torch.empty(0, dtype=t.dtype).set_(u8.untyped_storage(), 0, t.shape, t.stride())
