"""tierstore.checkpoint: identical gradients with dropout, arguments, outputs, no recursion.

See Note: [Checkpoint without recursion] and Note: [Every input is an input].
"""

from __future__ import annotations

import contextlib
import functools
import gc
from pathlib import Path
from typing import Any

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

import tierstore
from tierstore.testing import settled, wait_for


def train_steps(store: tierstore.TieredStore | None, steps: int = 2) -> list[torch.Tensor]:
    """SGD steps of the tiny decoder with dropout, each block checkpointed when ``store``."""
    model, ids = model_and_batch(p=0.2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def call(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return tierstore.checkpoint(block, x, store=store)

    out: list[torch.Tensor] = []
    for step in range(steps):
        torch.manual_seed(200 + step)
        opt.zero_grad()
        loss = model.loss(ids, layer_call=None if store is None else call)
        if store is not None:
            wait_for(lambda: settled(store))
        loss.backward()
        out += grads(model)
        opt.step()
    return out


@pytest.mark.parametrize("tier", TIERS)
def test_grads_equal_with_dropout_and_each_tier(store_factory: StoreFactory, tier: str) -> None:
    expected = train_steps(None)
    store = store_factory(tier)
    assert_equal_tensors(expected, train_steps(store))
    stats = stats_once_released(store)
    assert stats.puts > 0 and stats.live_entries == 0
    # Each tier really held the inputs, and no slower one did.
    placed = {"device": stats.device, "host": stats.host, "disk": stats.disk}
    assert placed[tier].total_entries == stats.puts
    assert sum(placed[name].total_entries for name in TIERS[TIERS.index(tier) + 1 :]) == 0
    if tier == "disk":
        assert stats.bytes_to_disk == stats.bytes_put and stats.bytes_from_disk > 0


def test_torch_that_reads_inputs_through_input_saver(
    store_factory: StoreFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch before ``_CheckpointFrame.get_inputs`` (2.11, for one) reads a frame's inputs as
    ``frame.input_saver.grad_fn.get_args(ctx.saved_tensors)``; without an answer there, a
    checkpoint's backward failed on a GPU machine with ``'NoneType' object has no attribute
    'grad_fn'``. Here torch's own call is routed through that older path."""
    from tierstore.adapters import _checkpoint

    monkeypatch.setattr(_checkpoint, "_FRAME_READS_INPUTS", False)
    direct = _checkpoint._StoreFrame.get_inputs
    routed: list[int] = []

    def as_older_torch(frame: Any) -> list[Any]:
        if getattr(frame, "_in_saver", False):
            return direct(frame)
        ctx = frame.input_saver.grad_fn
        frame._in_saver = True
        try:
            routed.append(1)
            return list(ctx.get_args(ctx.saved_tensors))
        finally:
            frame._in_saver = False

    monkeypatch.setattr(_checkpoint._StoreFrame, "get_inputs", as_older_torch)
    expected = train_steps(None)
    assert_equal_tensors(expected, train_steps(store_factory("disk")))
    assert routed, "torch never asked for the inputs"


def test_without_preserving_rng_dropout_differs(store_factory: StoreFactory) -> None:
    # The control for the test above: the RNG restore is what makes the gradients identical.
    store = store_factory("host")
    drop = nn.Dropout(0.5)
    x = torch.randn(256, requires_grad=True)
    torch.manual_seed(0)
    y = tierstore.checkpoint(drop, x, store=store, preserve_rng_state=False)
    mask_fwd = y != 0
    torch.randn(1000)  # advance the RNG between forward and backward
    y.sum().backward()
    assert x.grad is not None
    assert not torch.equal(x.grad != 0, mask_fwd)


def test_kwargs_nested_outputs_and_non_tensor_arguments(store_factory: StoreFactory) -> None:
    store = store_factory("disk")
    lin = nn.Linear(16, 16)

    def fn(
        x: torch.Tensor, pair: tuple[torch.Tensor, int], *, scale: float, bias: torch.Tensor
    ) -> dict[str, Any]:
        h = lin(x) * scale + bias * pair[1]
        return {"h": h, "parts": (h.relu(), None, pair[1]), "idx": h.argmax(-1)}

    x = torch.randn(8, 16, requires_grad=True)
    other = torch.randn(8, 16, requires_grad=True)
    bias = torch.randn(16, requires_grad=True)

    def loss_of(out: dict[str, Any]) -> torch.Tensor:
        assert out["parts"][1] is None and out["parts"][2] == 3
        assert out["idx"].dtype == torch.int64 and not out["idx"].requires_grad
        return out["h"].sum() + out["parts"][0].pow(2).sum()

    expected = torch.autograd.grad(
        loss_of(fn(x, (other, 3), scale=0.5, bias=bias)), [x, bias, lin.weight]
    )
    out = tierstore.checkpoint(fn, x, (other, 3), store=store, scale=0.5, bias=bias)
    loss_of(out).backward()
    assert other.grad is None  # passed but unused, as without checkpointing
    got = [x.grad, bias.grad, lin.weight.grad]
    assert all(g is not None for g in got)
    assert_equal_tensors(list(expected), got)  # type: ignore[arg-type]


def test_tensors_bound_in_a_partial_get_their_gradients(store_factory: StoreFactory) -> None:
    store = store_factory("disk")
    w = torch.randn(16, 16, requires_grad=True)

    def fn(x: torch.Tensor, *, weight: torch.Tensor) -> torch.Tensor:
        return (x @ weight).tanh()

    x = torch.randn(4, 16, requires_grad=True)
    (ex, ew) = torch.autograd.grad(fn(x, weight=w).sum(), [x, w])
    y = tierstore.checkpoint(functools.partial(fn, weight=w), x, store=store)
    wait_for(lambda: settled(store))
    assert store.stats().disk.entries == 2  # x, and the weight bound in the partial
    y.sum().backward()
    assert x.grad is not None and w.grad is not None
    assert torch.equal(x.grad, ex) and torch.equal(w.grad, ew)
    # Both are still the caller's: the recompute takes them as they are, read nothing back.
    assert store.stats().bytes_from_disk == 0


def test_inputs_not_requiring_grad_still_train_the_parameters(
    store_factory: StoreFactory,
) -> None:
    store = store_factory("disk")
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(32, 64), nn.Dropout(0.3), nn.GELU(), nn.Linear(64, 32))
    x = torch.randn(16, 32)  # frozen embeddings: no grad
    torch.manual_seed(1)
    layer(x).pow(2).sum().backward()
    expected = grads(layer)
    layer.zero_grad()
    torch.manual_seed(1)
    y = tierstore.checkpoint(layer, x, store=store)
    assert y.requires_grad
    y.pow(2).sum().backward()
    assert_equal_tensors(expected, grads(layer))
    assert store.stats().puts == 1  # x is stored even though it needs no grad


class Counting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(32, 32)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.lin(x).relu()


def test_wrapping_a_modules_forward_does_not_recurse(store_factory: StoreFactory) -> None:
    store = store_factory("disk")
    layer = Counting()
    x = torch.randn(4, 32, requires_grad=True)
    (expected,) = torch.autograd.grad(layer(x).sum(), [layer.lin.weight])
    layer.calls = 0
    # The usual way to wrap: the instance's forward calls checkpoint on the module itself.
    layer.forward = functools.partial(tierstore.checkpoint, layer, store=store)  # type: ignore[method-assign]
    y = layer(x)
    assert layer.calls == 1
    y.sum().backward()
    assert layer.calls == 2  # forward once, recompute once
    assert layer.lin.weight.grad is not None
    assert torch.equal(layer.lin.weight.grad, expected)


class Hooked(nn.Module):
    """A block whose forward hooks change its input and output, and count their calls."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(512, 512)
        self.pre_calls = self.post_calls = 0
        self.register_forward_pre_hook(Hooked._pre)
        self.register_forward_hook(Hooked._post)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) * x

    def _pre(self, args: tuple[torch.Tensor]) -> tuple[torch.Tensor]:
        self.pre_calls += 1
        return (args[0] + 1,)

    def _post(self, args: tuple[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        self.post_calls += 1
        return out * 2


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_a_wrapped_forward_runs_the_modules_hooks_once(
    store_factory: StoreFactory, tier: str
) -> None:
    """Note: [A wrapped forward runs the module's hooks once]: 1 MiB+ activations (2048 x 512
    float32, 4 MiB), on the host and the disk tier; the checkpoint ran the module itself, so
    its hooks ran twice (output x4, input +2) and gradients differed."""
    store = store_factory(tier)
    torch.manual_seed(0)
    plain, wrapped = Hooked(), Hooked()
    wrapped.load_state_dict(plain.state_dict())
    x = torch.randn(2048, 512, requires_grad=True)
    expected = plain(x)
    expected_grads = torch.autograd.grad(expected.square().sum(), [x, plain.lin.weight])
    wrapped.forward = functools.partial(tierstore.checkpoint, wrapped, store=store)  # type: ignore[method-assign]
    out = wrapped(x)
    assert (wrapped.pre_calls, wrapped.post_calls) == (1, 1)
    assert torch.equal(out, expected)
    grads = torch.autograd.grad(out.square().sum(), [x, wrapped.lin.weight])
    assert all(torch.equal(g, e) for g, e in zip(grads, expected_grads, strict=True))
    assert (wrapped.pre_calls, wrapped.post_calls) == (1, 1)  # the recompute runs no hooks
    assert store.stats().puts >= 1
    # Called directly, the checkpoint runs the module, hooks and all, once.
    direct = tierstore.checkpoint(wrapped, x, store=store)
    assert torch.equal(direct, expected)
    assert (wrapped.pre_calls, wrapped.post_calls) == (2, 2)


@pytest.mark.parametrize("between", ["a wrapper function", "accelerate's hook"])
def test_a_wrapped_forward_runs_the_hooks_once_with_frames_in_between(
    store_factory: StoreFactory, between: str
) -> None:
    """A frame between the module's call and the checkpoint (a decorator, accelerate's
    ``add_hook_to_module``) hid the module's call: its hooks ran twice with grad on, and with
    grad off the wrapper recursed."""
    store = store_factory("disk")
    torch.manual_seed(0)
    plain, wrapped = Hooked(), Hooked()
    wrapped.load_state_dict(plain.state_dict())
    checkpointed = functools.partial(tierstore.checkpoint, wrapped, store=store)
    if between == "a wrapper function":

        def forward(x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = checkpointed(x)
            return out

        wrapped.forward = forward  # type: ignore[method-assign]
    else:
        hooks = pytest.importorskip("accelerate.hooks")
        wrapped.forward = checkpointed  # type: ignore[method-assign]
        hooks.add_hook_to_module(wrapped, hooks.ModelHook())
    x = torch.randn(2048, 512, requires_grad=True)
    expected = plain(x)
    expected_grads = torch.autograd.grad(expected.sum(), [x, plain.lin.weight])
    out = wrapped(x)
    assert torch.equal(out, expected)
    grads = torch.autograd.grad(out.sum(), [x, wrapped.lin.weight])
    assert all(torch.equal(g, e) for g, e in zip(grads, expected_grads, strict=True))
    with torch.no_grad():
        assert torch.equal(wrapped(x), plain(x))
    assert (wrapped.pre_calls, wrapped.post_calls) == (2, 2)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "eval"])
def test_a_wrapped_forward_works_with_grad_off(store_factory: StoreFactory, mode: str) -> None:
    """With grad off the wrapper entered itself without end (RecursionError)."""
    store = store_factory("disk")
    torch.manual_seed(0)
    plain, wrapped = Hooked(), Hooked()
    wrapped.load_state_dict(plain.state_dict())
    wrapped.forward = functools.partial(tierstore.checkpoint, wrapped, store=store)  # type: ignore[method-assign]
    x = torch.randn(2048, 512)
    context = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}.get(mode)
    with context() if context is not None else contextlib.nullcontext():
        assert torch.equal(wrapped(x), plain(x))
    assert (wrapped.pre_calls, wrapped.post_calls) == (1, 1)


def test_a_layer_that_checkpoints_itself_inside_checkpoint(store_factory: StoreFactory) -> None:
    store = store_factory("disk")

    class SelfCheckpointing(Counting):
        # As transformers' GradientCheckpointingLayer does: forward hands
        # partial(<class forward>, self) to the checkpoint function.
        def __call__(self, x: torch.Tensor) -> torch.Tensor:
            return tierstore.checkpoint(functools.partial(Counting.forward, self), x, store=store)

    layer = SelfCheckpointing()
    x = torch.randn(4, 32, requires_grad=True)
    y = tierstore.checkpoint(layer, x, store=store)  # checkpointing it once more from outside
    assert layer.calls == 1
    assert store.stats().puts == 1  # checkpointed once, not twice
    y.sum().backward()
    assert layer.calls == 2
    assert x.grad is not None


@pytest.mark.parametrize("tier", ["host", "disk"])
@pytest.mark.parametrize(
    "passed", ["keyword", "keyword-temporary", "keyword-view", "partial", "nested", "positional"]
)
def test_inputs_torch_does_not_check_may_be_written_in_place_as_with_torchs_checkpoint(
    store_factory: StoreFactory, passed: str, tier: str
) -> None:
    """A statistics buffer the forward updates in place: torch's checkpoint checks only the
    top-level positional tensors it is given, and trains with the buffer passed as a
    keyword (a temporary, a view of a buffer), bound in a partial or nested in a tuple (the
    recompute gets the buffer as it is then). tierstore.checkpoint raised for all of them;
    passed positionally, both raise."""
    store = store_factory(tier)

    def f(x: torch.Tensor, w: torch.Tensor, stats: Any) -> torch.Tensor:
        buffer = stats[0] if isinstance(stats, tuple) else stats
        h = (x @ w).tanh()
        with torch.no_grad():
            buffer.add_(h.abs().mean(0))
        return h * 2

    def run(ckpt: Any) -> list[torch.Tensor]:
        torch.manual_seed(0)
        x = torch.randn(1024, 300, requires_grad=True)  # over 1 MiB: on disk, it is read back
        w = torch.randn(300, 300, requires_grad=True)
        stats = torch.zeros(300)
        if passed == "keyword":
            y = ckpt(f, x * 1.0, w, stats=stats)
        elif passed == "keyword-temporary":  # dies with the call: only the forward's write
            y = ckpt(f, x * 1.0, w, stats=torch.zeros(300))
        elif passed == "keyword-view":  # the view dies with the call, its base lives
            buf = torch.zeros(4, 300)
            y = ckpt(f, x * 1.0, w, stats=buf[1])
            stats = buf
        elif passed == "partial":
            y = ckpt(functools.partial(f, stats=stats), x * 1.0, w)
        else:
            y = ckpt(f, x * 1.0, w, (stats,) if passed == "nested" else stats)
        y.pow(2).sum().backward()
        assert x.grad is not None and w.grad is not None
        return [x.grad, w.grad, stats]

    def torchs(fn: Any, *args: Any, **kwargs: Any) -> Any:
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, **kwargs)

    def ours(fn: Any, *args: Any, **kwargs: Any) -> Any:
        return tierstore.checkpoint(fn, *args, store=store, **kwargs)

    if passed == "positional":
        for ckpt in (torchs, ours):
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                run(ckpt)
        return
    assert_equal_tensors(run(torchs), run(ours))


@pytest.mark.parametrize("passed", ["positional", "keyword"])
def test_one_tensor_passed_as_several_arguments_is_one_tensor_in_the_recompute(
    store_factory: StoreFactory, passed: str
) -> None:
    """Note: [One tensor passed twice is one tensor]: ``mha(h, h, h)`` takes the fused path
    when ``query is key is value``. Rebuilt one by one from disk, the three were three tensors
    in the recompute, which took the other path and raised ``CheckpointError``."""
    store = store_factory("disk")
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(256, 4, batch_first=True)
    proj = nn.Linear(256, 256)
    x = torch.randn(8, 128, 256)  # 1 MiB inputs: stored, and dead by backward

    def run(ck: Any) -> list[torch.Tensor]:
        mha.zero_grad()
        proj.zero_grad()
        h = proj(x)
        args, kwargs = (
            ((h, h, h), {}) if passed == "positional" else ((), dict(query=h, key=h, value=h))
        )
        out, _ = ck(mha, *args, **kwargs)
        del h, args, kwargs  # nothing but the store keeps the input
        loss = out.pow(2).sum()
        wait_for(lambda: settled(store))
        loss.backward()
        return grads(mha) + grads(proj)

    expected = run(lambda f, *a, **k: f(*a, **k))
    got = run(lambda f, *a, **k: tierstore.checkpoint(f, *a, store=store, **k))
    assert_equal_tensors(expected, got)
    stats = stats_once_released(store)
    assert stats.puts == 1 and stats.bytes_from_disk > 0  # one entry, read back from disk


def test_a_checkpoint_of_an_enclosing_module_runs_directly_in_the_recompute_too(
    store_factory: StoreFactory,
) -> None:
    """Note: [Checkpoint without recursion]: ``A`` checkpoints ``g``, which checkpoints a
    method of ``A``. In the forward that runs directly (``A`` is running); the recompute of
    ``g``'s checkpoint marked only ``g``, so there it became a checkpoint of its own, saved
    nothing where the forward saved three tensors, and raised ``CheckpointError``."""
    store = store_factory("disk")

    def g(x: torch.Tensor, a: A) -> torch.Tensor:
        return tierstore.checkpoint(a.inner, x, store=store)

    class A(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(64, 64)

        def inner(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x).sin()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return tierstore.checkpoint(g, x, self, store=store)

    torch.manual_seed(0)
    a = A()
    x = torch.randn(8, 64, requires_grad=True)
    a.inner(x).pow(2).sum().backward()
    expected = [*grads(a), x.grad.clone()]  # type: ignore[union-attr]
    a.zero_grad()
    x.grad = None
    tierstore.checkpoint(a, x, store=store).pow(2).sum().backward()
    assert_equal_tensors(expected, [*grads(a), x.grad])  # type: ignore[list-item]


def test_a_recompute_marks_the_enclosing_functions_themselves_not_their_ids(
    store_factory: StoreFactory,
) -> None:
    """The enclosing checkpoint's function here is a temporary lambda, freed before the inner
    frame recomputes; marking its ``id`` there made the fresh lambda the recompute creates at
    that address run directly, so the recompute saved other tensors of the same shapes and
    the gradient was wrong (max error 15) without an error."""
    store = store_factory("host")

    def ck(fn: Any, t: torch.Tensor) -> torch.Tensor:
        return tierstore.checkpoint(fn, t, store=store)

    def inner(t: torch.Tensor) -> torch.Tensor:
        return ck(lambda u: u.cos() * 2, t).sin()  # a fresh lambda at every call

    torch.manual_seed(0)
    x = torch.randn(64, 64, requires_grad=True)
    (expected,) = torch.autograd.grad((x.cos() * 2).sin().exp().pow(2).sum(), x)
    ck(lambda t: ck(inner, t).exp(), x).pow(2).sum().backward()
    assert_equal_tensors([expected], [x.grad])  # type: ignore[list-item]


def test_an_enclosing_function_that_keeps_the_inner_output_frees_every_step(
    store_factory: StoreFactory,
) -> None:
    """Note: [Checkpoint without recursion]: the inner frame remembers its enclosing owners
    weakly. Held, the outer body (which keeps the inner checkpoint's output in a closure
    cell) closed a cycle through autograd's C++ objects: one entry more left every step."""
    store = store_factory("host")
    sub = nn.Linear(256, 256)

    def step() -> None:
        x = torch.randn(256, 256, requires_grad=True)
        h: torch.Tensor | None = None

        def body(t: torch.Tensor) -> torch.Tensor:
            nonlocal h
            h = tierstore.checkpoint(sub, t, store=store)
            return h.exp()

        tierstore.checkpoint(body, x, store=store).sum().backward()

    for _ in range(3):
        step()
        gc.collect()
        assert stats_once_released(store).live_entries == 0


def test_a_live_input_beside_a_rebuilt_view_of_it_holds_nothing_after_backward(
    store_factory: StoreFactory,
) -> None:
    """Note: [Read once for every record]: ``x`` alive goes into one checkpoint, a view of it
    into another. The view's recompute reads the bytes; the other gets ``x`` itself, which
    used to leave its record uncounted, so the bytes stayed held as long as the graph."""
    from tierstore.adapters._storage import Stored

    store = store_factory("disk")
    w = nn.Parameter(torch.randn(512, 512))
    x = torch.randn(512, 512)
    y = tierstore.checkpoint(lambda t: (t @ w).tanh(), x, store=store)
    z = tierstore.checkpoint(lambda t: (t @ w).sin(), x.view(512, 512)[:, :], store=store)
    loss = (y * z).sum()
    wait_for(lambda: settled(store))
    loss.backward(retain_graph=True)
    gc.collect()
    assert store.stats().bytes_from_disk > 0  # the view's input was rebuilt from disk
    assert not [o for o in gc.get_objects() if type(o) is Stored and o._held is not None]


def test_eval_and_no_grad_store_nothing(store_factory: StoreFactory) -> None:
    store = store_factory("disk")
    layer = Counting()
    x = torch.randn(4, 32)
    with torch.no_grad():
        y = tierstore.checkpoint(layer, x, store=store)
    assert not y.requires_grad and store.stats().puts == 0
    layer.eval()
    y = tierstore.checkpoint(layer, x, store=store)  # eval mode, grad on: a graph, no backward
    assert store.stats().live_entries == 1
    del y
    assert stats_once_released(store).live_entries == 0


def test_forward_without_backward_and_exceptions_free_everything(
    store_factory: StoreFactory,
) -> None:
    store = store_factory("disk")
    model, ids = model_and_batch()

    def call(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return tierstore.checkpoint(block, x, store=store)

    for _ in range(3):
        loss = model.loss(ids, layer_call=call)
        assert store.stats().live_entries > 0
        del loss
        assert stats_once_released(store).live_entries == 0

    def failing(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if block is model.blocks[1]:
            raise KeyError("boom")
        return call(block, x)

    with pytest.raises(KeyError) as info:
        model.loss(ids, layer_call=failing)
    del info
    assert stats_once_released(store).live_entries == 0


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_retain_graph_second_backward(store_factory: StoreFactory, tier: str) -> None:
    store = store_factory(tier)
    model, ids = model_and_batch(p=0.2)
    torch.manual_seed(4)
    loss = model.loss(ids)
    loss.backward(retain_graph=True)
    loss.backward()
    expected = grads(model)
    model.zero_grad()

    def call(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return tierstore.checkpoint(block, x, store=store)

    torch.manual_seed(4)
    loss = model.loss(ids, layer_call=call)
    loss.backward(retain_graph=True)
    assert store.stats().live_entries > 0
    loss.backward()
    assert_equal_tensors(expected, grads(model))
    del loss
    assert stats_once_released(store).live_entries == 0


def test_one_tensor_given_to_every_layer_is_stored_once(store_factory: StoreFactory) -> None:
    store = store_factory("disk")
    layers = [nn.Linear(64, 64) for _ in range(4)]
    mask = torch.rand(32, 64)  # like an attention mask handed to each layer

    def layer_fn(layer: nn.Module, x: torch.Tensor, *, mask: torch.Tensor) -> torch.Tensor:
        return layer(x) * mask

    x = torch.randn(32, 64, requires_grad=True)
    h = x
    for layer in layers:
        h = tierstore.checkpoint(functools.partial(layer_fn, layer), h, store=store, mask=mask)
    # Four layer inputs plus the mask once (not four times).
    assert store.stats().puts == 5
    h.sum().backward()
    assert x.grad is not None


def test_store_empty_after_each_of_100_steps(store_factory: StoreFactory) -> None:
    store = store_factory("disk")
    model, ids = model_and_batch(batch=2, dim=32, seq=16)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def call(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return tierstore.checkpoint(block, x, store=store)

    for step in range(100):
        opt.zero_grad()
        model.loss(ids, layer_call=call).backward()
        opt.step()
        assert stats_once_released(store).live_entries == 0, step
    assert store.stats().puts == 100 * len(model.blocks)


def test_checkpoints_into_two_stores_are_independent(store_factory: StoreFactory) -> None:
    """Note: [Stores are independent]: nothing found, read or prefetched across stores."""
    a, b = store_factory("disk"), store_factory("disk")
    x = torch.randn(64, 64, requires_grad=True)
    # A view nobody keeps: each recompute must read it back from its own store.
    ya = tierstore.checkpoint(torch.sin, x.view_as(x), store=a)
    yb = tierstore.checkpoint(torch.cos, x.view_as(x), store=b)
    # x is stored in each store, not found in a's table and read from a.
    assert a.stats().puts == 1 and b.stats().puts == 1
    a.close()
    # b's backward neither reads from a nor prefetches a's entries (a is closed).
    yb.sum().backward()
    assert x.grad is not None and torch.equal(x.grad, -torch.sin(x.detach()))
    assert b.stats().gets == 1
    del ya, yb
    assert stats_once_released(b).live_entries == 0


def test_closing_one_store_leaves_backward_through_another_working(
    store_factory: StoreFactory,
) -> None:
    s1, s2 = store_factory("host"), store_factory("host")
    x = torch.randn(1000, requires_grad=True)
    old = tierstore.checkpoint(torch.sin, x, store=s1)
    s1.close()
    tierstore.checkpoint(torch.cos, x, store=s2).sum().backward()
    assert x.grad is not None and torch.equal(x.grad, -torch.sin(x.detach()))
    del old


def test_the_first_layers_recompute_holds_no_other_read_buffer(
    store_factory: StoreFactory,
) -> None:
    """Note: [A finished sweep hands its buffers back]: where a checkpointed step peaks, in
    the recompute of the first layer, the store holds that layer's input and nothing the
    later layers read back, as torch's own checkpoint does; the gradients stay torch's."""
    from tierstore.testing import internals

    torch.manual_seed(0)
    width, rows = 512, 1024  # 2 MiB layer inputs: the raw engine's multi-chunk reads
    layers = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(6))
    x = torch.randn(rows, width)
    store = store_factory("disk", prefetch_bytes=8 << 20, io_chunk_bytes=1 << 20)
    mapped_in_first_layer: list[int] = []
    layers[0].register_forward_pre_hook(
        lambda *_: mapped_in_first_layer.append(internals(store).read_pool.mapped_bytes)
    )

    def run(wrap: Any) -> list[torch.Tensor]:
        for p in layers.parameters():
            p.grad = None
        h = x * 1.0  # as an embedding's output: only the checkpoint keeps it
        for layer in layers:
            h = wrap(layer, h)
        # Every input on disk before backward, so that each comes back from there (on a loaded
        # machine the last one's write can still be in flight when backward asks for it).
        wait_for(lambda: settled(store))
        h.square().sum().backward()
        return [p.grad.clone() for p in layers.parameters() if p.grad is not None]

    expected = run(functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False))
    for _ in range(2):  # the second step reads into the first step's buffers
        mapped_in_first_layer.clear()
        assert_equal_tensors(expected, run(functools.partial(tierstore.checkpoint, store=store)))
        recompute = mapped_in_first_layer[-1]
        assert recompute <= x.nbytes + (1 << 20) + 4096, recompute
    assert stats_once_released(store).bytes_from_disk == 2 * 6 * x.nbytes


@pytest.mark.parametrize("steps", [1, 2])
def test_inputs_alive_at_backward_are_not_read_back(
    store_factory: StoreFactory, steps: int
) -> None:
    """Note: [Held back]: the recompute takes a live input (a mask handed to every layer, an
    input the caller keeps) as the object itself, yet the store's walk read each one back
    from disk, and the copies sat in the prefetch window and the read pool unread until the
    end of backward. Only the inputs that died come back from disk now, in a first backward
    and in a second one of a retained graph; the gradients stay torch's."""
    from tierstore.testing import internals

    torch.manual_seed(0)
    width = 1024  # 4 MiB inputs, over the raw engine's chunk of 1 MiB here
    layers = nn.ModuleList(nn.Linear(width, width) for _ in range(6))
    x0 = torch.randn(width, width, requires_grad=True)  # kept by the caller
    mask = torch.rand(width, width)  # handed to every layer
    store = store_factory("disk", prefetch_bytes=16 << 20, io_chunk_bytes=1 << 20)

    def block(layer: nn.Module, h: torch.Tensor, *, mask: torch.Tensor) -> torch.Tensor:
        return torch.tanh(layer(h) * mask)

    def run(wrap: Any) -> list[torch.Tensor]:
        for p in [*layers.parameters(), x0]:
            p.grad = None
        h = x0
        for layer in layers:
            h = wrap(functools.partial(block, layer), h, mask=mask)
        wait_for(lambda: settled(store))
        loss = h.sum()
        for step in range(steps):
            loss.backward(retain_graph=step + 1 < steps)
        return [t.grad.clone() for t in [*layers.parameters(), x0] if t.grad is not None]

    expected = run(functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False))
    assert_equal_tensors(expected, run(functools.partial(tierstore.checkpoint, store=store)))
    stats = store.stats()
    assert stats.puts == 7  # x0, the mask, five layer outputs
    assert stats.bytes_from_disk == steps * 5 * x0.nbytes, stats  # the five dead ones only
    assert internals(store).window_bytes == 0


def test_an_object_that_is_not_a_store_is_refused_at_once(tmp_path: Path) -> None:
    """A model, a path or an AsyncTieredStore passed as the store failed only at the first
    forward (``'Linear' object has no attribute 'put'``, a coroutine never awaited, or a
    weak-reference error)."""
    layer = torch.nn.Linear(8, 8)
    x = torch.randn(2, 8, requires_grad=True)
    with pytest.raises(TypeError, match=r"expected a tierstore\.TieredStore"):
        tierstore.offload_activations(layer)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"expected a tierstore\.TieredStore"):
        tierstore.checkpoint(layer, x, store=str(tmp_path))  # type: ignore[arg-type]
    astore = tierstore.AsyncTieredStore(disk_dir=tmp_path)
    with pytest.raises(TypeError, match="synchronously: pass a TieredStore"):
        tierstore.offload_activations(astore)  # type: ignore[arg-type]


# Forward AD's first use loads decompositions that torch itself scripts with torch.jit.
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_a_checkpoint_under_torch_func_jvp_matches_torchs(store_factory: StoreFactory) -> None:
    """Inside jvp the inputs are functorch wrappers of type Tensor with no storage: storing
    one raised NotImplementedError. They stay in memory, as torch's checkpoint keeps them."""
    from torch.func import jvp
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    store = store_factory("disk")
    torch.manual_seed(0)
    w, x, v = (torch.randn(600, 600) for _ in range(3))  # 1.4 MiB: over min_bytes

    def block(a: torch.Tensor) -> torch.Tensor:
        return torch.tanh(a @ w).exp()

    try:
        expected = jvp(lambda a: torch_checkpoint(block, a, use_reentrant=False), (x,), (v,))
    except NotImplementedError as exc:  # torch 2.4: its checkpoint is a Function with no jvp
        pytest.skip(f"torch's own checkpoint does not run under jvp here: {exc}")
    got = jvp(lambda a: tierstore.checkpoint(block, a, store=store), (x,), (v,))
    assert_equal_tensors(list(expected), list(got))
    assert store.stats().skipped.get("unsupported", 0) > 0
    with pytest.raises(tierstore.UnsupportedTensorError, match=r"torch\.func transform"):
        jvp(lambda a: store.put(a) and a, (x,), (v,))


def _scaled(a: torch.Tensor, b: torch.Tensor, x: torch.Tensor, *, scale: float) -> torch.Tensor:
    return (a * x + b * scale).sin()


def _named(p: functools.partial[torch.Tensor]) -> functools.partial[torch.Tensor]:
    """A partial with attributes, which Python does not fold into an outer partial."""
    functools.update_wrapper(p, _scaled)
    return p


@pytest.mark.parametrize(
    "case", ["call-keyword-over-bound", "outer-keyword-over-inner", "nested-positional-order"]
)
def test_partials_bind_their_arguments_as_python_does(
    store_factory: StoreFactory, case: str
) -> None:
    """The recompute binds what the forward bound: a keyword of the call wins over the
    partial's, an outer partial's over an inner one's, and a nested partial's positional
    arguments come first, innermost first. Bound the other way round, the forward and its
    recompute, or both, compute something else, and the gradients are wrong without an error."""
    store = store_factory("disk")
    torch.manual_seed(0)
    a = torch.randn(1 << 16, requires_grad=True)
    b = torch.randn(1 << 16, requires_grad=True)
    x = torch.randn(1 << 16)
    fn: Any
    if case == "call-keyword-over-bound":
        fn, args, kwargs = functools.partial(_scaled, scale=1.0), (a, b, x), {"scale": 2.0}
    elif case == "outer-keyword-over-inner":
        fn = functools.partial(_named(functools.partial(_scaled, scale=1.0)), scale=2.0)
        args, kwargs = (a, b, x), {}
    else:
        fn = functools.partial(_named(functools.partial(_scaled, a)), b)
        args, kwargs = (x,), {"scale": 2.0}
    expected_out = _scaled(a, b, x, scale=2.0)
    expected = torch.autograd.grad(expected_out.sum(), [a, b])
    out = tierstore.checkpoint(fn, *args, store=store, **kwargs)
    assert torch.equal(out, expected_out)
    assert_equal_tensors(list(expected), list(torch.autograd.grad(out.sum(), [a, b])))


def test_a_small_input_kept_in_place_and_written_after_the_forward_raises(
    store_factory: StoreFactory,
) -> None:
    """An input under ``min_bytes`` stays where it is, not stored; written in place after
    the forward, the recompute would train on the new bytes. Torch's checkpoint raises, and
    so must this one."""
    store = store_factory("disk", min_bytes=1 << 20)
    w = torch.randn(8, requires_grad=True)
    x = torch.randn(8)  # 32 bytes
    y = tierstore.checkpoint(lambda t: (t * w).sin(), x, store=store)
    assert store.stats().skipped == {"below_min_bytes": 1}
    x.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_one_tensor_passed_in_places_apart_is_that_tensor_in_the_recompute(
    store_factory: StoreFactory,
) -> None:
    """``f(h, mask, h)``: the second ``h`` is the first one again in the recompute, not the
    argument before it (an off-by-one there handed it ``mask``)."""
    store = store_factory("disk")
    torch.manual_seed(0)
    w = torch.randn(1 << 16, requires_grad=True)
    h0 = torch.randn(1 << 16, requires_grad=True)
    mask = torch.randn(1 << 16)

    def f(q: torch.Tensor, m: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return (q * w + k * m.exp()).sin()

    def run(ck: Any) -> list[torch.Tensor]:
        h = h0 * 1.0
        out = ck(f, h, mask, h)
        del h  # nothing but the store keeps it
        return list(torch.autograd.grad(out.sum(), [w, h0]))

    expected = run(lambda fn, *args: fn(*args))
    got = run(lambda fn, *args: tierstore.checkpoint(fn, *args, store=store))
    assert_equal_tensors(expected, got)
    assert store.stats().puts == 2  # h once, and the mask


def test_inputs_under_the_stores_min_bytes_stay_in_place_and_are_counted(
    store_factory: StoreFactory,
) -> None:
    store = store_factory("host", min_bytes=1 << 20)
    torch.manual_seed(0)
    lin = nn.Linear(16, 16)
    x = torch.randn(4, 16)  # 256 bytes
    lin(x).sum().backward()
    expected = grads(lin)
    lin.zero_grad()
    tierstore.checkpoint(lin, x, store=store).sum().backward()
    assert_equal_tensors(expected, grads(lin))
    stats = store.stats()
    assert stats.puts == 0 and stats.skipped == {"below_min_bytes": 1}
