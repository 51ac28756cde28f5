"""Which module a checkpointed function runs, and running it directly when it re-enters.

Note: [Checkpoint without recursion]
    Hugging Face layers checkpoint themselves (their ``forward`` hands ``partial(forward, self)``
    to the checkpoint function), and users wrap a module's forward with a function that calls
    ``checkpoint(module, ...)``. Either way the function may call back into ``checkpoint`` for
    the same module while it runs, and a naive implementation recurses without end. While a
    module's function runs under ``checkpoint`` (in forward or in the backward recompute), a
    nested ``checkpoint`` of that same module runs it directly, and where the module's
    ``forward`` was replaced on the instance, runs the class's own ``forward``. Each layer is
    thus checkpointed once and computed exactly once per forward and once per recompute.
    Checkpoints of different functions nest as in torch. A recompute marks what was marked
    when its forward ran, the enclosing checkpoints' modules too: marking only its own, a
    nested checkpoint of an enclosing module ran directly in the forward but became a
    checkpoint of its own in the recompute, which then saved other tensors than the forward
    (``CheckpointError``). Marks hold the objects, not only their ``id``: a recompute marking
    the ``id`` of an enclosing lambda already freed made a new lambda at that address run
    directly, and the recompute saved other tensors of the same shapes (wrong gradients). A
    frame remembers its enclosing owners weakly, though: held, an owner that keeps the inner
    checkpoint's output (``self.last_hidden = h``) closed a cycle through autograd's C++
    objects that no collection frees. An owner gone by the recompute cannot be running.

Note: [A wrapped forward runs the module's hooks once]
    ``layer.forward = partial(checkpoint, layer, ...)``: ``layer(x)`` runs the module's
    forward pre-hooks, then the wrapper, then its forward hooks. Had the checkpoint run
    ``layer`` itself, every hook would have run a second time inside it (a hook that scales
    the output scaled it twice), and with grad off, where nothing is marked running, the
    call entered the wrapper again without end. So when the checkpoint is called by the
    module's own call (the calling frame is ``Module._call_impl`` of this very module), it
    runs the class's ``forward``, in forward and in the recompute: each hook once per call,
    as without the wrapper. Wrappers between that call and the checkpoint (accelerate's
    hooks, a decorator) are looked through, up to ``_CALLER_FRAMES`` frames. Called
    directly, ``checkpoint(layer, x)`` still runs ``layer``, hooks included. Under
    ``torch.compile`` the module's call is compiled code, not found: checkpoint
    ``partial(type(layer).forward, layer)`` there, which runs no hooks twice anywhere.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import threading
import types
import weakref
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

__all__ = [
    "called_by_its_own_call",
    "is_running",
    "marked",
    "owner_of",
    "remember_running",
    "run_directly",
    "still_running",
    "unwrap",
]

_local = threading.local()


def _module_calls() -> frozenset[types.CodeType]:
    """The code of the frames a ``module(...)`` call runs ``forward`` from: ``_call_impl``,
    and the function nested in it that runs the hooks around ``forward`` when there are any."""
    codes = [
        getattr(torch.nn.Module, name).__code__
        for name in ("_call_impl", "_wrapped_call_impl")
        if hasattr(torch.nn.Module, name)
    ]
    nested = [c for code in codes for c in code.co_consts if isinstance(c, types.CodeType)]
    return frozenset(codes + nested)


_MODULE_CALLS = _module_calls()


def is_running(owner: object) -> bool:
    """Whether this module (or function) runs under a checkpoint on this thread."""
    return id(owner) in _running()


def _running() -> dict[int, list[Any]]:
    """``id(owner) -> [owner, marks]``: the owner is held, so its ``id`` names it alone."""
    running: dict[int, list[Any]] | None = getattr(_local, "running", None)
    if running is None:
        running = _local.running = {}
    return running


def remember_running() -> tuple[Callable[[], object], ...]:
    """What runs under a checkpoint on this thread now, for a recompute to mark again:
    weakly where the object allows it (Note: [Checkpoint without recursion])."""
    remembered: list[Callable[[], object]] = []
    for owner, _ in _running().values():
        try:
            remembered.append(weakref.ref(owner))
        except TypeError:  # a builtin or a class without weak references: it holds no graph
            remembered.append(functools.partial(_itself, owner))
    return tuple(remembered)


def still_running(remembered: tuple[Callable[[], object], ...]) -> list[object]:
    """The remembered owners that are still alive."""
    return [owner for owner in (recall() for recall in remembered) if owner is not None]


def _itself(owner: object) -> object:
    return owner


@contextlib.contextmanager
def marked(*owners: object) -> Iterator[None]:
    """Mark ``owners`` running on this thread within the block."""
    running = _running()
    for owner in owners:
        running.setdefault(id(owner), [owner, 0])[1] += 1
    try:
        yield
    finally:
        for owner in owners:
            mark = running[id(owner)]
            mark[1] -= 1
            if not mark[1]:
                del running[id(owner)]


def unwrap(
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


def owner_of(function: Callable[..., Any], args: tuple[Any, ...]) -> object:
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


def run_directly(
    function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    if isinstance(function, torch.nn.Module) and "forward" in function.__dict__:
        # The instance's forward was replaced by a wrapper that checkpoints this very module:
        # calling the module again would enter the wrapper again. Run the class's forward.
        return type(function).forward(function, *args, **kwargs)
    return function(*args, **kwargs)


_CALLER_FRAMES = 16
"""How far up the stack :func:`called_by_its_own_call` looks: wrappers between the module's
call and the checkpoint (accelerate's hooks, a decorator, ``torch.jit``'s slow path) add a
frame or two each."""


def called_by_its_own_call(module: object, depth: int) -> bool:
    """Whether the checkpoint runs inside ``module``'s own ``module(...)`` call, which has
    run its forward pre-hooks and runs its forward hooks after (Note: [A wrapped forward runs
    the module's hooks once]): one of the ``_CALLER_FRAMES`` frames above the caller ``depth``
    levels up is that call's.

    Only those frames' ``self`` is read; their locals (the module, its arguments) live until
    they return anyway.
    """
    if not isinstance(module, torch.nn.Module) or "forward" not in module.__dict__:
        return False
    frame: types.FrameType | None = sys._getframe(depth + 1)
    for _ in range(_CALLER_FRAMES):
        if frame is None:
            return False
        if frame.f_code in _MODULE_CALLS and frame.f_locals.get("self") is module:
            return True
        frame = frame.f_back
    return False
