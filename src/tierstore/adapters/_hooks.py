"""``offload_activations``: saved-tensor hooks that keep what autograd saves in a TieredStore.

See Note: [One storage, one entry] and Note: [The graph owns the entries].

Note: [Buffers are found on the stack]
    A module's buffer (a causal mask, rotary tables) stays in memory whatever autograd saves,
    so storing it would only copy it. The buffers excluded are those of the modules being
    called when autograd saves the tensor, and of all their submodules, collected once per
    block: each ``module(...)`` call runs ``Module._wrapped_call_impl``, whose frame on the
    stack holds the module. Only those frames' locals are read: in Python before 3.13,
    reading a frame's locals leaves a snapshot of them on the frame until it returns, which
    would keep a forward's rebound tensors alive; that frame's locals (the module, its
    arguments) live until it returns anyway. A compiled module is found by its outermost
    call (the compiled code inside has no such frames), and its submodules with it. Only
    tensors that could be a buffer start the walk: big enough to store, no ``grad_fn``, no
    ``requires_grad`` (inputs, masks), a few per layer. A process-wide forward pre-hook
    (``register_module_forward_pre_hook``) used to collect them instead; it ran on every
    module call of every thread while a block was open, made ``torch.compile(module)`` warn
    at each call, and made every step recompile every compiled module (Dynamo guards on
    global hooks, and each block registered a new one).
"""

from __future__ import annotations

import functools
import sys
import threading
import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch import is_grad_enabled
from torch.autograd.graph import saved_tensors_hooks

from tierstore.adapters._common import (
    check_min_bytes,
    check_store,
    min_bytes_of,
    resolve_store,
    untraced,
)
from tierstore.adapters._storage import Kept, Saved, StorageTable, Stored
from tierstore.core._steps import counts_since, warn_nothing_offloaded
from tierstore.errors import TierStoreError

if TYPE_CHECKING:
    from tierstore._handle import TensorHandle
    from tierstore._stats import StoreStats
    from tierstore._sync import TieredStore

__all__ = ["offload_activations"]

# How far ahead of backward unpack asks the store to bring tensors back, when the store's
# configuration does not say.
_DEFAULT_PREFETCH_BYTES = 256 << 20

# The frame every module(...) call runs (Note: [Buffers are found on the stack]).
_MODULE_CALL = getattr(torch.nn.Module, "_wrapped_call_impl", torch.nn.Module._call_impl).__code__


class _Session:
    """One ``with offload_activations(...)`` block: its store, thresholds and save order."""

    __slots__ = (
        "__weakref__",
        "_first",
        "_gone",
        "_lock",
        "_low",
        "_modules_seen",
        "_order",
        "min_bytes",
        "prefetch_bytes",
        "saved",
        "store",
        "stored",
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
        # Note: [The save order forgets the dead]
        self._order: list[weakref.ref[Stored]] = []
        self._first = 0
        """The save index of ``_order[0]``."""
        self._gone = 0
        """How many of ``_order``'s first references are known dead."""
        # Lowest save index already asked for by prefetch; None until backward starts.
        self._low: int | None = None
        # Modules whose buffers the table already excludes (Note: [Buffers are found on
        # the stack]); weak, as the table's own references.
        self._modules_seen: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
        # Tensors autograd saved in the block, and those the store holds (Note: [Say when
        # offloading does nothing]); approximate when several threads share the block.
        self.saved = self.stored = 0

    # -- forward ---------------------------------------------------------------------------

    def pack(self, t: torch.Tensor) -> Saved | Kept | torch.Tensor:
        self.saved += 1
        if (
            t.grad_fn is None
            and not t.requires_grad
            and t.numel() * t.element_size() >= self.min_bytes
        ):
            self._exclude_buffers_on_stack()
        packed = self.table.offload(self.store, t, self.min_bytes, self._number)
        if isinstance(packed, Saved):
            self.stored += 1
        return packed

    def check_stored(self, before: StoreStats) -> None:
        """Warn once per store if the block stored nothing (Note: [Say when offloading does
        nothing]). ``before``: the store's stats when the block began."""
        if self.stored:
            return
        try:
            now = self.store.stats()
        except TierStoreError:
            return  # closed during the block: its own error says enough
        if now.puts > before.puts:
            return  # stored through another path in the block (tierstore.checkpoint)
        skipped = counts_since(now.skipped, before.skipped)
        if self.saved and not skipped:
            return  # only empty tensors, or storages stored by an earlier block
        skipped_bytes = counts_since(now.skipped_bytes, before.skipped_bytes)
        warn_nothing_offloaded(
            self.store,
            "an offload_activations block",
            skipped,
            skipped_bytes,
            self.min_bytes,
            stacklevel=3,
        )

    def _exclude_buffers_on_stack(self) -> None:
        """Exclude the buffers of the modules being called (Note: [Buffers are found on the
        stack])."""
        frame = sys._getframe(1)
        while frame is not None:
            if frame.f_code is _MODULE_CALL:
                owner = frame.f_locals["self"]
                if isinstance(owner, torch.nn.Module) and owner not in self._modules_seen:
                    for module in owner.modules():
                        if module not in self._modules_seen:
                            self._modules_seen.add(module)
                            for buf in module._buffers.values():
                                if buf is not None:
                                    self.table.exclude(buf)
            frame = frame.f_back  # type: ignore[assignment]

    def _number(self, stored: Stored) -> None:
        """Give ``stored`` the next save index.

        Note: [The save order forgets the dead]
            The order holds a weak reference per stored storage, and each record's first get
            walks it down from its own index to ask for what backward needs next. Its oldest
            references whose entries are gone are dropped as new ones come (the indices stay
            those of the saves): a block around many forwards with no backward (evaluation
            with grad left on) otherwise kept one per save, for good. And once the walk has
            asked for the oldest live entry, a later first get has nothing older to ask for
            and returns at once: walking again down to the first entry, for every get of a
            backward smaller than the window, made it quadratic in the entries (0.43 s of a
            0.53 s backward for 4000 small ones).
        """
        with self._lock:
            if self._low is not None:
                # A forward after a backward: one block around several steps. The window
                # starts again from the newest entry.
                self._low = None
            order = self._order
            gone = self._gone
            while gone < len(order) and order[gone]() is None:
                gone += 1
            if 2 * gone >= len(order):  # amortized: each reference is moved once at most
                del order[:gone]
                self._first += gone
                gone = 0
            self._gone = gone
            index = self._first + len(order)
            order.append(weakref.ref(stored))
        stored.before_first_get = functools.partial(self.prefetch_before, index)

    # -- backward --------------------------------------------------------------------------

    def prefetch_before(self, index: int) -> None:
        """Ask the store for the entries saved just before ``index``: backward needs them next.

        Each entry is asked for once; the window is ``prefetch_bytes`` below ``index``
        (Note: [The save order forgets the dead]).
        """
        handles: list[TensorHandle] = []
        with self._lock:
            oldest = self._first + self._gone
            low = self._first + len(self._order) if self._low is None else self._low
            if low <= oldest:
                return  # everything older was asked for already
            budget = self.prefetch_bytes
            j = index - 1
            while j >= oldest and budget > 0:
                stored = self._order[j - self._first]()
                if stored is not None:
                    budget -= stored.handle.nbytes
                    if j < low:
                        handles.append(stored.handle)
                j -= 1
            self._low = min(low, j + 1)
        if handles:
            self.store.prefetch(handles)


def _stats_at_start(store: TieredStore) -> StoreStats | None:
    """The store's stats as a block begins, to tell at its end whether it stored anything
    (Note: [Say when offloading does nothing]); None when nothing is expected of it.

    Only a block that could save tensors for backward is expected to store something: not
    one under no_grad (evaluation), nor one over a store without stats (a stand-in). This
    frame and ``offload_activations.__enter__`` do not name the ``torch`` module: Dynamo
    compiles any frame that does, even one a compiled function calls after falling back to
    eager, and tracing the store's locks and thread checks warns.
    """
    stats = getattr(store, "stats", None)
    if not is_grad_enabled() or not callable(stats):
        return None
    try:
        return stats()  # type: ignore[no-any-return]
    except TierStoreError:
        return None  # a closed store raises at put, as before


def _unpack(packed: Any) -> torch.Tensor:
    if isinstance(packed, (Saved, Kept)):
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
    buffers of the modules running when the tensor is saved (``parameter_or_buffer``; Note:
    [Buffers are found on the stack]), sparse, nested, meta, quantized and subclass tensors
    other than DTensors (``unsupported``), and tensors no tier has room for (``no_room``; a
    warning is shown once per store; nothing is ever dropped). A DTensor's local shard is
    stored and the DTensor rebuilt with its mesh, placements, shape and stride (Note: [A
    DTensor stores its shard]).

    Tensors that share one storage are stored once; see Note: [One storage, one entry]. The
    graph owns what is stored: a forward that never runs backward frees everything it stored
    when its graph is dropped. Non-reentrant ``torch.utils.checkpoint`` regions inside the
    block keep their own (recomputed) activations; their outputs are offloaded as usual. A
    saved tensor modified in place before backward raises as it would without hooks (Note:
    [Version check]). Around compiled code, what the compiled graphs save is stored at run
    time; the hooks themselves are never traced (Note: [Hooks run eagerly under
    torch.compile]).

    Args:
        store: the store to use; ``None`` means :func:`tierstore.default_store`, resolved when
            the block is entered.
        min_bytes: tensors smaller than this many bytes stay where they are. Default ``None``:
            the store's ``min_bytes`` (``TIERSTORE_MIN_BYTES``, 1 MiB unless configured).

    A block entered with gradients on that stores nothing (every tensor was skipped, or
    nothing was saved) warns once per store with a ``RuntimeWarning`` saying why (Note: [Say
    when offloading does nothing]).

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
        check_store(store)
        self._store_arg = store
        self._min_bytes = min_bytes
        # Per thread, one entry per active block: one object may be entered again, nested, or
        # on several threads at once.
        self._local = threading.local()

    def _active(self) -> list[tuple[saved_tensors_hooks, _Session, StoreStats | None]]:
        active: list[tuple[saved_tensors_hooks, _Session, StoreStats | None]] | None = getattr(
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
        # The pack hook holds the session; the graph's records hold it too, so it lives while
        # the block runs and while anything it stored lives. Note: [Hooks run eagerly under
        # torch.compile].
        hooks = saved_tensors_hooks(untraced(session.pack), untraced(_unpack))
        before = _stats_at_start(store)  # before the hooks: if it raises, none are left on
        # A refusal (torch disables saved-tensor hooks under some compilers and checkpoint
        # modes) raises here and leaves nothing behind.
        hooks.__enter__()
        self._active().append((hooks, session, before))
        return self

    def __exit__(self, *exc_info: object) -> None:
        hooks, session, before = self._active().pop()
        hooks.__exit__(*exc_info)
        if before is not None and exc_info[0] is None:
            session.check_stored(before)
