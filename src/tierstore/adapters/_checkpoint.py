"""``checkpoint``: activation checkpointing whose saved inputs live in a TieredStore.

Note: [Checkpoint without recursion]
    Hugging Face layers checkpoint themselves (their ``forward`` hands ``partial(forward, self)``
    to the checkpoint function), and users wrap a module's forward with a function that calls
    ``checkpoint(module, ...)``. Either way the function may call back into ``checkpoint`` for
    the same module while it runs, and a naive implementation recurses without end. While a
    module's function runs under ``checkpoint`` (in forward or in the backward recompute), a
    nested ``checkpoint`` of that same module runs it directly, and where the module's
    ``forward`` was replaced on the instance, runs the class's own ``forward``. Each layer is
    thus checkpointed once and computed exactly once per forward and once per recompute.

Note: [Stores are independent]
    Checkpoints into different stores share nothing. Each store has its own table of stored
    storages: with one table for the process, ``checkpoint(f, x, store=B)`` after
    ``checkpoint(f, x, store=A)`` found ``x`` already stored, put nothing into B and read from
    A in backward. And a checkpoint is linked, for prefetching in backward, to the previous
    checkpoint made on its thread into the same store only: linked across stores, a backward
    through B prefetched from A, and raised ``StoreClosedError`` once A was closed.

Note: [Every input is an input]
    Positional and keyword arguments are flattened, and every tensor among them, including
    tensors bound in a ``functools.partial``, is an input of the autograd function, so every
    tensor that requires grad gets its gradient. A placeholder that requires grad is always an
    input too: without it, a layer whose inputs need no grad (frozen embeddings) would produce
    outputs that need none either, and its parameters would silently get no gradient.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import weakref
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import (
    _get_autocast_kwargs,
    _get_device_module,
    _infer_device_type,
    get_device_states,
    set_device_states,
)

from tierstore.adapters._common import min_bytes_of, resolve_store
from tierstore.adapters._storage import Saved, StorageTable, Stored

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from tierstore._sync import TieredStore

__all__ = ["checkpoint"]

R = TypeVar("R")

_local = threading.local()
# One table per store, shared by every checkpoint into it: a mask handed to every layer is
# stored once. Per store, because a table that matched another store's entry would read from
# that store, and die with it (Note: [Stores are independent]).
_tables: weakref.WeakKeyDictionary[TieredStore, StorageTable] = weakref.WeakKeyDictionary()
_tables_lock = threading.Lock()


def _table_of(store: TieredStore) -> StorageTable:
    with _tables_lock:
        table = _tables.get(store)
        if table is None:
            table = _tables[store] = StorageTable()
        return table


def _last_plans() -> weakref.WeakKeyDictionary[TieredStore, weakref.ref[_Plan]]:
    """This thread's most recent checkpoint into each store (Note: [Stores are independent])."""
    plans: weakref.WeakKeyDictionary[TieredStore, weakref.ref[_Plan]] | None = getattr(
        _local, "last_plans", None
    )
    if plans is None:
        plans = _local.last_plans = weakref.WeakKeyDictionary()
    return plans


def _running() -> dict[int, int]:
    running: dict[int, int] | None = getattr(_local, "running", None)
    if running is None:
        running = _local.running = {}
    return running


@contextlib.contextmanager
def _marked(key: int) -> Iterator[None]:
    running = _running()
    running[key] = running.get(key, 0) + 1
    try:
        yield
    finally:
        running[key] -= 1
        if not running[key]:
            del running[key]


def _unwrap(
    function: Callable[..., Any],
) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
    """Peel ``functools.partial`` layers so their bound tensors become visible inputs."""
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = {}
    while isinstance(function, functools.partial):
        args = function.args + args
        kwargs = {**function.keywords, **kwargs}
        function = function.func
    return function, args, kwargs


def _owner(function: Callable[..., Any], args: tuple[Any, ...]) -> object:
    """The module a function runs (for Note: [Checkpoint without recursion]), else itself."""
    if isinstance(function, torch.nn.Module):
        return function
    bound = getattr(function, "__self__", None)
    if isinstance(bound, torch.nn.Module):
        return bound
    if args and isinstance(args[0], torch.nn.Module) and inspect.isfunction(function):
        # partial(forward, layer): how Hugging Face layers checkpoint themselves.
        return args[0]
    return function


def _run_directly(
    function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    if isinstance(function, torch.nn.Module) and "forward" in function.__dict__:
        # The instance's forward was replaced by a wrapper that checkpoints this very module:
        # calling the module again would enter the wrapper again. Run the class's forward.
        return type(function).forward(function, *args, **kwargs)
    return function(*args, **kwargs)


class _Plan:
    """Everything backward needs besides the saved tensors; lives on the autograd ctx."""

    __slots__ = (
        "__weakref__",
        "autocast",
        "device_type",
        "function",
        "key",
        "leaves",
        "min_bytes",
        "n_tensors",
        "out_spec",
        "out_tensor",
        "prev",
        "rng",
        "spec",
        "store",
        "stored",
        "tensor_at",
    )

    def __init__(
        self,
        function: Callable[..., Any],
        key: int,
        leaves: list[Any],
        spec: pytree.TreeSpec,
        store: TieredStore,
        min_bytes: int,
    ) -> None:
        self.function = function
        self.key = key
        self.spec = spec
        self.store = store
        # Tensors are replaced by None in the leaves; tensor_at says where they go back.
        self.tensor_at = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        self.leaves = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        self.n_tensors = len(self.tensor_at)
        self.min_bytes = min_bytes
        # What went into the store, weakly: autograd owns the records.
        self.stored: list[weakref.ref[Stored]] = []
        self.rng: tuple[torch.Tensor, list[int], list[torch.Tensor]] | None = None
        self.device_type = "cpu"
        self.autocast: tuple[dict[str, Any], dict[str, Any]] = ({}, {})
        self.out_spec: pytree.TreeSpec | None = None
        self.out_tensor: list[bool] = []
        # The checkpoint run just before this one on this thread and into this store:
        # backward needs its inputs next.
        self.prev: weakref.ref[_Plan] | None = None

    def call(self, tensors: tuple[torch.Tensor, ...]) -> Any:
        leaves = list(self.leaves)
        for i, t in zip(self.tensor_at, tensors, strict=True):
            leaves[i] = t
        args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        with _marked(self.key):
            return self.function(*args, **kwargs)

    def pack(self, t: torch.Tensor) -> Saved | torch.Tensor:
        packed = _table_of(self.store).offload(self.store, t, self.min_bytes)
        if isinstance(packed, Saved):
            self.stored.append(weakref.ref(packed.stored))
        return packed

    def prefetch(self) -> None:
        handles = [s.handle for s in (ref() for ref in self.stored) if s is not None]
        if handles:
            self.store.prefetch(handles)


class _CheckpointFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        plan: _Plan,
        preserve_rng_state: bool,
        placeholder: torch.Tensor,
        *tensors: torch.Tensor,
    ) -> tuple[Any, ...]:
        del placeholder
        plan.device_type = _infer_device_type(*tensors)  # type: ignore[no-untyped-call]
        plan.autocast = _get_autocast_kwargs(plan.device_type)  # type: ignore[no-untyped-call]
        if preserve_rng_state:
            devices: list[int] = []
            states: list[torch.Tensor] = []
            # Do not initialise a device context by accident (torch.utils.checkpoint does not).
            device_module = _get_device_module(plan.device_type)  # type: ignore[no-untyped-call]
            if getattr(device_module, "_initialized", False):
                devices, states = get_device_states(*tensors)
            plan.rng = (torch.get_rng_state(), devices, states)
        # Saved first, so the store's writes overlap the layer's compute. The pack hook around
        # apply() puts them into the store; autograd owns the records, frees them after
        # backward (or with the graph) and checks their version counters on unpack.
        ctx.save_for_backward(*tensors)
        with torch.no_grad():
            out = plan.call(tensors)
        leaves, plan.out_spec = pytree.tree_flatten(out)
        plan.out_tensor = [isinstance(leaf, torch.Tensor) for leaf in leaves]
        ctx.mark_non_differentiable(
            *(
                leaf
                for leaf in leaves
                if isinstance(leaf, torch.Tensor)
                and not (leaf.is_floating_point() or leaf.is_complex())
            )
        )
        ctx.plan = plan
        ctx.set_materialize_grads(False)
        plans = _last_plans()
        plan.prev = plans.get(plan.store)
        plans[plan.store] = weakref.ref(plan)
        return tuple(leaves)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        if not torch.autograd._is_checkpoint_valid():  # type: ignore[no-untyped-call]
            raise RuntimeError(
                "tierstore.checkpoint recomputes inside backward and cannot be used with "
                "torch.autograd.grad() or backward(inputs=...); call .backward() without inputs"
            )
        plan: _Plan = ctx.plan
        inputs = ctx.saved_tensors
        previous = plan.prev() if plan.prev is not None else None
        if previous is not None:
            # Backward runs layers in reverse: the layer before this one is needed next.
            previous.prefetch()
        needs_grad = ctx.needs_input_grad[3:]
        detached = tuple(
            t.detach().requires_grad_(needs) for t, needs in zip(inputs, needs_grad, strict=True)
        )
        rng = plan.rng
        with torch.random.fork_rng(
            devices=rng[1] if rng is not None else [],
            enabled=rng is not None,
            device_type=plan.device_type,
        ):
            if rng is not None:
                torch.set_rng_state(rng[0])
                if rng[1]:
                    set_device_states(rng[1], rng[2], device_type=plan.device_type)
            device_autocast = (
                torch.amp.autocast(device_type=plan.device_type, **plan.autocast[0])
                if torch.amp.is_autocast_available(plan.device_type)
                else contextlib.nullcontext()
            )
            with (
                torch.enable_grad(),
                device_autocast,
                torch.amp.autocast("cpu", **plan.autocast[1]),
            ):
                out = plan.call(detached)
        leaves = pytree.tree_leaves(out)
        outputs: list[torch.Tensor] = []
        out_grads: list[torch.Tensor] = []
        for leaf, grad in zip(leaves, grads, strict=True):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad and grad is not None:
                outputs.append(leaf)
                out_grads.append(grad)
        if outputs:
            torch.autograd.backward(outputs, out_grads)
        input_grads = tuple(
            t.grad if needs else None for t, needs in zip(detached, needs_grad, strict=True)
        )
        return (None, None, None, *input_grads)


def _unpack(packed: Saved | torch.Tensor) -> torch.Tensor:
    return packed.tensor() if isinstance(packed, Saved) else packed


def checkpoint(
    function: Callable[..., R],
    *args: Any,
    store: TieredStore | None = None,
    preserve_rng_state: bool = True,
    **kwargs: Any,
) -> R:
    """Run ``function(*args, **kwargs)`` without keeping its activations; recompute in backward.

    Like ``torch.utils.checkpoint.checkpoint``, nothing ``function`` computes is kept for
    backward; unlike it, the inputs that are kept (a layer's hidden states, the attention mask)
    live in ``store`` and move down its tiers, as Unsloth's and axolotl's offloaded
    checkpointing do with host memory or disk. Gradients are bit-identical to running
    ``function`` without checkpointing: the RNG state of the forward is restored for the
    recompute (dropout draws the same mask), and so is autocast.

    Keyword arguments are passed through; tensors among them and inside nested containers or a
    ``functools.partial`` get their gradients too (Note: [Every input is an input]). Outputs may
    be a tensor or any nesting of tuples, lists and dicts with tensors and other values in it.
    Inputs need not require grad; parameters used inside ``function`` get their gradients
    either way. A nested call for the same module runs it directly, so wrapping a module's
    forward never recurses (Note: [Checkpoint without recursion]). With grad disabled (eval,
    ``torch.no_grad``) the function simply runs and nothing is stored.

    Args:
        function: the layer or function to checkpoint.
        *args: its positional arguments.
        store: where the inputs go; ``None`` means :func:`tierstore.default_store`. Inputs
            smaller than the store's ``min_bytes``, parameters and unsupported tensors stay in
            place and are counted in ``stats().skipped``.
        preserve_rng_state: restore the CPU and device RNG states for the recompute (default
            True); turn off only when ``function`` draws no random numbers.
        **kwargs: its keyword arguments.

    Returns:
        What ``function`` returns.

    Raises:
        RuntimeError: in backward, when used with ``torch.autograd.grad`` or
            ``backward(inputs=...)`` (the recompute runs a nested backward, as the reentrant
            ``torch.utils.checkpoint`` does).

    Example:
        >>> import torch, tierstore
        >>> layer = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.1))
        >>> with tierstore.TieredStore(host_bytes="64MiB", min_bytes=0) as store:
        ...     y = tierstore.checkpoint(layer, torch.randn(4, 8), store=store)
        ...     y.sum().backward()
        >>> layer[0].weight.grad.shape
        torch.Size([8, 8])
    """
    inner, bound_args, bound_kwargs = _unwrap(function)
    key = id(_owner(inner, bound_args))
    if key in _running():
        return _run_directly(function, args, kwargs)  # type: ignore[no-any-return]
    if not torch.is_grad_enabled():
        return function(*args, **kwargs)
    resolved = resolve_store(store)
    leaves, spec = pytree.tree_flatten((bound_args + args, {**bound_kwargs, **kwargs}))
    plan = _Plan(inner, key, leaves, spec, resolved, min_bytes_of(resolved, None))
    tensors = tuple(leaf for leaf in leaves if isinstance(leaf, torch.Tensor))
    placeholder = torch.empty(0, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(plan.pack, _unpack):
        out = _CheckpointFunction.apply(  # type: ignore[no-untyped-call]
            plan, preserve_rng_state, placeholder, *tensors
        )
    assert plan.out_spec is not None
    return pytree.tree_unflatten(list(out), plan.out_spec)  # type: ignore[no-any-return]
