"""offload_activations: flat memory, freed storages, no recursion, exact values, forwards without
backward, retain_graph; eligibility, sharing, prefetch, visibility.

See Note: [One storage, one entry] and Note: [The graph owns the entries].
"""

from __future__ import annotations

import contextlib
import gc
import logging
import statistics
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from _adapters_util import (
    TIERS,
    StoreFactory,
    assert_equal_tensors,
    grads,
    model_and_batch,
    stats_once_released,
)
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

import tierstore
from tierstore.testing import settled, wait_for


def train_steps(
    store: tierstore.TieredStore | None,
    steps: int = 2,
    *,
    seed_each_step: bool = True,
    **model_kwargs: Any,
) -> list[torch.Tensor]:
    """Run a few SGD steps of the tiny decoder (dropout on); return all grads of every step."""
    model, ids = model_and_batch(**model_kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out: list[torch.Tensor] = []
    for step in range(steps):
        if seed_each_step:
            torch.manual_seed(100 + step)
        opt.zero_grad()
        if store is None:
            loss = model.loss(ids)
        else:
            with tierstore.offload_activations(store):
                loss = model.loss(ids)
            # Let every write land, so that backward really reads the slowest tier back.
            wait_for(lambda: settled(store))
        loss.backward()
        out += grads(model)
        opt.step()
    return out


# -- invariant: gradients are bit-identical, with each tier forced in turn -----------------


@pytest.mark.parametrize("tier", TIERS)
def test_grads_equal_to_no_offload_with_each_tier(store_factory: StoreFactory, tier: str) -> None:
    expected = train_steps(None)
    store = store_factory(tier)
    got = train_steps(store)
    assert_equal_tensors(expected, got)
    stats = stats_once_released(store)
    placed = {"device": stats.device, "host": stats.host, "disk": stats.disk}
    assert placed[tier].total_entries == stats.puts > 0
    # Entries pass through the faster tiers on their way down and never reach a slower one.
    slower = TIERS[TIERS.index(tier) + 1 :]
    assert sum(placed[name].total_entries for name in slower) == 0
    if tier == "disk":
        assert stats.bytes_to_disk == stats.bytes_put
        assert stats.bytes_from_disk >= stats.bytes_to_disk
    assert stats.live_entries == 0


# forward_ad loads torch's JVP decompositions, written with torch.jit.script, at first use.
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_forward_mode_ad_zeros_stay_and_the_disk_tier_goes_on(
    store_factory: StoreFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """A tangent product with a weight that has no tangent saves forward-mode AD's
    ZeroTensor, which has no bytes: put refuses it and it stays where it is. It used to be
    stored, its disk write failed, and the disk tier paused: the next real tensors were kept
    in memory as if the disk were full, every step."""
    import torch.autograd.forward_ad as fwad

    def run(store: tierstore.TieredStore | None) -> list[torch.Tensor]:
        torch.manual_seed(0)
        p = torch.randn(600, 600, requires_grad=True)
        w = torch.randn(600, 600, requires_grad=True)
        tangent = torch.randn(600, 600)
        offload = tierstore.offload_activations(store) if store else contextlib.nullcontext()
        with fwad.dual_level(), offload:
            y = fwad.make_dual(p, tangent) @ w
            loss = fwad.unpack_dual(y).tangent.pow(2).sum() + (y.sigmoid() * w).sum()
        loss.backward()
        assert p.grad is not None and w.grad is not None
        return [loss, p.grad, w.grad]

    expected = run(None)
    store = store_factory("disk")
    with caplog.at_level(logging.WARNING, logger="tierstore"):
        got = run(store)
    assert_equal_tensors(expected, got)
    stats = stats_once_released(store)
    assert stats.write_errors == 0 and stats.kept_no_room == 0, caplog.text
    assert stats.bytes_to_disk == stats.bytes_put > 0


@pytest.mark.parametrize("block", ["offload_activations", "offloading_context"])
def test_a_blocks_min_bytes_below_the_stores_offloads_the_smaller_tensors(
    store_factory: StoreFactory, block: str
) -> None:
    """The recipe of TRL and torchtune users: a store with the default 1 MiB ``min_bytes`` and
    a block that asks for 1 KiB. The block handed 64 KiB tensors to the store, which kept them
    in place under its own threshold, while counting them as offloaded."""
    from tierstore.integrations.transformers import offloading_context

    def run(store: tierstore.TieredStore | None) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU())
        x = torch.randn(128, 128, requires_grad=True)  # every saved activation is 64 KiB
        if store is None:
            ctx: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
        elif block == "offload_activations":
            ctx = tierstore.offload_activations(store, min_bytes=1024)
        else:
            ctx = offloading_context(model, store, min_bytes=1024, keep_output_head=False)
        with ctx:
            loss = model(x).square().sum()
        if store is not None:
            wait_for(lambda: settled(store))
            assert store.stats().disk.total_bytes > 0, "nothing reached the disk"
        loss.backward()
        return [loss, x.grad, *(p.grad for p in model.parameters())]  # type: ignore[list-item]

    expected = run(None)
    store = store_factory("disk", min_bytes=1 << 20)
    got = run(store)
    assert_equal_tensors(expected, got)
    stats = stats_once_released(store)
    assert stats.bytes_put > 0 and stats.bytes_to_disk == stats.bytes_put
    assert stats.skipped_bytes.get("below_min_bytes", 0) == 0


# -- invariant 1: memory flat across steps --------------------------------------------------


def test_memory_flat_over_200_steps_with_disk_tier(store_factory: StoreFactory) -> None:
    store = store_factory("disk")
    # ~1.7 MB saved per step: a leak of one step's activations would add >300 MB.
    model, ids = model_and_batch(batch=4, dim=64, seq=32, layers=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    proc = psutil.Process()
    rss: list[int] = []
    per_step = 0
    for step in range(220):
        opt.zero_grad()
        with tierstore.offload_activations(store):
            loss = model.loss(ids)
        # Every write lands before backward: on a loaded machine backward could otherwise
        # read and release entries before they reach the disk, and the disk path go untested.
        wait_for(lambda: settled(store))
        loss.backward()
        opt.step()
        del loss
        stats = stats_once_released(store)
        assert stats.live_entries == 0, f"step {step}: {stats.live_entries} entries left"
        if step == 0:
            per_step = stats.bytes_put
        rss.append(proc.memory_info().rss)
    assert per_step > 1 << 20
    final = store.stats()
    assert final.bytes_to_disk == final.bytes_put == 220 * per_step, final
    # Medians of windows: RSS wanders by ~10 MiB from step to step (allocator, I/O buffers),
    # while leaking even one step's activations per step would add >300 MB by the end.
    early, late = statistics.median(rss[20:70]), statistics.median(rss[-50:])
    assert late - early < 16 << 20, f"RSS grew {(late - early) / 2**20:.1f} MiB over 150 steps"


# -- invariant 2: views, shared storage, base storage freed ---------------------------------


def test_tensors_sharing_a_storage_are_stored_once(store_factory: StoreFactory) -> None:
    store = store_factory("disk")
    x = torch.randn(64, 48, requires_grad=True)

    def loss_of() -> tuple[torch.Tensor, torch.Tensor]:
        y = x * 1.5  # one new storage...
        z = y @ y.t()  # ...saved twice by mm: as y and as y.t()
        q, k = y.chunk(2, dim=1)  # two views of it, both saved by mul
        return z.sum() + (q * k).sum(), y

    with tierstore.offload_activations(store):
        loss, y = loss_of()
    stats = store.stats()
    assert stats.puts == 1, stats
    assert stats.bytes_put == y.untyped_storage().nbytes()
    (got,) = torch.autograd.grad(loss, x)
    (expected,) = torch.autograd.grad(loss_of()[0], x)
    assert torch.equal(got, expected)
    del loss, y
    assert stats_once_released(store).live_entries == 0


@pytest.mark.parametrize("tier", ["disk", "host"])
def test_a_storage_written_between_two_saves_is_stored_again(
    store_factory: StoreFactory, tier: str
) -> None:
    """One storage saved, written in place, then saved again by a second graph (the first
    never run back, as torch allows): the second save is matched to the first entry only at
    the same version, or it reads back the bytes from before the write, silently where the
    store holds a copy of its own (the disk tier)."""
    torch.manual_seed(0)
    w = torch.randn(1 << 20, requires_grad=True)  # 4 MiB
    x = torch.randn(1 << 20)  # needs no grad: the product saves it for w's gradient
    want = x * 2
    store = store_factory(tier)
    with tierstore.offload_activations(store, min_bytes=0):
        first = (w * x).sum()
        wait_for(lambda: settled(store))  # x's bytes rest where the tier keeps them
        rest = store.stats().disk if tier == "disk" else store.stats().host
        assert rest.entries == 1 and rest.bytes >= x.untyped_storage().nbytes()
        x.mul_(2)
        second = (w * x).sum()  # saves x again, at its new version
    second.backward()
    assert w.grad is not None and torch.equal(w.grad, want)
    del first, second


def test_a_storage_saved_by_several_nodes_is_read_once(store_factory: StoreFactory) -> None:
    """Note: [Read once for every record]: separate q, k and v projections each save their
    common input; backward frees each node's tensor before the next node unpacks, so a weak
    cache alone read the 2 MiB input from disk three times."""
    store = store_factory("disk")
    torch.manual_seed(0)
    norm, q, k, v = nn.LayerNorm(512), nn.Linear(512, 512), nn.Linear(512, 512), nn.Linear(512, 512)
    x = torch.randn(1024, 512, requires_grad=True)

    def loss_of() -> torch.Tensor:
        h = norm(x)
        return (q(h).sin() * k(h).cos() + v(h).pow(2)).sum()

    modules = (norm, q, k, v)
    loss_of().backward()
    expected = [p.grad.clone() for m in modules for p in m.parameters()] + [x.grad.clone()]
    for p in [p for m in modules for p in m.parameters()] + [x]:
        p.grad = None
    with tierstore.offload_activations(store):
        loss = loss_of()
    wait_for(lambda: settled(store))
    loss.backward()
    assert_equal_tensors(expected, [p.grad for m in modules for p in m.parameters()] + [x.grad])
    stats = stats_once_released(store)
    assert stats.bytes_to_disk == stats.bytes_put > 0
    assert stats.gets == stats.puts and stats.bytes_from_disk == stats.bytes_to_disk, stats


def test_one_record_unpacked_by_two_threads_at_once_counts_once(
    store_factory: StoreFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Note: [Read once for every record]: a record whose first unpack runs in two threads at
    once (concurrent backwards of a retained graph) counts as one unpack, so the bytes stay
    held for the storage's other record. Tested outside the lock, both threads counted it,
    and the other record read the bytes from disk again."""
    from tierstore.adapters._storage import StorageTable

    store = store_factory("disk", prefetch_bytes=0)
    t = torch.randn(1 << 19)  # 2 MiB
    table = StorageTable()
    first, second = table.offload(store, t, 0), table.offload(store, t.view(-1, 2), 0)
    del t
    wait_for(lambda: settled(store))
    real_get = store.get

    def slow_get(handle: tierstore.TensorHandle) -> torch.Tensor:
        time.sleep(0.2)  # both threads are inside the first unpack before either ends
        return real_get(handle)

    monkeypatch.setattr(store, "get", slow_get)
    got: list[torch.Tensor] = []
    threads = [threading.Thread(target=lambda: got.append(first.tensor())) for _ in range(2)]  # type: ignore[union-attr]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    read = store.stats().bytes_from_disk
    got.clear()
    second.tensor()  # type: ignore[union-attr]
    assert read == 2 << 20 and store.stats().bytes_from_disk == read


def test_a_record_that_dies_unread_holds_nothing(store_factory: StoreFactory) -> None:
    """Note: [Read once for every record]: ``h`` saved by two nodes, one branch dropped before
    backward. The dropped record never unpacks; counted only at unpacks, it left the bytes
    held for as long as the retained graph lived."""
    from tierstore.adapters._storage import Stored

    store = store_factory("disk", prefetch_bytes=0)
    w = torch.randn(512, 512)
    a = torch.randn(512, 512, requires_grad=True)
    with tierstore.offload_activations(store):
        h = a.exp()
        keep = (h @ w).sum()
        drop = (h @ w.t()).sum()  # saves h too, never run back
        del h
    del drop
    wait_for(lambda: settled(store))
    keep.backward(retain_graph=True)
    gc.collect()
    assert store.stats().bytes_from_disk > 0
    assert not [o for o in gc.get_objects() if type(o) is Stored and o._held is not None]


def test_a_views_base_storage_is_freed(store_factory: StoreFactory) -> None:
    store = store_factory("disk")
    w = torch.randn(16, requires_grad=True)
    base = torch.randn(1 << 18, 16)  # 16 MiB base; only a small view of it is saved
    base_ref = StorageWeakRef(base.untyped_storage())
    with tierstore.offload_activations(store):
        view = base[1000:1064]
        loss = (view * w).sum()  # mul saves the view (to compute w's gradient)
    del base, view
    # Once written, the only copy is in the spill file: the 16 MiB base is gone from memory.
    wait_for(lambda: store.stats().disk.entries == 1)
    gc.collect()
    wait_for(base_ref.expired, what="the view's base storage freed")
    loss.backward()
    assert w.grad is not None and w.grad.shape == (16,)
    del loss
    assert stats_once_released(store).live_entries == 0


# -- invariant 4: device, dtype, shape, strides and values ----------------------------------


class SaveAndCheck(torch.autograd.Function):
    """Saves its input and checks in backward that it comes back exactly as it was."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.meta = (x.device, x.dtype, x.shape, x.stride(), x.storage_offset())
        ctx.copy = x.detach().clone()
        return x.detach().clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        assert (x.device, x.dtype, x.shape, x.stride(), x.storage_offset()) == ctx.meta
        assert torch.equal(x, ctx.copy)
        return grad


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.complex64]
)
def test_device_dtype_shape_strides_and_values_restored(
    store_factory: StoreFactory, tier: str, dtype: torch.dtype
) -> None:
    store = store_factory(tier)
    base = torch.randn(9, 14, dtype=dtype)
    x = base.t()[2:, 1:].requires_grad_()  # a strided view with an offset
    with tierstore.offload_activations(store):
        y = SaveAndCheck.apply(x)
    assert store.stats().puts == 1
    del base
    wait_for(lambda: settled(store))  # backward reads from the tier, not an in-flight source
    (y.sum().real if dtype.is_complex else y.sum()).backward()
    assert x.grad is not None and x.grad.dtype == dtype
    assert (store.stats().bytes_from_disk > 0) == (tier == "disk")
    del y
    assert stats_once_released(store).live_entries == 0


@pytest.mark.parametrize("tier", TIERS)
def test_integer_and_bool_tensors_restored(store_factory: StoreFactory, tier: str) -> None:
    store = store_factory(tier)
    src = torch.randn(50, 7, requires_grad=True)
    idx = torch.randint(0, 50, (300,))
    mask = torch.rand(50, 7) > 0.5

    def loss_of() -> torch.Tensor:
        return (src[idx] * 2).sum() + src.masked_fill(mask, 0).pow(2).sum()

    (expected,) = torch.autograd.grad(loss_of(), src)
    with tierstore.offload_activations(store):
        loss = loss_of()
    assert store.stats().puts >= 3  # idx (int64), mask (bool), src
    wait_for(lambda: settled(store))
    (got,) = torch.autograd.grad(loss, src)
    assert torch.equal(got, expected)
    assert (store.stats().bytes_from_disk > 0) == (tier == "disk")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("tier", TIERS)
def test_cuda_tensor_returns_to_its_own_device_index(
    store_factory: StoreFactory, tier: str
) -> None:
    device = torch.device("cuda", torch.cuda.device_count() - 1)
    store = store_factory(tier)
    x = torch.randn(64, 64, device=device).t().requires_grad_()
    with tierstore.offload_activations(store):
        y = SaveAndCheck.apply(x)
    y.sum().backward()
    assert x.grad is not None and x.grad.device == device


# -- invariant 5: forwards without backward leak nothing ------------------------------------


def test_a_record_dying_while_its_table_is_locked_on_the_same_thread_does_not_deadlock(
    store_factory: StoreFactory,
) -> None:
    """A garbage collection can run inside the table's locked section (it allocates the new
    record) and free an older record, whose callback takes the table's lock again."""
    from tierstore.adapters._storage import StorageTable

    store = store_factory("host")
    table = StorageTable()
    saved = table.offload(store, torch.randn(1024), 0, None)
    assert len(table) == 1
    done = threading.Event()

    def drop_while_locked() -> None:
        nonlocal saved
        with table._lock:
            del saved  # the record's last reference: its callback runs here
        done.set()

    worker = threading.Thread(target=drop_while_locked, daemon=True)
    worker.start()
    assert done.wait(10), "the callback deadlocked on the table's lock"
    assert len(table) == 0


@pytest.mark.filterwarnings("ignore:tierstore. offloading is on:RuntimeWarning")
@pytest.mark.parametrize("block", ["offload_activations", "no_offload"])
def test_a_tensor_kept_as_is_does_not_keep_its_graph_alive(
    store_factory: StoreFactory, block: str
) -> None:
    """A pack hook that keeps an op's own output (a tensor too small to store, or one in a
    ``no_offload`` block) would close a cycle through autograd's C++ objects (the output's
    grad_fn holds the saved tensor, which holds the grad_fn) that no garbage collection
    breaks: a graph built and never run back would never be freed."""
    store = store_factory("disk")
    x = torch.randn(16, requires_grad=True)
    with tierstore.offload_activations(store, min_bytes=1 << 20):
        if block == "no_offload":
            with tierstore.no_offload():
                y = (x * 2).exp()  # exp saves its output
        else:
            y = (x * 2).exp()  # 64 bytes: below min_bytes, kept as is
    assert store.stats().puts == 0
    out = weakref.ref(y)
    del y
    gc.collect()
    assert out() is None, "the graph of a forward never run back is still alive"
    # And backward still gets its saved output back, gradients as without hooks.
    with tierstore.offload_activations(store, min_bytes=1 << 20):
        y = (x * 2).exp()
    (grad,) = torch.autograd.grad(y.sum(), x)
    assert torch.equal(grad, 2 * (x.detach() * 2).exp())


def test_eval_no_grad_and_exceptions_leak_nothing(store_factory: StoreFactory) -> None:
    store = store_factory("disk")
    model, ids = model_and_batch()
    model.eval()
    for _ in range(3):
        with tierstore.offload_activations(store):
            loss = model.loss(ids)  # eval mode, grad on: a graph is built, never run
        assert store.stats().live_entries > 0
        del loss
        assert stats_once_released(store).live_entries == 0
    puts = store.stats().puts
    with torch.no_grad(), tierstore.offload_activations(store):
        model.loss(ids)
    assert store.stats().puts == puts  # nothing is saved without a graph

    class Boom(RuntimeError):
        pass

    def failing_forward() -> None:
        with tierstore.offload_activations(store):
            x = model(ids[:, :-1])
            assert store.stats().live_entries > 0
            raise Boom(x.shape)

    with pytest.raises(Boom) as info:
        failing_forward()
    del info  # the traceback holds the frames that hold the graph
    assert stats_once_released(store).live_entries == 0


# -- invariant 6: retain_graph and a second backward ----------------------------------------


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_retain_graph_second_backward(store_factory: StoreFactory, tier: str) -> None:
    store = store_factory(tier)
    model, ids = model_and_batch()
    torch.manual_seed(7)
    loss = model.loss(ids)
    loss.backward(retain_graph=True)
    loss.backward()
    expected = grads(model)
    model.zero_grad()
    torch.manual_seed(7)
    with tierstore.offload_activations(store):
        loss = model.loss(ids)
    loss.backward(retain_graph=True)
    assert store.stats().live_entries > 0  # retained for the second backward
    loss.backward()
    assert_equal_tensors(expected, grads(model))
    assert stats_once_released(store).live_entries == 0


def test_double_backward_with_create_graph(store_factory: StoreFactory) -> None:
    store = store_factory("disk")
    x = torch.randn(32, 32, requires_grad=True)
    (g,) = torch.autograd.grad(x.tanh().pow(3).sum(), x, create_graph=True)
    (expected,) = torch.autograd.grad(g.sum(), x)
    with tierstore.offload_activations(store):
        y = x.tanh().pow(3).sum()
    wait_for(lambda: settled(store))
    assert store.stats().disk.entries > 0  # what backward reads was on disk
    (g,) = torch.autograd.grad(y, x, create_graph=True)
    (got,) = torch.autograd.grad(g.sum(), x)
    assert torch.equal(got, expected)
    assert store.stats().bytes_from_disk > 0


@pytest.mark.parametrize("tier", TIERS)
def test_inplace_change_after_save_raises_as_without_hooks(
    store_factory: StoreFactory, tier: str
) -> None:
    # See Note: [Version check].
    store = store_factory(tier)
    x = torch.randn(100, requires_grad=True)
    y = x.exp()
    y.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    with tierstore.offload_activations(store):
        y = x.exp()  # exp saves its result
    y.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def _save(store: tierstore.TieredStore, how: str, a: torch.Tensor) -> torch.Tensor:
    """``sin`` of ``a`` or of a temporary view of it, saved the way ``how`` names."""
    if how == "a temporary view, stored":
        with tierstore.offload_activations(store):
            return a[2:6].sin()  # the view autograd saves dies at once
    if how == "kept: under min_bytes":
        with tierstore.offload_activations(store, min_bytes=1 << 30):
            return a.sin()
    if how == "kept: no_offload":
        with tierstore.offload_activations(store), tierstore.no_offload():
            return a.sin()
    if how == "checkpoint: a temporary view, stored":
        return tierstore.checkpoint(torch.sin, a[2:6], store=store)
    assert how == "checkpoint: held, under min_bytes"  # the store's min_bytes is 1 GiB
    return tierstore.checkpoint(torch.sin, a, store=store)


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize(
    "how",
    [
        "a temporary view, stored",
        "kept: under min_bytes",
        "kept: no_offload",
        "checkpoint: a temporary view, stored",
        "checkpoint: held, under min_bytes",
    ],
)
@pytest.mark.parametrize("when", ["at once", "once settled"])
@pytest.mark.filterwarnings("ignore:tierstore. offloading is on, but:RuntimeWarning")
def test_a_write_in_place_after_save_raises_however_the_tensor_was_saved(
    store_factory: StoreFactory, tier: str, how: str, when: str
) -> None:
    # Note: [Version check]. Every path once returned today's bytes, and with them a wrong
    # gradient (cos(100 x) for cos(x)), where torch without hooks raises.
    store = store_factory(tier, min_bytes=1 << 30 if "held" in how else 0, io_chunk_bytes="512KiB")
    x = torch.randn(8, 65536, requires_grad=True)  # 2 MiB: over 1 MiB, four chunks
    a = x * 1
    y = _save(store, how, a)
    if when == "once settled":
        wait_for(lambda: settled(store))  # on disk: the store no longer holds the tensor
    with torch.no_grad():
        a.mul_(100)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


@pytest.mark.parametrize("tier", ["device", "host"])
@pytest.mark.parametrize("backwards", [1, 2])
def test_a_write_through_an_alias_of_a_dead_saved_tensor_raises(
    store_factory: StoreFactory, tier: str, backwards: int
) -> None:
    # The saved tensor is a temporary ``a.detach()`` (a stop-gradient operand): no base, dead
    # at once, so only the flat view the store holds shares its counter. With two backwards
    # (retain_graph) the second unpack finds the bytes cached and asks the store nothing.
    store = store_factory(tier, io_chunk_bytes="512KiB")
    x = torch.randn(8, 65536)  # 2 MiB: over 1 MiB, four chunks
    w = torch.randn(8, 65536, requires_grad=True)
    a = x * 1
    with tierstore.offload_activations(store):
        y = (a.detach() * w).sum()
    if backwards == 2:
        y.backward(retain_graph=True)
        assert torch.equal(w.grad, x)  # type: ignore[arg-type]
    with torch.no_grad():
        a.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


def test_a_write_in_place_before_save_is_not_mistaken_for_one_after(
    store_factory: StoreFactory,
) -> None:
    # The counters the records watch are shared with the caller's tensor: a write before the
    # save, or to another tensor, must change nothing.
    store = store_factory("disk")
    x = torch.randn(8, 4096, requires_grad=True)
    grads = []
    for offload in (False, True):
        x.grad = None
        a = x * 1
        with torch.no_grad():
            a.mul_(2)
        with tierstore.offload_activations(store) if offload else contextlib.nullcontext():
            loss = a[2:6].sin().sum() + a.sin().sum()
        a.clone().mul_(3)
        wait_for(lambda: settled(store))
        loss.backward()
        grads.append(x.grad)
    assert torch.equal(grads[0], grads[1])
    assert store.stats().puts == 1  # both saves share one storage


# -- eligibility and what is counted -------------------------------------------------------


def test_parameters_buffers_and_small_tensors_stay_and_are_counted(
    store_factory: StoreFactory,
) -> None:
    store = store_factory("disk", min_bytes=4096)

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(256, 256)
            self.register_buffer("scale", torch.rand(256, 256))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) * self.scale

    m = Scaled()
    x = torch.randn(256, 256, requires_grad=True)
    tiny = torch.randn(4, requires_grad=True)
    with tierstore.offload_activations(store):
        loss = m(x).sum() + tiny.exp().sum()
    stats = store.stats()
    # Saved: x and lin.weight.t() by addmm; the buffer by mul; exp's result (16 bytes).
    assert stats.skipped.get("parameter_or_buffer") == 2
    assert stats.skipped_bytes["parameter_or_buffer"] == 2 * 256 * 256 * 4
    assert stats.skipped.get("below_min_bytes") == 1
    assert stats.puts == 1 and stats.bytes_put == 256 * 256 * 4  # x only
    loss.backward()
    assert m.lin.weight.grad is not None


def test_an_expanded_tensor_counts_the_bytes_of_its_storage(store_factory: StoreFactory) -> None:
    """A 16 MiB ``expand`` of a 4 KiB row: its storage is what would move, under
    ``min_bytes``. It was put and then kept by the store, so the step said "offloaded 0 B,
    skipped nothing", and the block that offloaded nothing did not warn."""
    store = store_factory("disk", min_bytes=1 << 20)
    w = torch.randn(4096, 1024, requires_grad=True)
    row = torch.randn(1, 1024)
    with (
        pytest.warns(RuntimeWarning, match="stored nothing"),
        tierstore.offload_activations(store),
    ):
        loss = (w * row.expand(4096, 1024)).sum()  # mul saves the expanded row for w
    stats = store.stats()
    assert stats.puts == 0
    assert stats.skipped_bytes["below_min_bytes"] == row.nbytes
    loss.backward()
    assert w.grad is not None and torch.equal(w.grad, row.expand(4096, 1024))


def test_min_bytes_defaults_to_the_stores(store_factory: StoreFactory) -> None:
    store = store_factory("disk", min_bytes=1 << 20)
    x = torch.randn(64, 64, requires_grad=True)
    big = torch.randn(1024, 512, requires_grad=True)
    with tierstore.offload_activations(store):
        loss = x.exp().sum() + big.exp().sum()
    assert store.stats().puts == 1
    assert store.stats().skipped_bytes["below_min_bytes"] == 64 * 64 * 4
    with tierstore.offload_activations(store, min_bytes=0):
        loss2 = x.exp().sum()
    assert store.stats().puts == 2
    (loss + loss2).backward()
    with pytest.raises(ValueError, match="min_bytes=-1"):
        tierstore.offload_activations(store, min_bytes=-1)


def test_unsupported_tensors_stay_and_are_counted(store_factory: StoreFactory) -> None:
    store = store_factory("disk")
    sparse = torch.randn(64, 64).relu().to_sparse()
    dense = torch.randn(64, 32, requires_grad=True)
    # Nothing else is saved, so the block stored nothing, and says why.
    with (
        pytest.warns(RuntimeWarning, match=r"stored nothing.*unsupported 1"),
        tierstore.offload_activations(store),
    ):
        loss = torch.sparse.mm(sparse, dense).sum()  # saves the sparse operand
    assert store.stats().skipped.get("unsupported", 0) >= 1
    loss.backward()
    assert torch.equal(dense.grad, sparse.to_dense().t() @ torch.ones(64, 32))


def test_no_room_keeps_the_tensor_counts_and_warns_once(store_factory: StoreFactory) -> None:
    store = store_factory("disk", disk_bytes=0)
    expected = train_steps(None)
    # The inner block passes on what it does not match: every step stored nothing, which is
    # said once too, with the reason and what to raise.
    with (
        pytest.warns(RuntimeWarning, match="stored nothing") as outer,
        pytest.warns(RuntimeWarning, match="no tier had room") as record,
    ):
        got = train_steps(store)
    said = [str(w.message) for w in record if "no tier had room" in str(w.message)]
    assert len(said) == 1
    # The caller's tensor (the first saved, token ids), not the byte view the adapters put.
    assert "int64 tensor on cpu (device 0 B" in said[0] and "uint8" not in said[0], said[0]
    nothing = [str(w.message) for w in outer if "stored nothing" in str(w.message)]
    assert len(nothing) == 1 and "no room" in nothing[0] and "TIERSTORE_HOST_BYTES" in nothing[0]
    assert_equal_tensors(expected, got)
    stats = store.stats()
    assert stats.puts == 0
    assert stats.skipped["no_room"] > 0


# -- composition: torch.utils.checkpoint inside, autograd threads ---------------------------


def test_torch_checkpoint_inside_the_block(store_factory: StoreFactory) -> None:
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    def call(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch_checkpoint(block, x, use_reentrant=False)
        return out

    model, ids = model_and_batch()
    torch.manual_seed(3)
    model.loss(ids).backward()
    expected = grads(model)
    model.zero_grad()
    store = store_factory("disk")
    torch.manual_seed(3)
    with tierstore.offload_activations(store):
        loss = model.loss(ids, layer_call=call)
    assert store.stats().puts > 0  # what the checkpointed blocks return is offloaded
    loss.backward()
    assert_equal_tensors(expected, grads(model))
    assert stats_once_released(store).live_entries == 0


def test_training_on_several_threads_at_once(store_factory: StoreFactory) -> None:
    # The global RNG is shared between threads: models are built first, and without dropout.
    expected = train_steps(None, steps=3, seed_each_step=False, p=0.0)
    store = store_factory("disk")
    built = [model_and_batch(p=0.0) for _ in range(3)]
    results: dict[int, list[torch.Tensor]] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(3)

    def worker(i: int) -> None:
        try:
            model, ids = built[i]
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            out: list[torch.Tensor] = []
            start.wait()
            for _ in range(3):
                opt.zero_grad()
                with tierstore.offload_activations(store):
                    loss = model.loss(ids)
                loss.backward()
                out += grads(model)
                opt.step()
            results[i] = out
        except BaseException as err:  # reported below
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i in range(3):
        assert_equal_tensors(expected, results[i])
    assert store.stats().puts > 0
    assert stats_once_released(store).live_entries == 0


# -- prefetch order and visibility ----------------------------------------------------------


class RecordingStore:
    """Forwards to a real store and records the order of get and prefetch calls."""

    def __init__(self, store: tierstore.TieredStore) -> None:
        self.inner = store
        self.config = getattr(store, "config", None)
        self.calls: list[tuple[str, list[int]]] = []

    def put(self, t: torch.Tensor, **kwargs: Any) -> tierstore.TensorHandle:
        return self.inner.put(t, **kwargs)

    def get(self, h: tierstore.TensorHandle) -> torch.Tensor:
        self.calls.append(("get", [h.key]))
        return self.inner.get(h)

    def prefetch(self, handles: list[tierstore.TensorHandle]) -> None:
        self.calls.append(("prefetch", [h.key for h in handles]))
        self.inner.prefetch(handles)

    def note_skipped(self, reason: str, nbytes: int) -> None:
        self.inner.note_skipped(reason, nbytes)


def test_a_store_whose_stats_raise_leaves_no_hooks_behind(store_factory: StoreFactory) -> None:
    """The block read the store's stats after installing its hooks: a stats() that raised
    (a stand-in's, any error but tierstore's own) left the hooks on the thread with nothing
    to remove them, and every later save went to the store."""

    class BrokenStats(RecordingStore):
        puts = 0

        def put(self, t: torch.Tensor, **kwargs: Any) -> tierstore.TensorHandle:
            type(self).puts += 1
            return super().put(t, **kwargs)

        def stats(self) -> Any:
            raise RuntimeError("stats are broken")

    store = BrokenStats(store_factory("disk", min_bytes=0))
    block = tierstore.offload_activations(store)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="stats are broken"):
        block.__enter__()
    x = torch.randn(64, 64, requires_grad=True)
    x.exp().sum().backward()
    assert BrokenStats.puts == 0


def test_backward_gets_newest_first_and_prefetches_ahead(store_factory: StoreFactory) -> None:
    store = RecordingStore(store_factory("disk"))
    x = torch.randn(128, 128, requires_grad=True)
    with tierstore.offload_activations(store):  # type: ignore[arg-type]
        y = x
        for _ in range(6):
            y = y.exp().tanh()  # each op saves one new tensor
        loss = y.sum()
    loss.backward()
    gets = [keys[0] for kind, keys in store.calls if kind == "get"]
    assert len(gets) == 12 and gets == sorted(gets, reverse=True)
    requested: set[int] = set()
    for kind, keys in store.calls:
        if kind == "prefetch":
            assert all(k < min(gets) or k not in requested for k in keys)
            requested.update(keys)
        elif keys[0] != max(gets):
            # Every get but the first was asked for ahead of time.
            assert keys[0] in requested, (keys, store.calls)


class SavesEach(torch.autograd.Function):
    """Passes ``y`` on and saves each of ``tensors``; its backward reads them all back, in the
    order they were saved (``ctx.saved_tensors``)."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(*tensors)
        return y.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return (grad, *(None for _ in ctx.saved_tensors))


def test_first_gets_out_of_save_order_ask_for_each_entry_once(
    store_factory: StoreFactory,
) -> None:
    """A node's backward reads its saved tensors oldest first, so backward's first gets go
    up the save order. Each later first get's walk stopped short of the lowest entry
    asked for, and that mark moved up to where the walk stopped: the next gets asked the
    store again for entries it had been asked for already."""
    store = RecordingStore(store_factory("disk", prefetch_bytes=2 << 20))
    ts = [torch.full((1 << 18,), float(i)) for i in range(8)]  # 1 MiB each; the window: 2
    x = torch.randn(4, requires_grad=True)
    with tierstore.offload_activations(store):  # type: ignore[arg-type]
        y = x
        for t in ts[:4]:
            y = SavesEach.apply(y, t)  # four nodes: read back newest first
        y = SavesEach.apply(y, *ts[4:])  # one node, first in backward: oldest first
        loss = y.sum()
    loss.backward()
    gets = [keys[0] for kind, keys in store.calls if kind == "get"]
    saved = sorted(gets)  # keys follow the save order
    assert gets == saved[4:] + saved[3::-1]
    asked = [k for kind, keys in store.calls if kind == "prefetch" for k in keys]
    assert asked == saved[3::-1], store.calls
    assert torch.equal(x.grad, torch.ones(4))


def test_one_block_around_several_steps_prefetches_in_every_backward(
    store_factory: StoreFactory,
) -> None:
    # After the first backward the window's low mark stayed at the first entry: later steps
    # prefetched nothing, and the save order grew by every step's entries, for good.
    store = RecordingStore(store_factory("disk"))
    x = torch.randn(128, 128, requires_grad=True)
    block = tierstore.offload_activations(store)  # type: ignore[arg-type]
    asked: list[int] = []
    with block:
        session = block._active()[-1][1]
        for _ in range(3):
            store.calls.clear()
            y = x
            for _ in range(6):
                y = y.exp().tanh()
            y.sum().backward()
            del y
            asked.append(sum(len(keys) for kind, keys in store.calls if kind == "prefetch"))
        assert len(session._order) == 12  # the last step's entries, not all three steps'
    assert asked[0] >= 10 and asked[1] == asked[2] == asked[0]


def test_a_block_around_forwards_with_no_backward_keeps_no_order_of_the_dead(
    store_factory: StoreFactory,
) -> None:
    """Note: [The save order forgets the dead]: evaluation with grad left on, inside one long
    block, kept a reference per save in the block's order, all dead: 8004 after 2000
    forwards."""
    store = store_factory("host", min_bytes=0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    block = tierstore.offload_activations(store, min_bytes=0)
    with block:
        session = block._active()[-1][1]
        for _ in range(300):
            loss = model(torch.randn(8, 64)).sum()
            del loss  # grad on, no backward
        assert len(session._order) <= 2 * 4 + 1
    # The order still serves a backward: a later step prefetches and trains as without it.
    x = torch.randn(8, 64)
    want = torch.autograd.grad(model(x).sum(), list(model.parameters()))
    with block:
        got = torch.autograd.grad(model(x).sum(), list(model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


class _CountingList(list):  # type: ignore[type-arg]
    reads = 0

    def __getitem__(self, i: Any) -> Any:
        type(self).reads += 1
        return super().__getitem__(i)


def test_a_backward_smaller_than_the_window_walks_the_save_order_once(
    store_factory: StoreFactory,
) -> None:
    """Note: [The save order forgets the dead]: each first get walked the order down to the
    first entry while the entries' bytes stayed under the window, so a backward of n small
    entries read n * n / 2 references (0.43 s of a 0.53 s backward at n = 4000)."""
    n = 400
    store = store_factory("host", min_bytes=1024)
    x = torch.randn(32, 32, requires_grad=True)
    block = tierstore.offload_activations(store, min_bytes=1024)
    with block:
        session = block._active()[-1][1]
        session._order = _CountingList()
        y = x
        for _ in range(n):
            y = y.sin()
        _CountingList.reads = 0
        (got,) = torch.autograd.grad(y.sum(), x)
    assert _CountingList.reads <= 2 * n, _CountingList.reads
    y = x
    for _ in range(n):
        y = y.sin()
    (want,) = torch.autograd.grad(y.sum(), x)
    assert torch.equal(got, want)


def test_stats_show_what_was_offloaded_and_summary_is_logged(
    store_factory: StoreFactory, caplog: pytest.LogCaptureFixture
) -> None:
    store = store_factory("disk", min_bytes=1024)
    train_steps(store, steps=1)
    stats = stats_once_released(store)
    assert stats.disk.total_entries == stats.puts > 0
    # The disk tier counts whole pages per entry: at least the bytes put.
    assert stats.disk.total_bytes >= stats.bytes_put >= stats.bytes_to_disk > 0
    assert stats.bytes_from_disk > 0
    assert stats.get_wait_seconds >= 0.0
    assert stats.skipped["below_min_bytes"] > 0 and stats.skipped["parameter_or_buffer"] > 0
    assert "disk" in stats.summary()
    with caplog.at_level(logging.INFO, logger="tierstore"):
        store.close()
    lines = [r for r in caplog.records if r.name == "tierstore" and r.levelno == logging.INFO]
    assert any(f"{stats.puts} tensors" in r.getMessage() for r in lines), caplog.text


def test_a_refused_enter_leaves_no_global_module_hook(store_factory: StoreFactory) -> None:
    store = store_factory("host")
    hooks = torch.nn.modules.module._global_forward_pre_hooks
    before = len(hooks)
    block = tierstore.offload_activations(store)
    with torch.autograd.graph.disable_saved_tensors_hooks("hooks are off here"):
        for _ in range(3):
            with pytest.raises(RuntimeError, match="hooks are off here"), block:
                pass
    assert len(hooks) == before
    # The same object still works once hooks are allowed again.
    x = torch.randn(64, 64, requires_grad=True)
    with block:
        loss = (x.exp() * 2).sum()
    loss.backward()
    assert x.grad is not None and torch.equal(x.grad, 2 * x.detach().exp())
    assert len(hooks) == before


def test_the_stand_ins_torch_traces_with_are_left_alone_uncounted(
    store_factory: StoreFactory,
) -> None:
    """torch 2.4 traces compiled graphs with the hooks installed: a FakeTensor has no bytes to
    move, and is not a tensor the store refused either."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tierstore.adapters._common import traced_stand_in
    from tierstore.adapters._storage import StorageTable

    store = store_factory("disk")
    with FakeTensorMode():
        fake = torch.empty(1 << 20)
    assert traced_stand_in(fake) and not traced_stand_in(torch.empty(4))
    assert StorageTable().offload(store, fake, 0) is fake
    stats = store.stats()
    assert stats.puts == 0 and not stats.skipped


def test_hooks_run_as_they_are_while_fx_traces(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where FX traces a graph with the hooks installed (torch 2.4), a function Dynamo must not
    trace cannot be called: FX refuses to trace into one. There the hooks run as they are."""
    import torch._dynamo  # untraced wraps only once Dynamo is loaded

    from tierstore.adapters._common import untraced

    through: list[str] = []

    def disable(fn: Any) -> Any:
        def run(*args: Any) -> Any:
            through.append("disabled")
            return fn(*args)

        return run

    monkeypatch.setattr(torch.compiler, "disable", disable)
    hook = untraced(lambda t: t)
    x = torch.ones(3)
    assert hook(x) is x and through == ["disabled"]
    monkeypatch.setattr(torch.fx._symbolic_trace, "_is_fx_tracing_flag", True)
    assert hook(x) is x and through == ["disabled"]  # called directly this time


@pytest.mark.parametrize("how", ["conj-imag", "neg-view"])
def test_a_tensor_with_a_lazy_negative_bit_stays_in_place(
    store_factory: StoreFactory, how: str
) -> None:
    """A lazy negative bit is not part of the bytes: such a tensor stays as it is and is counted
    unsupported. A failure (a crash in the forward, or a gradient of the wrong sign) means it
    was offloaded as its bytes."""
    store = store_factory("disk")
    torch.manual_seed(0)
    w = torch.randn(1 << 18, requires_grad=True)
    base = torch.randn(1 << 18, dtype=torch.complex64)

    def negated() -> torch.Tensor:
        n = base.conj().imag if how == "conj-imag" else torch._neg_view(base.real)
        assert n.is_neg()
        return n

    (expected,) = torch.autograd.grad((negated() * w).sum(), w)
    with (
        pytest.warns(RuntimeWarning, match=r"stored nothing.*unsupported 1"),
        tierstore.offload_activations(store),
    ):
        loss = (negated() * w).sum()  # mul saves the negated operand for w's gradient
    stats = store.stats()
    assert stats.puts == 0 and dict(stats.skipped) == {"unsupported": 1}
    loss.backward()
    assert w.grad is not None and torch.equal(w.grad, expected)


def test_an_async_collective_tensor_is_waited_on_and_stored(
    store_factory: StoreFactory, tmp_path: Path
) -> None:
    """A functional collective hands out an AsyncCollectiveTensor (a row-wise parallel layer's
    output); any use of it waits. A failure means the saved one was refused as an unknown
    subclass instead of being waited on and stored."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    if dist.is_initialized():
        pytest.skip("a process group is already set up in this process")
    import torch.distributed._functional_collectives as funcol

    store = store_factory("disk")
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1
    )
    try:
        torch.manual_seed(0)
        w = torch.randn(1 << 18, requires_grad=True)
        a = torch.randn(1 << 18)
        world = dist.group.WORLD
        assert world is not None
        with tierstore.offload_activations(store):
            reduced = funcol.all_reduce(a, "sum", world)
            assert type(reduced).__name__ == "AsyncCollectiveTensor"
            loss = (reduced * w).sum()  # mul saves the collective's output for w's gradient
        del reduced
        stats = store.stats()
        assert stats.puts == 1 and not stats.skipped
        loss.backward()
        assert w.grad is not None and torch.equal(w.grad, a)  # a sum over one rank is a
    finally:
        dist.destroy_process_group()


def test_a_store_returning_fewer_elements_than_a_record_reaches_is_refused(
    store_factory: StoreFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A saved tensor that reaches the last element of its storage, read back from a store
    that returns one element fewer than was put (a store wrapped by the caller, say). Unpack
    must refuse: rebuilt as it was saved, the tensor would reach past what the store returned,
    and here its last value silently came from the memory after the shortened view."""
    from tierstore.adapters._storage import Saved, StorageTable

    store = store_factory("host")
    t = torch.arange(1024, dtype=torch.float32)
    saved = StorageTable().offload(store, t, 0)
    assert isinstance(saved, Saved)
    real_get = store.get

    def short_get(handle: tierstore.TensorHandle) -> torch.Tensor:
        return real_get(handle)[:-4]  # one float32 fewer, still a view of the whole storage

    monkeypatch.setattr(store, "get", short_get)
    with pytest.raises(RuntimeError, match=r"needs 1024 elements .* the store returned 1023"):
        saved.tensor()
