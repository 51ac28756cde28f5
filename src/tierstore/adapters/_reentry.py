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
    Checkpoints of different functions nest as in torch.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

__all__ = ["is_running", "marked", "owner_of", "run_directly", "unwrap"]

_local = threading.local()


def is_running(key: int) -> bool:
    """Whether the module (or function) with this ``id`` runs under a checkpoint on this thread."""
    return key in _running()


def _running() -> dict[int, int]:
    running: dict[int, int] | None = getattr(_local, "running", None)
    if running is None:
        running = _local.running = {}
    return running


@contextlib.contextmanager
def marked(key: int) -> Iterator[None]:
    running = _running()
    running[key] = running.get(key, 0) + 1
    try:
        yield
    finally:
        running[key] -= 1
        if not running[key]:
            del running[key]


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
