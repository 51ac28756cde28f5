"""``checkpoint``: torch's non-reentrant activation checkpoint, its saved inputs in a store.

``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` keeps nothing a function computes
for backward but its inputs, and recomputes the rest when backward first needs it. This is the
same checkpoint, built on torch's own machinery for the recompute (its frame and saved-tensor
hooks: ``torch.autograd.grad``, ``context_fn`` for selective checkpointing, the determinism
check, nesting and early stop behave exactly as torch's), with one difference: the inputs it
keeps live in a :class:`~tierstore.TieredStore` rather than in device memory.

Note: [Inputs live in the store]
    torch's frame keeps each input as a saved variable, so a layer's input stays in memory
    until backward. Here the frame puts each input's storage into the store instead (once per
    storage, Note: [One storage, one entry]) and keeps only the record: a
    weak reference to the input and the store's handle. The recompute gets the input object
    itself while it is alive (someone else holds it, so its memory is in use anyway, and the
    function sees the very object it saw in the forward, attributes and all), and otherwise a
    tensor rebuilt from the store, bit-exact, with the input's ``requires_grad``, so that the
    recompute saves what the forward saved. An input written in place since raises as
    autograd does. Tensors among keyword arguments, inside containers and bound in a
    ``functools.partial`` are inputs too: torch would keep those alive through its closure.

Note: [Stores are independent]
    Checkpoints into different stores share nothing. Each store has its own table of stored
    storages: with one table for the process, ``checkpoint(f, x, store=B)`` after
    ``checkpoint(f, x, store=A)`` found ``x`` already stored, put nothing into B and read from
    A in backward. And a checkpoint is linked, for prefetching in backward, to the previous
    checkpoint made on its thread into the same store only: linked across stores, a backward
    through B prefetched from A, and raised ``StoreClosedError`` once A was closed.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import warnings
import weakref
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch
from torch.overrides import _get_current_function_mode_stack as _function_modes
from torch.utils import _pytree as pytree
from torch.utils import checkpoint as torch_checkpoint
from torch.utils._device import DeviceContext

from tierstore._fork_safe_lock import ForkSafeLock
from tierstore.adapters._common import min_bytes_of, resolve_store
from tierstore.adapters._reentry import (
    called_by_its_own_call,
    is_running,
    marked,
    owner_of,
    remember_running,
    run_directly,
    still_running,
    unwrap,
)
from tierstore.adapters._storage import Kept, Saved, StorageTable
from tierstore.errors import StoreClosedError, TensorReleasedError

if TYPE_CHECKING:
    from collections.abc import Callable, Generator, Sequence

    from tierstore._handle import TensorHandle
    from tierstore._sync import TieredStore

__all__ = ["checkpoint", "checkpoint_sequential"]

R = TypeVar("R")

_local = threading.local()
# One table per store, shared by every checkpoint into it: a mask handed to every layer is
# stored once. Per store, because a table that matched another store's entry would read from
# that store, and die with it (Note: [Stores are independent]).
_tables: weakref.WeakKeyDictionary[TieredStore, StorageTable] = weakref.WeakKeyDictionary()
_tables_lock = ForkSafeLock()
_warned_reentrant = False


def _table_of(store: TieredStore) -> StorageTable:
    with _tables_lock:
        table = _tables.get(store)
        if table is None:
            table = _tables[store] = StorageTable()
        return table


def _last_frames() -> weakref.WeakKeyDictionary[TieredStore, weakref.ref[_StoreFrame]]:
    """This thread's most recent checkpoint into each store (Note: [Stores are independent])."""
    frames: weakref.WeakKeyDictionary[TieredStore, weakref.ref[_StoreFrame]] | None = getattr(
        _local, "last_frames", None
    )
    if frames is None:
        frames = _local.last_frames = weakref.WeakKeyDictionary()
    return frames


class _Input:
    """An input kept in the store (Note: [Inputs live in the store]); ``checked``: whether a
    write in place since the forward raises (Note: [Which inputs torch checks])."""

    __slots__ = ("checked", "requires_grad", "saved")

    def __init__(self, saved: Saved, requires_grad: bool, checked: bool) -> None:
        self.saved = saved
        self.requires_grad = requires_grad
        self.checked = checked

    def at_hand(self) -> torch.Tensor | None:
        """The input object itself, if it is alive and the recompute may use it as it is."""
        alive = self.saved.source()
        if alive is not None and (not self.checked or alive._version == self.saved.version):
            return alive
        return None

    def get(self) -> torch.Tensor:
        alive = self.at_hand()
        if alive is not None:
            # The object itself, its memory in use anyway; nothing to fetch.
            self.saved.stored.count_unpacked(self.saved)
            return alive
        t = self.saved.tensor()  # raises if the input was written in place, as autograd does
        return t.detach().requires_grad_() if self.requires_grad else t


class _Same:
    """An argument that is the very tensor of an earlier one.

    Note: [One tensor passed twice is one tensor]
        ``attention(h, h, h)``: code takes other paths when arguments are the same object
        (``nn.MultiheadAttention`` projects ``query is key is value`` with one fused matmul).
        The recompute must see what the forward saw, so an argument that was the same tensor
        as an earlier one is given the earlier one's object, rebuilt once; rebuilt one by one,
        the recompute saved other tensors than the forward and raised ``CheckpointError``.
    """

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


_FRAME_READS_INPUTS = hasattr(torch_checkpoint._CheckpointFrame, "get_inputs")
"""Whether torch's unpack hook reads a frame's inputs through ``frame.get_inputs()``.

Before that method existed, the hook read them as ``frame.input_saver.grad_fn.get_args(
ctx.saved_tensors)``, from an autograd node that saved them; :class:`_InputSaver` answers the
same calls from the store (seen on torch 2.11, where a checkpoint's backward otherwise fails
with ``'NoneType' object has no attribute 'grad_fn'``)."""


_STATES_TAKE_TYPE = (
    "device_type" in inspect.signature(torch_checkpoint.set_device_states).parameters
)
"""Whether torch's ``set_device_states`` takes ``device_type`` (older releases infer it)."""


class _InputSaver:
    """``frame.input_saver`` for torch without ``_CheckpointFrame.get_inputs``: its
    ``grad_fn`` hands torch's unpack hook the frame's inputs, fetched from the store."""

    saved_tensors: tuple[torch.Tensor, ...] = ()

    def __init__(self, frame: _StoreFrame) -> None:
        self._frame = weakref.ref(frame)  # the frame holds this object: no cycle

    @property
    def grad_fn(self) -> _InputSaver:
        return self

    def get_args(self, saved_tensors: tuple[torch.Tensor, ...]) -> list[Any]:
        frame = self._frame()
        assert frame is not None, "a checkpoint's inputs were read after its frame died"
        return frame.get_inputs()


class _StoreFrame(torch_checkpoint._CheckpointFrame):
    """torch's checkpoint frame, with its inputs in a store instead of saved variables."""

    def __init__(
        self, recompute_fn: Callable[..., None], early_stop: bool, unpack_error_cb: Any,
        metadata_fn: Any, store: TieredStore, min_bytes: int,
    ) -> None:  # fmt: skip
        super().__init__(recompute_fn, early_stop, unpack_error_cb, metadata_fn)
        self.store = store
        self.min_bytes = min_bytes
        # The checkpoint run just before this one on this thread into this store: backward
        # recomputes in reverse, so its inputs are needed next.
        self.prev: weakref.ref[_StoreFrame] | None = None
        self.held_back = False
        """Its inputs at hand were held back in the store (Note: [Held back])."""
        if not _FRAME_READS_INPUTS:
            self.input_saver = _InputSaver(self)

    def save_inputs(self, *args: Any, checked: Sequence[bool] = ()) -> None:
        """Keep ``args`` (the flattened inputs) in the store; ``checked[i]``: whether a write
        in place to ``args[i]`` since the forward raises (default: every one).

        Note: [Which inputs torch checks]
            torch's checkpoint saves its top-level positional tensor arguments for backward,
            and autograd checks those for writes in place; it holds keyword arguments, tensors
            nested in containers and a ``functools.partial``'s bound ones in a closure, and
            its recompute uses them as they are then. Checking every input raised where
            torch's checkpoint trains (a statistics buffer updated in place by the forward,
            passed as a keyword). So only the ones torch saves are checked; the others, if
            still alive, are handed to the recompute as they are, as torch does; once dead,
            they are rebuilt from the store. One the forward itself wrote (a statistics
            buffer) is held as it is from the forward's end (:meth:`hold_inputs_written`).
            What still raises where torch trains: an unchecked input that dies after the
            forward, then is written through a view or base that lives on.
        """
        table = _table_of(self.store)
        check = dict.fromkeys((id(a) for a in args if isinstance(a, torch.Tensor)), False)
        for arg, c in zip(args, checked or [True] * len(args), strict=True):
            if c and isinstance(arg, torch.Tensor):
                check[id(arg)] = True  # checked wherever torch would check one of its places
        saved: list[Any] = []
        first: dict[int, int] = {}  # id of a tensor argument -> where it was saved
        for arg in args:
            if not isinstance(arg, torch.Tensor):
                saved.append(arg)
                continue
            if id(arg) in first:  # Note: [One tensor passed twice is one tensor]
                saved.append(_Same(first[id(arg)]))
                continue
            first[id(arg)] = len(saved)
            packed = table.offload(self.store, arg, self.min_bytes)
            saved.append(
                # Held as torch's frame holds it, its version checked as autograd would.
                _Input(packed, arg.requires_grad, check[id(arg)])
                if isinstance(packed, Saved)
                else Kept(arg, detach=False, checked=check[id(arg)])
            )
        self.saved_args = saved

    def hold_inputs_written(self) -> None:
        """At the forward's end: hold as they are the unchecked inputs it wrote in place.

        Their stored bytes are from before the write, and the recompute must get what torch's
        would, the tensor as it is then; a temporary (``stats=torch.zeros(n)``) or a view
        (``stats=buf[1]``) dies with the call, and its record could then only raise. Inputs
        the forward left alone stay in the store (Note: [Which inputs torch checks]).
        """
        for i, arg in enumerate(self.saved_args):
            if isinstance(arg, _Input) and not arg.checked:
                alive = arg.saved.source()
                if alive is not None and alive._version != arg.saved.version:
                    self.saved_args[i] = Kept(alive, detach=False, checked=False)

    def get_inputs(self) -> list[Any]:
        previous = self.prev() if self.prev is not None else None
        self.hold_back_at_hand()  # before a get starts the store's walk
        if previous is not None:
            previous.prefetch()
        inputs: list[Any] = []
        for a in self.saved_args:
            if isinstance(a, _Same):
                inputs.append(inputs[a.index])
            else:
                inputs.append(
                    a.get() if isinstance(a, _Input) else a.tensor() if isinstance(a, Kept) else a
                )
        return inputs

    def prefetch(self) -> None:
        """Bring this frame's inputs back ahead of its recompute, but for those at hand."""
        wanted = self._stored_inputs(at_hand=False)
        if wanted:
            self.store.prefetch(wanted)

    def _stored_inputs(self, *, at_hand: bool) -> list[TensorHandle]:
        """The handles of this frame's inputs in the store that are, or are not, at hand."""
        return [
            a.saved.stored.handle
            for a in self.saved_args
            if isinstance(a, _Input) and (a.at_hand() is not None) == at_hand
        ]

    def hold_back_at_hand(self) -> None:
        """Keep the store from reading back the inputs that recomputes will take as the live
        objects (Note: [Held back] in ``core/_prefetch.py``): this frame's and those of every
        older frame of its chain not held back yet: the chain's first recompute marks them
        all before its first get starts the store's walk, which runs ahead of the frames' own
        prefetches, and the marks last for a retained graph's next backward."""
        at_hand: list[TensorHandle] = []
        frame: _StoreFrame | None = self
        while frame is not None and not frame.held_back:
            frame.held_back = True
            at_hand += frame._stored_inputs(at_hand=True)
            frame = frame.prev() if frame.prev is not None else None
        if at_hand:
            # A hint: with the store closed, or its handles gone (in a forked child), the live
            # objects still serve the recompute; a get of a dead one raises as before.
            with contextlib.suppress(StoreClosedError, TensorReleasedError):
                self.store.hold_back(at_hand)


def _check_reentrant(use_reentrant: bool | None) -> None:
    global _warned_reentrant
    if use_reentrant and not _warned_reentrant:
        _warned_reentrant = True
        warnings.warn(
            "tierstore.checkpoint is always non-reentrant (what torch recommends); "
            "use_reentrant=True is accepted for drop-in use and ignored",
            UserWarning,
            stacklevel=3,
        )


def _checked_by_torch(positional: tuple[Any, ...], bound: int, named: dict[str, Any]) -> list[bool]:
    """For each leaf of ``(positional, named)`` flattened, whether torch's checkpoint checks
    it for writes in place (Note: [Which inputs torch checks]): the top-level positional
    tensors it was given, not those a ``functools.partial`` bound, which it sees only as the
    function."""
    checked: list[bool] = []
    for i, arg in enumerate(positional):
        top = i >= bound and isinstance(arg, torch.Tensor)
        checked += [top] * len(pytree.tree_leaves(arg))
    return checked + [False] * len(pytree.tree_leaves(named))


def _frames(
    function: Callable[..., Any],
    leaves: list[Any],
    checked: list[bool],
    spec: pytree.TreeSpec,
    owner: object,
    store: TieredStore,
    preserve_rng_state: bool,
    context_fn: Callable[[], tuple[Any, Any]],
    determinism_check: str,
    debug: bool,
    early_stop: bool,
) -> Generator[None, None, None]:
    """torch's ``_checkpoint_without_reentrant_generator`` with a :class:`_StoreFrame`.

    Yields once: the caller runs the function's forward in between.
    """
    tc = torch_checkpoint
    unpack_error_cb = None
    debug_enabled = getattr(tc, "_checkpoint_debug_enabled", None)
    if debug_enabled if debug_enabled is not None else debug:
        if context_fn is not tc.noop_context_fn:
            raise ValueError("debug=True is incompatible with a non-default context_fn")
        context_fn, unpack_error_cb = tc._get_debug_context_and_cb()
    checks = tc._allowed_determinism_checks_to_fns
    if determinism_check not in checks:
        raise ValueError(
            f"determinism_check={determinism_check!r}: must be one of {sorted(checks)}"
        )
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    device_type = tc._infer_device_type(*tensors)  # type: ignore[no-untyped-call]
    # The recompute respects a ``with torch.device(...)`` around the forward, as torch's does.
    device_ctx: Any = next(
        (
            m
            for m in reversed(_function_modes())  # type: ignore[no-untyped-call]
            if isinstance(m, DeviceContext)
        ),
        contextlib.nullcontext(),
    )
    device_module = tc._get_device_module(device_type)  # type: ignore[no-untyped-call]
    forward_context, recompute_context = context_fn()
    device_autocast, cpu_autocast = tc._get_autocast_kwargs(device_type)  # type: ignore[no-untyped-call]
    had_device = preserve_rng_state and getattr(device_module, "_initialized", False)
    cpu_state = torch.get_rng_state() if preserve_rng_state else None
    devices: list[int] = []
    device_states: list[torch.Tensor] = []
    if had_device:
        devices, device_states = tc.get_device_states(*tensors)
    # Note: [Checkpoint without recursion]: the recompute runs as the forward did, inside
    # every checkpoint that encloses this one.
    enclosing = remember_running()

    def recompute(*inputs: Any) -> None:
        with torch.random.fork_rng(
            devices=devices, enabled=preserve_rng_state, device_type=device_type
        ):
            if cpu_state is not None:
                torch.set_rng_state(cpu_state)
                if had_device:
                    typed = {"device_type": device_type} if _STATES_TAKE_TYPE else {}
                    tc.set_device_states(devices, device_states, **typed)
            autocast = (
                torch.amp.autocast(device_type=device_type, **device_autocast)
                if torch.amp.is_autocast_available(device_type)
                else contextlib.nullcontext()
            )
            args, kwargs = pytree.tree_unflatten(list(inputs), spec)
            with (
                autocast,
                torch.amp.autocast("cpu", **cpu_autocast),
                recompute_context,
                device_ctx,
                marked(owner, *still_running(enclosing)),
            ):
                function(*args, **kwargs)

    stop = getattr(tc, "_enable_checkpoint_early_stop", None)
    frame = _StoreFrame(
        recompute,
        early_stop if stop is None else stop,
        unpack_error_cb,
        checks[determinism_check],
        store,
        min_bytes_of(store, None),
    )
    frame.save_inputs(*leaves, checked=checked)
    last = _last_frames()
    frame.prev = last.get(store)
    last[store] = weakref.ref(frame)
    with tc._checkpoint_hook(frame), forward_context:
        yield
    frame.hold_inputs_written()
    frame.forward_completed = True
    if preserve_rng_state and not had_device and getattr(device_module, "_initialized", False):
        raise RuntimeError(
            "the device's RNG state was initialised inside a checkpointed function; "
            "initialise it before (any device operation does) or pass preserve_rng_state=False"
        )


def checkpoint(
    function: Callable[..., R],
    *args: Any,
    store: TieredStore | None = None,
    use_reentrant: bool | None = None,
    context_fn: Callable[[], tuple[Any, Any]] = torch_checkpoint.noop_context_fn,
    determinism_check: str = "default",
    debug: bool = False,
    early_stop: bool = True,
    preserve_rng_state: bool = True,
    **kwargs: Any,
) -> R:
    """Run ``function(*args, **kwargs)`` without keeping its activations; recompute in backward.

    The semantics of ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``, which torch
    recommends: nothing ``function`` computes is kept for backward, and the recompute runs when
    backward first needs it, with the forward's RNG state (dropout draws the same mask) and
    autocast, so gradients are bit-identical to running ``function`` without checkpointing.
    ``torch.autograd.grad`` and ``backward(inputs=...)`` work; ``context_fn`` selects what to
    keep (``torch.utils.checkpoint.create_selective_checkpoint_contexts``); a recompute that
    saves tensors of other shapes or dtypes than the forward raises ``CheckpointError``;
    checkpoints nest, and a parameter's gradient hook fires once per backward. Unlike torch's,
    the inputs it keeps (a layer's hidden states, the attention mask) live in ``store`` and
    move down its tiers (Note: [Inputs live in the store]); the recompute gets the input
    objects themselves while they are alive.

    Keyword arguments are passed through; tensors among them and inside nested containers or a
    ``functools.partial`` are kept in the store too. Outputs may be any structure. A nested
    call for the same module runs it directly, so wrapping a module's forward never recurses
    (Note: [Checkpoint without recursion]). With grad disabled (eval, ``torch.no_grad``) the
    function simply runs and nothing is stored.

    Args:
        function: the layer or function to checkpoint.
        *args: its positional arguments.
        store: where the inputs go; ``None`` means :func:`tierstore.default_store`. Inputs
            smaller than the store's ``min_bytes``, parameters and unsupported tensors stay in
            place (held as torch holds them) and are counted in ``stats().skipped``.
        use_reentrant: accepted for drop-in use (``gradient_checkpointing_kwargs``); the
            checkpoint is always non-reentrant, and ``True`` warns once.
        context_fn: returns two context managers, for the forward and for the recompute
            (default: none), as in torch.
        determinism_check: ``"default"`` compares the recomputed tensors' shapes, dtypes and
            devices with the forward's; ``"none"`` does not.
        debug: record the operators run in forward and recompute for error messages.
        early_stop: stop the recompute once every needed tensor is recomputed (default True).
        preserve_rng_state: restore the CPU and device RNG states for the recompute (default
            True); turn off only when ``function`` draws no random numbers.
        **kwargs: its keyword arguments.

    Returns:
        What ``function`` returns.

    Raises:
        ValueError: an unknown ``determinism_check``, or ``debug`` with a ``context_fn``.
        torch.utils.checkpoint.CheckpointError: in backward, the recompute saved different
            tensors than the forward.
        RuntimeError: in backward, an input was modified in place after the forward.

    Example:
        >>> import torch, tierstore
        >>> layer = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.1))
        >>> with tierstore.TieredStore(host_bytes="64MiB", min_bytes=0) as store:
        ...     y = tierstore.checkpoint(layer, torch.randn(4, 8), store=store)
        ...     y.sum().backward()
        >>> layer[0].weight.grad.shape
        torch.Size([8, 8])
    """
    if torch.compiler.is_compiling():
        # Dynamo would trace into the frame and its hooks, and the recompute in backward (run
        # eagerly) would then not match the traced forward. A graph break here runs the
        # checkpoint, and the layer inside it, eagerly; the code around it stays compiled.
        run: Any = torch.compiler.disable(checkpoint)  # type: ignore[no-untyped-call]
        return run(  # type: ignore[no-any-return]
            function, *args, store=store, use_reentrant=use_reentrant, context_fn=context_fn,
            determinism_check=determinism_check, debug=debug, early_stop=early_stop,
            preserve_rng_state=preserve_rng_state, **kwargs,
        )  # fmt: skip
    _check_reentrant(use_reentrant)
    if called_by_its_own_call(function, depth=1):
        # Note: [A wrapped forward runs the module's hooks once]
        module = cast("torch.nn.Module", function)
        function = functools.partial(type(module).forward, module)
    inner, bound_args, bound_kwargs = unwrap(function)
    owner = owner_of(inner, bound_args)
    if is_running(owner):
        return run_directly(function, args, kwargs)  # type: ignore[no-any-return]
    if not torch.is_grad_enabled():
        return function(*args, **kwargs)
    resolved = resolve_store(store)
    positional, named = bound_args + args, {**bound_kwargs, **kwargs}
    leaves, spec = pytree.tree_flatten((positional, named))
    checked = _checked_by_torch(positional, len(bound_args), named)
    frames = _frames(
        inner, leaves, checked, spec, owner, resolved, preserve_rng_state, context_fn,
        determinism_check, debug, early_stop,
    )  # fmt: skip
    next(frames)
    try:
        with marked(owner):
            out = inner(*(bound_args + args), **{**bound_kwargs, **kwargs})
    except BaseException as err:
        # The error goes through the frame's contexts, as torch's checkpoint sends it: left
        # suspended, the generator would keep the checkpoint's saved-tensor hooks and the
        # ``context_fn`` modes pushed for as long as the error's traceback lives (an
        # ``except`` that retries, a notebook's last traceback).
        try:
            frames.throw(err)
        except StopIteration as stop:
            raise RuntimeError(
                "tierstore.checkpoint: the forward context from context_fn suppressed an "
                f"exception raised in the checkpointed function ({err!r}); a failed forward "
                "has no value to return"
            ) from stop
        raise
    with contextlib.suppress(StopIteration):
        next(frames)
    return out  # type: ignore[no-any-return]


def checkpoint_sequential(
    functions: torch.nn.Sequential | list[torch.nn.Module],
    segments: int,
    input: torch.Tensor,
    *,
    store: TieredStore | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """Run ``functions`` in ``segments`` checkpointed chunks, as torch's
    ``checkpoint_sequential``; each chunk's input lives in ``store``.

    The last chunk runs without checkpointing (its activations are needed first in backward),
    as in torch. ``kwargs`` go to each :func:`checkpoint` call (``preserve_rng_state``,
    ``context_fn``, ...).

    Raises:
        ValueError: ``segments`` is not a positive integer.
    """
    if isinstance(segments, bool) or not isinstance(segments, int) or segments < 1:
        raise ValueError(f"segments={segments!r}: expected a positive number of chunks")
    layers = list(functions.children()) if isinstance(functions, torch.nn.Sequential) else functions
    size = max(1, len(layers) // segments)

    def run(start: int, end: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def chunk(x: torch.Tensor) -> torch.Tensor:
            for layer in layers[start : end + 1]:
                x = layer(x)
            return x

        return chunk

    end = -1
    for start in range(0, size * (segments - 1), size):
        end = start + size - 1
        input = checkpoint(run(start, end), input, store=store, **kwargs)
    return run(end + 1, len(layers) - 1)(input)
