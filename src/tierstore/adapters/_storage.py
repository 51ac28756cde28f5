"""Offloading one saved tensor: its whole storage goes into the store once, views come back exact.

Note: [One storage, one entry]
    Autograd often saves several tensors that share one storage: a tensor and its transpose,
    the three chunks of a fused QKV projection, a view and its base, one attention mask handed
    to every checkpointed layer. Each storage is put into the store once, as flat bytes, and
    every saved tensor becomes a small record (dtype, size, stride, offset) pointing at that
    entry; unpack rebuilds it with ``as_strided``. So nothing is stored twice, strides come back
    exactly (a transposed operand must stay transposed or matmul may round differently), and
    once the forward drops its own references the whole base storage is gone from memory, views
    of a larger base included. A storage is matched by a weak reference to it plus its version
    counter, so neither a freed storage whose address was reused nor a storage written in place
    since it was saved can be mistaken for the stored one.

Note: [The graph owns the entries]
    What the adapters hand to autograd (a :class:`Saved` record) is owned by the graph and by
    nothing else: tables, sessions and prefetch lists hold only weak references. When the graph
    goes (after backward, or without backward: eval, an exception, a dropped loss) the records
    go, their handles go, and the store releases the entries. Nothing that outlives a step holds
    a container of tensors or handles.

Note: [A DTensor stores its shard]
    A ``DTensor`` (tensor parallelism, ``distribute_tensor``) is a wrapper around this rank's
    local shard, with a spec: the device mesh, the placements and the global shape and
    stride. Only the shard has bytes; it goes into the store like any tensor (so DTensors
    sharing a shard's storage share one entry), and the record keeps the spec itself. Unpack
    wraps the shard, rebuilt as above, in a DTensor with that very spec: same mesh, same
    placements, same global shape and stride, bit-exact. The version check (Note: [Version
    check]) watches the DTensor itself, which in-place operations on it bump. A shard, or a
    saved tensor, that is still an ``AsyncCollectiveTensor`` (a collective's result not yet
    waited on) is waited on when saved and comes back as the plain tensor it stands for.

Note: [Kept as is, detached]
    A saved tensor the store does not take (under ``min_bytes``, a parameter, no room, a
    ``no_offload`` block) is handed back to autograd detached, never as the tensor the pack
    hook received. That tensor still carries its ``grad_fn``; when it is its own node's
    output, keeping it closes a cycle through autograd's C++ objects (the node holds the saved
    variable, which would hold the tensor, which holds the node) that Python's collector does
    not see. A graph built and never run back (eval with grad on, an exception mid-forward, a
    ``retain_graph`` graph dropped) would then never be freed, with every entry it holds.
    Autograd reattaches the node or the gradient accumulator when it unpacks, so detaching
    loses nothing; torch's own saved variables keep ``tensor_data()`` for the same reason.
    The detached tensor shares the saved one's version counter, so the :class:`Kept` record
    around it still sees a write in place (Note: [Version check]).
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from tierstore.adapters._common import (
    NO_ROOM,
    PARAMETER,
    SMALL,
    UNSUPPORTED,
    traced_stand_in,
    unsupported_reason,
    unwrap,
    warn_no_room,
)
from tierstore.core._checks import version_of
from tierstore.errors import TensorModifiedError, TierFullError, UnsupportedTensorError
from tierstore.tiers._device import hand_over

if TYPE_CHECKING:
    from collections.abc import Callable

    from tierstore._handle import TensorHandle
    from tierstore._sync import TieredStore

__all__ = ["Kept", "Saved", "StorageTable", "Stored", "check_version", "is_parameter"]


class Stored:
    """One storage held in the store. Its handle lives exactly as long as this object."""

    __slots__ = (
        "__weakref__",
        "_cache",
        "_cache_version",
        "_held",
        "_lock",
        "_unread",
        "before_first_get",
        "handle",
        "store",
    )

    def __init__(self, store: TieredStore, handle: TensorHandle) -> None:
        self.store = store
        self.handle = handle
        self.before_first_get: Callable[[], None] | None = None
        self._lock = threading.Lock()
        self._cache: weakref.ref[torch.Tensor] | None = None
        self._cache_version: int | None = None
        self._unread = 0
        """Records of this storage not unpacked yet (Note: [Read once for every record])."""
        self._held: torch.Tensor | None = None

    def expect_unpack(self) -> None:
        """One more record refers to this storage and will unpack it."""
        with self._lock:
            self._unread += 1

    def count_unpacked(self, record: Saved) -> None:
        """``record`` will not read the bytes in its first unpack: a checkpoint input got as
        the live object itself."""
        with self._lock:
            self._counted(record)
            if self._unread <= 0:
                self._held = None

    def record_gone(self) -> None:
        """A record died before its first unpack (its node never ran, or its graph went).

        Called from ``Saved.__del__``, which the collector may run in any thread, one that
        holds this lock among them, or one that a getter holding it waits on: so no lock.
        A lost update either keeps the bytes until the last record goes, or lets the next
        unpack read them again; neither changes a value.
        """
        self._unread -= 1
        if self._unread <= 0:
            self._held = None

    def _counted(self, record: Saved) -> None:
        """Count ``record``'s first unpack (the lock held)."""
        if not record.unpacked:
            record.unpacked = True
            self._unread -= 1

    def flat(self, record: Saved | None = None) -> torch.Tensor:
        """The storage's bytes back on their device; fetched once while any view of them lives,
        or while a record of them has still to unpack its first time.

        Note: [Read once for every record]
            One storage is often saved by several nodes: the input of separate q, k and v
            projections (a Llama layer), of gate and up. Each node's unpack comes back on its
            own, and between them autograd frees the previous node's tensor; cached weakly
            only, the bytes were read from disk again for each (a small Llama read 22 % more
            than it wrote). So the bytes are held from the first unpack until every record of
            them has unpacked once (``record``'s first unpack) or died, as autograd without
            hooks holds a saved tensor until its last node runs. A checkpoint input got as
            its live object counts as unpacked.

        Raises:
            TensorModifiedError: the bytes were written in place since they were put (the
                store raises it at the first get; a later one finds them cached).
        """
        with self._lock:
            flat = self._cache() if self._cache is not None else None
            if flat is None:
                if self.before_first_get is not None:
                    self.before_first_get()
                    self.before_first_get = None
                flat = self.store.get(self.handle)
                # Weak: the views autograd holds keep the bytes alive, and ``_held`` while a
                # record has still to unpack; nothing else does.
                self._cache = weakref.ref(flat)
                self._cache_version = version_of(flat)
            elif version_of(flat) != self._cache_version:
                # What a device or host tier returns is the caller's own storage, sharing its
                # counter (Note: [Version check]); a fetched copy has a counter of its own.
                raise TensorModifiedError(
                    f"it was written in place (version {self._cache_version} at the first "
                    f"unpack, {version_of(flat)} now)"
                )
            else:
                # An unpack on another stream than the first's waits for the upload too
                # (Note: [Every stream that takes an upload] in tiers/_device.py).
                hand_over(flat)
            if record is not None:
                self._counted(record)  # under the lock: two threads count one record once
            self._held = flat if self._unread > 0 else None
            return flat


def check_version(t: torch.Tensor, expected: int) -> None:
    """Raise autograd's error if ``t`` was written in place since it was at ``expected``.

    Raises:
        RuntimeError: ``t._version`` is not ``expected`` (Note: [Version check]).
    """
    if t._version != expected:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an "
            f"inplace operation: [{t.type()} {list(t.shape)}] is at version {t._version}; "
            f"expected version {expected} instead (tierstore checks this as autograd does)"
        )


class Kept:
    """A saved tensor left where it is (Note: [Kept as is, detached]), with its version.

    Note: [Version check]
        With saved-tensor hooks installed, autograd no longer checks that a saved tensor was
        not modified in place before backward; it trusts what unpack returns. So every record
        the adapters hand autograd checks it at unpack and raises the error autograd raises
        without hooks, instead of returning the bytes as they are now. A kept tensor is
        checked through its detached self, which shares the saved tensor's version counter.
        An offloaded one (:class:`Saved`) is checked through what shares its counter, because
        the saved object is often a temporary that dies at once (``a[2:6].sin()``, the
        ``a.detach()`` of a stop-gradient): weak references to it and to its base, while they
        live; and the flat view of the storage handed to the store, which shares the same
        counter. The store checks that view whenever it copies, spills or returns it; what a
        device or host tier returns is that storage itself, counter included, and
        :meth:`Stored.flat` checks it again on every later unpack (after ``retain_graph``,
        the second finds the bytes cached and asks the store nothing). A write after the bytes
        reached another tier, with the saved tensor and its base dead, leaves the bytes as
        they were saved: the gradient is the one of the forward that ran, as with
        ``save_on_cpu``.
    """

    __slots__ = ("kept", "version")

    def __init__(self, t: torch.Tensor, *, detach: bool = True, checked: bool = True) -> None:
        """``detach=False`` keeps ``t`` itself: a checkpoint's input, which the recompute
        gets as the very object the forward saw. ``checked=False``: a write in place since
        does not raise (a checkpoint input torch does not check either)."""
        self.kept = t.detach() if detach else t
        # None for an inference tensor, which keeps no counter (and which autograd refuses
        # to save with its own error; a checkpoint's input reaches here before that).
        self.version = version_of(t) if checked else None

    def tensor(self) -> torch.Tensor:
        """The kept tensor.

        Raises:
            RuntimeError: it was modified in place after it was saved.
        """
        if self.version is not None:
            check_version(self.kept, self.version)
        return self.kept


class Saved:
    """A saved tensor that was offloaded: where it sits inside a stored storage; Note:
    [Version check] says how a write in place since is caught."""

    __slots__ = (
        "base",
        "dtensor_spec",
        "dtype",
        "end",
        "offset",
        "size",
        "source",
        "stored",
        "stride",
        "unpacked",
        "version",
    )

    def __init__(
        self, stored: Stored, t: torch.Tensor, plain: torch.Tensor, dtensor_spec: object = None
    ) -> None:
        """Record ``t``; ``plain`` holds its bytes in ``stored`` (see :func:`unwrap`)."""
        self.stored = stored
        self.unpacked = False
        stored.expect_unpack()
        self.dtype = plain.dtype
        self.size = plain.size()
        self.stride = plain.stride()
        self.offset = plain.storage_offset()
        # One past the last element the view reaches, counted from the storage's start.
        reach = sum((n - 1) * st for n, st in zip(self.size, self.stride, strict=True))
        self.end = self.offset if 0 in self.size else self.offset + reach + 1
        # ``t`` itself, a DTensor's wrapper included: in-place operations bump its version.
        self.version = t._version
        self.source = weakref.ref(t)
        # Views share their base's counter; the base often outlives a temporary view.
        self.base = None if t._base is None else weakref.ref(t._base)
        # Note: [A DTensor stores its shard]
        self.dtensor_spec = dtensor_spec

    def __del__(self) -> None:
        # Note: [Read once for every record]: a record gone unread holds nothing.
        if not getattr(self, "unpacked", True):  # True: an __init__ that never finished
            self.stored.record_gone()

    def tensor(self) -> torch.Tensor:
        """The saved tensor again: same device, dtype, shape, strides and bytes.

        Raises:
            RuntimeError: the tensor was modified in place after it was saved; a
                :class:`~tierstore.TensorModifiedError` when the store found it.
        """
        if torch.compiler.is_compiling():
            # Note: [Hooks run eagerly under torch.compile]: never a graph's business.
            return torch.compiler.disable(Saved.tensor)(self)  # type: ignore[no-untyped-call,no-any-return]
        for ref in (self.source, self.base):
            watched = ref() if ref is not None else None
            if watched is not None:
                check_version(watched, self.version)
        try:
            flat = self.stored.flat(self)
        except TensorModifiedError as err:
            raise TensorModifiedError(
                "one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: a saved {self.dtype} tensor of shape {list(self.size)} "
                f"was written after it was saved ({err})"
            ) from err
        with torch.no_grad():
            typed = flat.view(self.dtype)
            if typed.numel() < self.end:
                raise RuntimeError(
                    f"tierstore: a saved {self.dtype} tensor of shape {list(self.size)} needs "
                    f"{self.end} elements of its storage but the store returned {typed.numel()}"
                )
            # ``as_strided`` counts its offset from the start of the storage, not of ``flat``;
            # get returns offset 0 (Note: [What get returns]), and counting
            # from ``flat`` keeps views right even if that ever changed.
            plain = typed.as_strided(self.size, self.stride, typed.storage_offset() + self.offset)
        if self.dtensor_spec is None:
            return plain
        return _rewrap(plain, self.dtensor_spec)


def _rewrap(shard: torch.Tensor, spec: object) -> torch.Tensor:
    """A DTensor around ``shard`` with ``spec`` (Note: [A DTensor stores its shard])."""
    # The record exists only because a DTensor was saved, so its module is loaded.
    from torch.distributed.tensor import DTensor

    # The constructor, not DTensor.from_local: the spec (mesh, placements, global shape and
    # stride) is the saved tensor's own, and from_local would add an autograd node.
    return DTensor(shard, spec, requires_grad=False)  # type: ignore[no-untyped-call]


def is_parameter(t: torch.Tensor) -> bool:
    """A parameter or a view of one (``weight.t()`` is what ``linear`` saves)."""
    return isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter)


class StorageTable:
    """Which storages are in the store now; see Note: [One storage, one entry].

    Holds weak references only (Note: [The graph owns the entries]); an entry leaves the table
    when its :class:`Stored` dies. Safe to use from several threads.
    """

    __slots__ = ("__weakref__", "_by_storage", "_excluded", "_lock")

    def __init__(self) -> None:
        # Reentrant: a garbage collection set off while this thread holds the lock (by the
        # allocations of a new record below) can free a Stored, whose weak-reference callback
        # takes the lock again on the same thread.
        self._lock = threading.RLock()
        self._by_storage: dict[
            int, tuple[StorageWeakRef, tuple[int, int], weakref.ref[Stored]]
        ] = {}
        self._excluded: dict[int, StorageWeakRef] = {}

    def exclude(self, t: torch.Tensor) -> None:
        """Never offload tensors on ``t``'s storage (a module's buffer: it stays alive anyway)."""
        if t.layout == torch.strided and not t.is_meta and type(t) is torch.Tensor:
            ref = StorageWeakRef(t.untyped_storage())  # type: ignore[no-untyped-call]
            with self._lock:
                self._excluded[ref.cdata] = ref

    def offload(
        self,
        store: TieredStore,
        t: torch.Tensor,
        min_bytes: int,
        on_new: Callable[[Stored], None] | None = None,
    ) -> Saved | Kept | torch.Tensor:
        """Put ``t``'s storage into ``store`` (once) and return its record, or keep ``t``.

        ``t`` is kept (Note: [Kept as is, detached]) when it is not worth or not possible to
        move; the reason is counted with ``store.note_skipped``. A stand-in that torch traces
        with (:func:`traced_stand_in`) comes back as itself. ``on_new`` is called with each
        newly stored storage.
        """
        if torch.compiler.is_compiling():
            # Note: [Hooks run eagerly under torch.compile]: never a graph's business.
            return torch.compiler.disable(StorageTable.offload)(  # type: ignore[no-untyped-call,no-any-return]
                self, store, t, min_bytes, on_new
            )
        # A DTensor's bytes are its local shard (Note: [A DTensor stores its shard]).
        plain, spec = unwrap(t)
        if traced_stand_in(plain):
            return t
        saved = self._stored_or_none(store, t, plain, spec, min_bytes, on_new)
        return Kept(t) if saved is None else saved

    def _stored_or_none(
        self,
        store: TieredStore,
        t: torch.Tensor,
        plain: torch.Tensor,
        spec: object,
        min_bytes: int,
        on_new: Callable[[Stored], None] | None,
    ) -> Saved | None:
        """``t``'s record, its storage put into ``store`` unless already there; None when it
        stays where it is (the reason counted with ``store.note_skipped``)."""
        nbytes = plain.numel() * plain.element_size()
        if t.is_inference():
            return None  # no version counter to watch; torch refuses to save it anyway
        if nbytes < min_bytes:
            if nbytes:
                store.note_skipped(SMALL, nbytes)
            return None
        if is_parameter(t):
            store.note_skipped(PARAMETER, nbytes)
            return None
        if unsupported_reason(plain) is not None:
            store.note_skipped(UNSUPPORTED, nbytes)
            return None
        storage = plain.untyped_storage()
        if storage.nbytes() % plain.element_size():
            store.note_skipped(UNSUPPORTED, nbytes)
            return None
        if storage.nbytes() < min_bytes:
            # Bigger than it holds (``expand``): what would move is its storage, which the
            # store would keep where it is; counted as small, so the summary says so.
            store.note_skipped(SMALL, storage.nbytes())
            return None
        ref = StorageWeakRef(storage)  # type: ignore[no-untyped-call]
        # A DTensor's in-place operations bump its own version, not its shard's (the shard is
        # written below autograd): both must match for the bytes to be the stored ones.
        version = (plain._version, t._version)
        with self._lock:
            excluded = self._excluded.get(ref.cdata)
            known = self._by_storage.get(ref.cdata)
        if excluded is not None and not excluded.expired():  # type: ignore[no-untyped-call]
            store.note_skipped(PARAMETER, nbytes)
            return None
        if known is not None:
            known_ref, known_version, known_stored = known
            stored = known_stored()
            # The weak storage reference pins the id, so a live match is the very same storage.
            alive = not known_ref.expired()  # type: ignore[no-untyped-call]
            if stored is not None and alive and known_version == version:
                return Saved(stored, t, plain, spec)
        # The whole storage as bytes, a view of ``plain`` so that it shares its version
        # counter: the store sees a write in place (Note: [Version check]). ``as_strided``
        # counts from the storage's start.
        flat = (
            plain.detach()
            .as_strided((storage.nbytes() // plain.element_size(),), (1,), 0)
            .view(torch.uint8)
        )
        try:
            # The adapter's threshold, not the store's: a block may offload smaller tensors.
            # Passed only then, for stores wrapped in a put(t) of the caller's own.
            below_stores = min_bytes < getattr(store.config, "min_bytes", 0)
            handle = store.put(flat, min_bytes=min_bytes) if below_stores else store.put(flat)
        except TierFullError as err:
            store.note_skipped(NO_ROOM, nbytes)
            warn_no_room(store, t, err)
            return None
        except UnsupportedTensorError:
            store.note_skipped(UNSUPPORTED, nbytes)
            return None
        del flat
        stored = Stored(store, handle)
        if on_new is not None:
            on_new(stored)
        key = ref.cdata
        table = weakref.ref(self)

        def forget(dead: weakref.ref[Stored]) -> None:
            owner = table()
            if owner is not None:
                with owner._lock:
                    entry = owner._by_storage.get(key)
                    if entry is not None and entry[2] is dead:
                        del owner._by_storage[key]

        with self._lock:
            self._by_storage[key] = (ref, version, weakref.ref(stored, forget))
        return Saved(stored, t, plain, spec)

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_storage)
