"""``offload_activations``: saved-tensor hooks that keep what autograd saves in a TieredStore.

See Note: [One storage, one entry] and Note: [The graph owns the entries] in ``_storage.py``.
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch.autograd.graph import saved_tensors_hooks

from tierstore.adapters._common import check_min_bytes, min_bytes_of, resolve_store
from tierstore.adapters._storage import Saved, StorageTable, Stored

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

    from tierstore._handle import TensorHandle
    from tierstore._sync import TieredStore

__all__ = ["offload_activations"]

# How far ahead of backward unpack asks the store to bring tensors back, when the store's
# configuration does not say.
_DEFAULT_PREFETCH_BYTES = 256 << 20


class _Session:
    """One ``with offload_activations(...)`` block: its store, thresholds and save order."""

    __slots__ = (
        "__weakref__",
        "_lock",
        "_low",
        "_order",
        "min_bytes",
        "prefetch_bytes",
        "store",
        "table",
    )

    def __init__(self, store: TieredStore, min_bytes: int) -> None:
        self.store = store
        self.min_bytes = min_bytes
        config = getattr(store, "config", None)
        window = getattr(config, "prefetch_bytes", None)
        self.prefetch_bytes = window if isinstance(window, int) else _DEFAULT_PREFETCH_BYTES
        self.table = StorageTable()
        self._lock = threading.Lock()
        # Save order, for prefetching newest-first; weak (Note: [The graph owns the entries]).
        self._order: list[weakref.ref[Stored]] = []
        # Lowest save index already asked for by prefetch; None until backward starts.
        self._low: int | None = None

    # -- forward ---------------------------------------------------------------------------

    def exclude_buffers(self, module: torch.nn.Module) -> None:
        for buf in module._buffers.values():
            if buf is not None:
                self.table.exclude(buf)

    def pack(self, t: torch.Tensor) -> Saved | torch.Tensor:
        return self.table.offload(self.store, t, self.min_bytes, self._number)

    def _number(self, stored: Stored) -> None:
        with self._lock:
            index = len(self._order)
            self._order.append(weakref.ref(stored))
        stored.before_first_get = functools.partial(self.prefetch_before, index)

    # -- backward --------------------------------------------------------------------------

    def prefetch_before(self, index: int) -> None:
        """Ask the store for the entries saved just before ``index``: backward needs them next.

        Each entry is asked for once; the window is ``prefetch_bytes`` below ``index``.
        """
        handles: list[TensorHandle] = []
        with self._lock:
            low = len(self._order) if self._low is None else self._low
            budget = self.prefetch_bytes
            j = index - 1
            while j >= 0 and budget > 0:
                stored = self._order[j]()
                if stored is not None:
                    budget -= stored.handle.nbytes
                    if j < low:
                        handles.append(stored.handle)
                j -= 1
            self._low = min(low, j + 1)
        if handles:
            self.store.prefetch(handles)


def _unpack(packed: Any) -> torch.Tensor:
    if isinstance(packed, Saved):
        return packed.tensor()
    assert isinstance(packed, torch.Tensor)
    return packed


class offload_activations:
    """Keep the tensors autograd saves for backward in a :class:`~tierstore.TieredStore`.

    Inside the block, every tensor autograd saves goes through the store: it moves down the
    tiers (device -> host -> disk) as the store's capacities dictate and comes back, newest
    first, when backward needs it. Gradients are bit-identical to training without it.

    Left where they are (and counted in ``stats().skipped`` by reason):
    tensors under ``min_bytes`` (``below_min_bytes``), parameters, views of parameters and
    buffers of modules called inside the block (``parameter_or_buffer``), sparse, nested, meta,
    quantized and subclass tensors (``unsupported``), and tensors no tier has room for
    (``no_room``; a warning is shown once per store; nothing is ever dropped).

    Tensors that share one storage are stored once; see Note: [One storage, one entry]. The
    graph owns what is stored: a forward that never runs backward frees everything it stored
    when its graph is dropped. Non-reentrant ``torch.utils.checkpoint`` regions inside the
    block keep their own (recomputed) activations; their outputs are offloaded as usual. A
    saved tensor modified in place before backward raises as it would without hooks (Note:
    [Version check]).

    Args:
        store: the store to use; ``None`` means :func:`tierstore.default_store`, resolved when
            the block is entered.
        min_bytes: tensors smaller than this many bytes stay where they are. Default ``None``:
            the store's ``min_bytes`` (``TIERSTORE_MIN_BYTES``, 1 MiB unless configured).

    Raises:
        ValueError: ``min_bytes`` is negative or not an integer.

    Example:
        >>> import torch, tierstore
        >>> store = tierstore.TieredStore(host_bytes="64MiB", min_bytes=0)
        >>> x = torch.randn(64, 64, requires_grad=True)
        >>> with tierstore.offload_activations(store):
        ...     loss = (x.exp() * 2).sum()
        >>> loss.backward()
        >>> torch.equal(x.grad, 2 * x.exp())
        True
        >>> store.close()
    """

    def __init__(self, store: TieredStore | None = None, *, min_bytes: int | None = None) -> None:
        check_min_bytes(min_bytes)
        self._store_arg = store
        self._min_bytes = min_bytes
        # Per thread, one entry per active block: one object may be entered again, nested, or
        # on several threads at once.
        self._local = threading.local()

    def _active(self) -> list[tuple[saved_tensors_hooks, RemovableHandle]]:
        active: list[tuple[saved_tensors_hooks, RemovableHandle]] | None = getattr(
            self._local, "active", None
        )
        if active is None:
            active = self._local.active = []
        return active

    @property
    def store(self) -> TieredStore:
        """The store this block puts tensors into."""
        return resolve_store(self._store_arg)

    def __enter__(self) -> offload_activations:
        store = resolve_store(self._store_arg)
        session = _Session(store, min_bytes_of(store, self._min_bytes))
        weak_session = weakref.ref(session)

        def collect_buffers(module: torch.nn.Module, args: object) -> None:
            s = weak_session()
            if s is not None:
                s.exclude_buffers(module)

        # The pack hook holds the session; the graph's records hold it too, so it lives while
        # the block runs and while anything it stored lives.
        hooks = saved_tensors_hooks(session.pack, _unpack)
        # First, so that a refusal (torch disables saved-tensor hooks under some compilers and
        # checkpoint modes) leaves no global module hook behind.
        hooks.__enter__()
        try:
            hook = torch.nn.modules.module.register_module_forward_pre_hook(collect_buffers)
        except BaseException:
            hooks.__exit__(None, None, None)
            raise
        self._active().append((hooks, hook))
        return self

    def __exit__(self, *exc_info: object) -> None:
        hooks, hook = self._active().pop()
        hooks.__exit__(*exc_info)
        hook.remove()
