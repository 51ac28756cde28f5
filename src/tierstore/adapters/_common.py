"""What the adapters share: which store, which tensors are worth moving, how skips are counted."""

from __future__ import annotations

import functools
import inspect
import sys
import warnings
import weakref
from typing import TYPE_CHECKING, TypeVar

import torch

from tierstore._fork_safe_lock import ForkSafeLock
from tierstore.config import MiB
from tierstore.core._checks import check_min_bytes, unsupported

if TYPE_CHECKING:
    from collections.abc import Callable

    from tierstore._sync import TieredStore

F = TypeVar("F", bound="Callable[..., object]")

__all__ = [
    "NO_ROOM",
    "PARAMETER",
    "SMALL",
    "UNSUPPORTED",
    "check_min_bytes",
    "check_store",
    "min_bytes_of",
    "resolve_store",
    "traced_stand_in",
    "unsupported_reason",
    "untraced",
    "unwrap",
    "warn_no_room",
]


# Reasons an adapter leaves a tensor where it is; they are the keys of StoreStats.skipped.
SMALL = "below_min_bytes"
PARAMETER = "parameter_or_buffer"
UNSUPPORTED = "unsupported"
NO_ROOM = "no_room"


def resolve_store(store: TieredStore | None) -> TieredStore:
    """``store``, or the process-wide default store when it is None.

    Raises:
        TypeError: ``store`` is not a store (see :func:`check_store`).
    """
    if store is not None:
        check_store(store)
        return store
    from tierstore._sync import default_store

    return default_store()


def check_store(store: object) -> None:
    """Raise TypeError unless ``store`` is None or a synchronous store (anything with the
    ``put`` and ``get`` of :class:`~tierstore.TieredStore`): a model, a path or an
    ``AsyncTieredStore`` failed only at the first forward, with an ``AttributeError`` or a
    coroutine never awaited."""
    if store is None:
        return
    put, get = getattr(store, "put", None), getattr(store, "get", None)
    if callable(put) and callable(get) and not inspect.iscoroutinefunction(put):
        return
    hint = (
        "; the adapters call the store from autograd's threads, synchronously: pass a TieredStore"
        if callable(put)
        else ""
    )
    raise TypeError(
        f"store={store!r}: expected a tierstore.TieredStore, or None for the default store{hint}"
    )


def min_bytes_of(store: TieredStore, min_bytes: int | None) -> int:
    """The adapter's threshold: the explicit value, else the store's configured ``min_bytes``."""
    check_min_bytes(min_bytes)
    if min_bytes is not None:
        return min_bytes
    config = getattr(store, "config", None)
    value = getattr(config, "min_bytes", None)
    return value if isinstance(value, int) else MiB


def unsupported_reason(t: torch.Tensor) -> str | None:
    """Why ``t`` cannot be kept as its storage's plain bytes and rebuilt from them, or None.

    What ``put`` refuses (the store's own rule: subclasses, sparse, nested, quantized, other
    devices, meta), and a lazy conjugate or negative bit, which is not part of the bytes.
    """
    why = unsupported(t)
    if why is None and (t.is_conj() or t.is_neg()):
        return "lazy conj/neg bit"
    return why


def _class_in(modules: tuple[str, ...], name: str) -> type | None:
    """Class ``name`` from the first of ``modules`` already imported that has it."""
    for module in modules:
        cls = getattr(sys.modules.get(module), name, None)
        if isinstance(cls, type):
            return cls
    return None


def unwrap(t: torch.Tensor) -> tuple[torch.Tensor, object]:
    """The plain tensor that holds ``t``'s bytes, and the DTensor spec to rebuild ``t`` with.

    For a plain tensor: itself and None. For a ``DTensor``: its local shard and its spec (Note:
    [A DTensor stores its shard]). For an ``AsyncCollectiveTensor`` (what
    a collective hands out before it is waited on, the output of a row-wise parallel layer
    and often a DTensor's shard): the waited result, as any use of it would wait. Any other
    subclass comes back as itself; :func:`unsupported_reason` refuses it.

    Looks only in modules already imported: neither class can exist before its module is,
    and importing ``torch.distributed.tensor`` for every saved tensor would cost seconds once.
    """
    if type(t) is torch.Tensor:
        return t, None
    spec: object = None
    # torch.distributed.tensor since torch 2.5; torch.distributed._tensor before.
    dtensor = _class_in(("torch.distributed.tensor", "torch.distributed._tensor"), "DTensor")
    if dtensor is not None and isinstance(t, dtensor):
        spec = t._spec  # type: ignore[attr-defined]
        t = t._local_tensor  # type: ignore[attr-defined]
    pending = _class_in(("torch.distributed._functional_collectives",), "AsyncCollectiveTensor")
    if pending is not None and isinstance(t, pending):
        t = t.trigger_wait()  # type: ignore[attr-defined]
    return t, spec


def traced_stand_in(t: torch.Tensor) -> bool:
    """Whether ``t`` is a stand-in that torch traces a graph with, not a tensor being saved.

    torch 2.4's AOTAutograd traces a compiled graph's backward with the saved-tensor hooks
    still installed, so the hooks see its ``FakeTensor`` and ``FunctionalTensor`` stand-ins (later
    versions trace without them). They have no bytes to move; the adapters leave them alone
    without counting them as refused. The graph's real saved tensors come to the hooks when it
    runs.
    """
    if type(t) is torch.Tensor:
        return False
    return any(
        cls is not None and isinstance(t, cls)
        for cls in (
            _class_in(("torch._subclasses.fake_tensor",), "FakeTensor"),
            _class_in(("torch._subclasses.functional_tensor",), "FunctionalTensor"),
        )
    )


def untraced(fn: F) -> F:
    """``fn``, or ``fn`` made opaque to ``torch.compile`` when Dynamo is loaded.

    Note: [Hooks run eagerly under torch.compile]
        autograd calls the pack and unpack hooks wherever a tensor is saved or needed: from
        a compiled graph's runtime, and from a compiled function's eager stretches (after a
        graph break), where Dynamo would trace them as user code. It did: it graph-broke on
        the store's thread checks (a warning about ``_thread.get_ident``), half-built a
        ``StorageWeakRef`` it then dropped ("Exception ignored in StorageWeakRef.__del__"),
        and compiled the ``set_`` that views a storage as bytes into a graph, so that the
        store saw the bytes change after ``put`` (``TensorModifiedError`` in backward).
        Moving bytes to another thread and back has no place in a graph: the hooks are
        wrapped in ``torch.compiler.disable``, which runs them and all they call eagerly.
        The wrapping is decided when a block is entered: importing Dynamo costs a second,
        and until something imported it (``torch.compile`` does, when it wraps a function
        or module) no compiled code exists that could call the hooks. A block entered before
        the process's first ``torch.compile`` gets plain hooks; for them, and for callers
        Dynamo traces (a checkpoint inside a compiled function), ``StorageTable.offload`` and
        ``Saved.tensor`` hand their call to an eager run when they find themselves traced
        (``torch.compiler.is_compiling()``, a plain flag when nothing compiles).
    """
    if "torch._dynamo" not in sys.modules:
        return fn
    disabled = torch.compiler.disable(fn)  # type: ignore[no-untyped-call]

    @functools.wraps(fn)
    def eager(*args: object) -> object:
        # torch 2.4 traces a compiled graph's backward (with FX) with the hooks installed, and
        # refuses to trace into a disabled function; there the hooks see only stand-ins
        # (:func:`traced_stand_in`) and run as they are.
        if _fx_tracing():
            return fn(*args)
        return disabled(*args)

    return eager  # type: ignore[return-value]


def _fx_tracing() -> bool:
    # The flag itself: torch.fx's is_fx_tracing() logs a warning on every call since 2.5.
    return bool(getattr(torch.fx._symbolic_trace, "_is_fx_tracing_flag", False))


_warned_lock = ForkSafeLock()
# Weak: a store made later at a closed one's address still warns, and closed ones go.
_warned: weakref.WeakSet[object] = weakref.WeakSet()


def warn_no_room(store: TieredStore, t: torch.Tensor, err: BaseException) -> None:
    """Warn once per store that a tensor stayed in place because no tier had room."""
    with _warned_lock:
        try:
            if store in _warned:
                return
            _warned.add(store)
        except TypeError:  # a stand-in that takes no weak reference: warned each time
            pass
    # The store's own message names the byte view the adapters put ("a 2.0 MiB uint8
    # tensor"); this one names the caller's tensor, so only the tiers' state is kept.
    tiers = str(err).partition(": ")[2] or str(err)
    msg = (
        f"tierstore: no tier had room for a {tuple(t.shape)} "
        f"{str(t.dtype).removeprefix('torch.')} tensor on {t.device} ({tiers}); it stays "
        "where it is and training goes on. Raise TIERSTORE_HOST_BYTES or TIERSTORE_DISK_BYTES; "
        "stats().skipped['no_room'] counts every such tensor. This warning is shown once per "
        "store."
    )
    # A warning only, as the adapters' other warnings: logged too, it showed twice.
    warnings.warn(msg, RuntimeWarning, stacklevel=3)
