"""tierstore.checkpoint behaves as torch's non-reentrant checkpoint, its inputs in the store.

The cases follow torch's own checkpoint tests (``TestCheckpoint`` and the non-reentrant tests
of ``test_autograd.py``), with tierstore's checkpoint under test, on the disk tier, with inputs
past 1 MiB that the caller does not keep, so the recompute reads them back from disk (Note:
[Inputs live in the store]). Every gradient is compared with ``torch.equal``.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from _adapters_util import StoreFactory, stats_once_released
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointError
from torch.utils.checkpoint import checkpoint as torch_checkpoint
from torch.utils.checkpoint import checkpoint_sequential as torch_checkpoint_sequential

import tierstore
from tierstore.testing import settled, wait_for

ROWS, WIDTH = 2048, 256  # a float32 input of 2 MiB


def _net(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Dropout(0.2), nn.Linear(WIDTH, WIDTH), nn.Tanh()
    )


def _input(seed: int = 1) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randn(ROWS, WIDTH, requires_grad=True)


def _grads(model: nn.Module, *extra: torch.Tensor) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None] + [
        t.grad.clone() for t in extra if t.grad is not None
    ]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b) > 0
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


@contextlib.contextmanager
def _from_disk(store: tierstore.TieredStore) -> Iterator[None]:
    """Run a backward once the forward's spills have landed, and check it read from disk.

    Backward right after the forward can find a spill still running and take the input from
    memory; waiting makes the recompute's read from disk the path under test.
    """
    wait_for(lambda: settled(store))
    before = store.stats().bytes_from_disk
    yield
    assert store.stats().bytes_from_disk > before, "the recompute read nothing from disk"


class _CountOps(TorchDispatchMode):
    """Counts the aten calls of one kind while active."""

    def __init__(self, op: Any) -> None:
        super().__init__()
        self.op = op
        self.calls = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is self.op:
            self.calls += 1
        return func(*args, **(kwargs or {}))


def test_torch_autograd_grad_through_a_checkpoint(store_factory: StoreFactory) -> None:
    store = store_factory("disk")
    model, x = _net(), _input()
    torch.manual_seed(5)
    expected = torch.autograd.grad(model(x * 2).sum(), [x, *model.parameters()])
    torch.manual_seed(5)
    y = tierstore.checkpoint(model, x * 2, store=store)  # an input nobody keeps
    with _from_disk(store):
        got = torch.autograd.grad(y.sum(), [x, *model.parameters()])
    _same(list(expected), list(got))


def test_backward_with_inputs_through_a_checkpoint(store_factory: StoreFactory) -> None:
    store = store_factory("disk")
    model, x = _net(), _input()
    torch.manual_seed(5)
    model(x * 2).sum().backward(inputs=[x])
    expected = x.grad.clone()
    x.grad = None
    torch.manual_seed(5)
    y = tierstore.checkpoint(model, x * 2, store=store)
    with _from_disk(store):
        y.sum().backward(inputs=[x])
    assert torch.equal(x.grad, expected)
    assert all(p.grad is None for p in model.parameters())


def test_selective_checkpointing_with_context_fn(store_factory: StoreFactory) -> None:
    """context_fn keeps the matmul outputs: the recompute does not run mm again."""
    if not hasattr(torch.utils.checkpoint, "create_selective_checkpoint_contexts"):
        pytest.skip(f"torch {torch.__version__} has no selective checkpointing (2.5 and later)")
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    store = store_factory("disk")
    model, x = _net(), _input()
    torch.manual_seed(5)
    model(x * 2).sum().backward()
    expected = _grads(model, x)
    model.zero_grad()
    x.grad = None

    def keep_mm(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        mm = op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
        return CheckpointPolicy.MUST_SAVE if mm else CheckpointPolicy.PREFER_RECOMPUTE

    runs: dict[str, int] = {}
    for name, context_fn in (
        ("selective", functools.partial(create_selective_checkpoint_contexts, keep_mm)),
        ("full", torch.utils.checkpoint.noop_context_fn),
    ):
        torch.manual_seed(5)
        y = tierstore.checkpoint(model, x * 2, store=store, context_fn=context_fn)
        with _from_disk(store), _CountOps(torch.ops.aten.addmm.default) as count:
            y.sum().backward()
        runs[name] = count.calls
        _same(expected, _grads(model, x))
        model.zero_grad()
        x.grad = None
    assert runs["selective"] == 0 < runs["full"]


def _pushed() -> tuple[object, object]:
    """The saved-tensor hooks and the dispatch mode active on this thread now."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    # torch 2.4 has no getter for the hooks: there only the mode is compared.
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return (top(False) if top is not None else None), _get_current_dispatch_mode()


class _Boom(Exception):
    pass


def _fails(t: torch.Tensor) -> torch.Tensor:
    t.exp()  # something saved before the error, as in a layer that fails halfway
    raise _Boom("halfway")


@pytest.mark.parametrize("context", ["none", "selective"])
def test_an_error_in_the_function_leaves_no_hooks_or_modes_pushed(
    store_factory: StoreFactory, context: str
) -> None:
    # While the error's traceback lives (an except that retries without the checkpoint), the
    # checkpoint's hooks and the context_fn's mode must be gone, as after torch's checkpoint.
    store = store_factory("disk")
    context_fn: Any = torch.utils.checkpoint.noop_context_fn
    if context == "selective":
        if not hasattr(torch.utils.checkpoint, "create_selective_checkpoint_contexts"):
            pytest.skip(f"torch {torch.__version__} has no selective checkpointing")
        from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

        context_fn = functools.partial(
            create_selective_checkpoint_contexts, lambda *a, **k: CheckpointPolicy.MUST_SAVE
        )
    x = _input()
    before = _pushed()
    try:
        tierstore.checkpoint(_fails, x * 2, store=store, context_fn=context_fn)
    except _Boom as err:
        assert err.__traceback__ is not None  # the traceback, with the call's frames, lives
        assert _pushed() == before
        y = (x * 3).exp()  # and training goes on in the except block, bit-exact
        y.sum().backward()
    else:
        raise AssertionError("the error was swallowed")
    assert torch.equal(x.grad, 3 * (x.detach() * 3).exp())  # type: ignore[arg-type]


def test_a_context_fn_that_swallows_the_error_raises(store_factory: StoreFactory) -> None:
    store = store_factory("disk")

    def swallowing() -> tuple[Any, Any]:
        return contextlib.suppress(_Boom), contextlib.nullcontext()

    with pytest.raises(RuntimeError, match="suppressed an exception"):
        tierstore.checkpoint(_fails, _input() * 2, store=store, context_fn=swallowing)
    assert _pushed() == (None, None)


def test_a_recompute_that_differs_from_the_forward_is_detected(
    store_factory: StoreFactory,
) -> None:
    store = store_factory("disk")
    x = _input()
    calls = [0]

    def shifty(t: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        rows = ROWS if calls[0] == 1 else ROWS // 2  # the recompute saves another shape
        return t[:rows].sin().sum() + t.cos().sum()

    y = tierstore.checkpoint(shifty, x * 1, store=store)
    wait_for(lambda: settled(store))
    with pytest.raises(CheckpointError, match="different metadata"):
        y.backward()
    calls[0] = 0
    quiet = tierstore.checkpoint(shifty, x * 1, store=store, determinism_check="none")
    with pytest.raises(RuntimeError):  # unchecked: the backward itself fails on the shapes
        quiet.backward()
    with pytest.raises(ValueError, match="determinism_check='sometimes'"):
        tierstore.checkpoint(shifty, x, store=store, determinism_check="sometimes")


def test_a_parameter_used_inside_and_outside_fires_its_hook_once(
    store_factory: StoreFactory,
) -> None:
    store = store_factory("disk")
    lin = nn.Linear(WIDTH, WIDTH)
    fired: list[torch.Tensor] = []
    lin.weight.register_hook(lambda g: fired.append(g) or None)
    x = _input()
    out = tierstore.checkpoint(lin, x * 1, store=store) + lin(x * 3)
    with _from_disk(store):
        out.sum().backward()
    assert len(fired) == 1  # the reentrant checkpoint fired it twice
    expected = torch.autograd.grad((lin(x * 1) + lin(x * 3)).sum(), lin.weight)[0]
    assert torch.equal(fired[0], expected)


def test_the_recompute_sees_the_input_objects_themselves(store_factory: StoreFactory) -> None:
    store = store_factory("disk")
    seen: list[torch.Tensor] = []

    def remember(t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        seen.append(t)
        return (t * mask).exp()

    x = _input()
    h = x * 1
    h.note = "mine"  # type: ignore[attr-defined]
    mask = torch.ones(ROWS, WIDTH)
    tierstore.checkpoint(remember, h, mask=mask, store=store).sum().backward()
    assert len(seen) == 2 and seen[1] is h and seen[1].note == "mine"  # type: ignore[attr-defined]
    assert torch.equal(x.grad, (x.detach()).exp())


def test_an_input_written_in_place_after_the_forward_raises(store_factory: StoreFactory) -> None:
    store = store_factory("disk")
    x = _input()
    h = x * 1
    y = tierstore.checkpoint(torch.exp, h, store=store)
    with torch.no_grad():
        h.add_(1)
    wait_for(lambda: settled(store))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_an_inference_tensor_input_raises_torchs_own_error(store_factory: StoreFactory) -> None:
    store = store_factory("disk")
    with torch.inference_mode():
        frozen = torch.randn(ROWS, WIDTH)
    w = torch.randn(WIDTH, WIDTH, requires_grad=True)
    for run in (torch_checkpoint, tierstore.checkpoint):
        kwargs: dict[str, Any] = {"store": store} if run is tierstore.checkpoint else {}
        with pytest.raises(RuntimeError, match="Inference tensors cannot be saved"):
            out = run(torch.mm, frozen, w, use_reentrant=False, **kwargs)
            out.sum().backward()


def test_checkpoint_sequential_and_nested_checkpoints(store_factory: StoreFactory) -> None:
    store = store_factory("disk")
    layers = nn.Sequential(*(_net(seed) for seed in range(4)))
    x = _input()
    torch.manual_seed(9)
    layers(x * 1).sum().backward()
    expected = _grads(layers, x)

    layers.zero_grad()
    x.grad = None
    torch.manual_seed(9)
    y = tierstore.checkpoint_sequential(layers, 3, x * 1, store=store)
    with _from_disk(store):
        y.sum().backward()
    _same(expected, _grads(layers, x))
    # torch's own checkpoint_sequential, for the same split, agrees.
    layers.zero_grad()
    x.grad = None
    torch.manual_seed(9)
    torch_checkpoint_sequential(layers, 3, x * 1, use_reentrant=False).sum().backward()
    _same(expected, _grads(layers, x))

    def outer(t: torch.Tensor) -> torch.Tensor:
        t = tierstore.checkpoint(layers[0], t, store=store)
        t = tierstore.checkpoint(layers[1], t, store=store)
        return layers[3](layers[2](t))

    layers.zero_grad()
    x.grad = None
    torch.manual_seed(9)
    y = tierstore.checkpoint(outer, x * 1, store=store)
    with _from_disk(store):
        y.sum().backward()
    _same(expected, _grads(layers, x))
    with pytest.raises(ValueError, match="segments=0"):
        tierstore.checkpoint_sequential(layers, 0, x, store=store)


def test_same_gradients_as_torchs_checkpoint_with_kwargs_and_outputs(
    store_factory: StoreFactory,
) -> None:
    store = store_factory("disk")
    model = _net()

    def block(t: torch.Tensor, *, scale: torch.Tensor, extra: dict[str, Any]) -> Any:
        y = model(t) * scale
        return {"y": y, "mean": y.mean(), "note": extra["note"]}

    results = []
    for run in (torch_checkpoint, functools.partial(tierstore.checkpoint, store=store)):
        x = _input()
        scale = torch.full((ROWS, 1), 0.5, requires_grad=True)
        torch.manual_seed(3)
        kwargs: dict[str, Any] = {"scale": scale, "extra": {"note": "kept"}}
        if run is torch_checkpoint:
            kwargs["use_reentrant"] = False
        out = run(block, x * 1, **kwargs)
        assert out["note"] == "kept"
        with _from_disk(store) if run is not torch_checkpoint else contextlib.nullcontext():
            (out["y"].sum() + out["mean"]).backward()
        results.append(_grads(model, x, scale))
        model.zero_grad()
    _same(*results)
    assert stats_once_released(store).live_entries == 0


def test_use_reentrant_true_is_accepted_and_warns_once(store_factory: StoreFactory) -> None:
    from tierstore.adapters import _checkpoint

    store = store_factory("host")
    _checkpoint._warned_reentrant = False
    x = _input()
    with pytest.warns(UserWarning, match="always non-reentrant"):
        tierstore.checkpoint(torch.sin, x, store=store, use_reentrant=True).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tierstore.checkpoint(torch.sin, x, store=store, use_reentrant=True).sum().backward()


def test_backward_leaves_the_global_rng_where_plain_training_leaves_it(
    store_factory: StoreFactory,
) -> None:
    """The recompute replays the forward's dropout draws from a forked RNG. A failure means the
    backward rewound the global RNG to just after the checkpoint's draws, so the next step's
    dropout (or a shuffle) repeats draws, as neither plain training nor torch's does."""
    store = store_factory("disk")
    drop = nn.Dropout(0.5)

    def inside(t: torch.Tensor) -> torch.Tensor:
        return drop(t).sin()

    def next_draw(run: Any) -> torch.Tensor:
        x = _input()
        torch.manual_seed(0)
        y = drop(run(inside, x * 2))  # dropout after the checkpoint too
        y.sum().backward()
        return torch.rand(4)

    plain = next_draw(lambda fn, t: fn(t))
    torchs = next_draw(lambda fn, t: torch_checkpoint(fn, t, use_reentrant=False))
    ours = next_draw(lambda fn, t: tierstore.checkpoint(fn, t, store=store))
    assert torch.equal(plain, torchs)
    assert torch.equal(plain, ours)


def _sin_then_cos(calls: list[str]) -> Any:
    def fn(t: torch.Tensor) -> torch.Tensor:
        a = t.sin()
        calls.append("sin")
        b = a.cos()  # saves a, the last tensor the backward needs
        calls.append("cos")
        return b

    return fn


def test_torchs_global_early_stop_switch_is_obeyed(store_factory: StoreFactory) -> None:
    """Under ``set_checkpoint_early_stop(False)`` torch's recompute runs the whole function. A
    failure means tierstore's checkpoint ignored the global switch and stopped early."""
    if not hasattr(torch.utils.checkpoint, "set_checkpoint_early_stop"):
        pytest.skip(f"torch {torch.__version__} has no global checkpoint early-stop switch")
    store = store_factory("disk")
    ran: dict[str, list[str]] = {}
    for name, run in (
        ("torch", lambda fn, t: torch_checkpoint(fn, t, use_reentrant=False)),
        ("tierstore", lambda fn, t: tierstore.checkpoint(fn, t, store=store)),
    ):
        calls: list[str] = []
        x = _input()
        with torch.utils.checkpoint.set_checkpoint_early_stop(False):
            y = run(_sin_then_cos(calls), x * 1)
            calls.clear()
            y.sum().backward()
        ran[name] = calls
        assert torch.equal(x.grad, -(x.detach().sin().sin()) * x.detach().cos())  # type: ignore[arg-type]
    assert ran["torch"] == ran["tierstore"] == ["sin", "cos"]


def test_torchs_global_debug_switch_is_obeyed(store_factory: StoreFactory) -> None:
    """Under ``set_checkpoint_debug_enabled(True)`` a recompute that differs from the forward
    raises with the operators each ran. A failure means tierstore's checkpoint ignored the global
    switch: its error has no operator trace where torch's has one."""
    if not hasattr(torch.utils.checkpoint, "set_checkpoint_debug_enabled"):
        pytest.skip(f"torch {torch.__version__} has no global checkpoint debug switch")
    store = store_factory("disk")

    def shifty(t: torch.Tensor) -> torch.Tensor:
        return t.sin() if not recompute else t.double().sin().float()

    messages: dict[str, str] = {}
    for name, run in (
        ("torch", lambda fn, t: torch_checkpoint(fn, t, use_reentrant=False)),
        ("tierstore", lambda fn, t: tierstore.checkpoint(fn, t, store=store)),
    ):
        recompute = False
        with torch.utils.checkpoint.set_checkpoint_debug_enabled(True):
            y = run(shifty, _input() * 1)
        recompute = True
        with pytest.raises(CheckpointError) as err:
            y.sum().backward()
        messages[name] = str(err.value)
    for name, message in messages.items():
        assert "aten.sin" in message, f"{name}: no operator trace in {message!r}"


def test_checkpoint_sequential_leaves_the_last_segment_unchecked(
    store_factory: StoreFactory,
) -> None:
    """As torch's ``checkpoint_sequential``, the last segment runs as it is: its output is
    needed by the backward at once. A failure means it was checkpointed too: one more entry
    stored and its layers run again in the backward."""
    store = store_factory("disk")
    torch.manual_seed(0)
    layers = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(4)))
    last_runs: list[str] = []
    layers[3].register_forward_hook(lambda *_: last_runs.append("ran"))
    x = _input()
    torch_checkpoint_sequential(layers, 2, x * 1, use_reentrant=False).sum().backward()
    expected = _grads(layers, x)
    assert len(last_runs) == 1
    layers.zero_grad()
    x.grad = None
    last_runs.clear()
    y = tierstore.checkpoint_sequential(layers, 2, x * 1, store=store)
    assert store.stats().puts == 1  # the first segment's input only
    y.sum().backward()
    assert len(last_runs) == 1
    _same(expected, _grads(layers, x))


def test_a_recompute_inside_the_same_functions_checkpointed_forward_keeps_it_marked(
    store_factory: StoreFactory,
) -> None:
    """A gradient penalty on an earlier output of ``f``, computed inside ``f``: the recompute
    of the earlier checkpoint of ``f`` runs while ``f`` runs under checkpoint again. A failure
    (KeyError) means that recompute unmarked ``f``, which the running forward had marked."""
    store = store_factory("disk")
    torch.manual_seed(0)
    w = torch.randn(ROWS, WIDTH, requires_grad=True)
    a, b = torch.randn(ROWS, WIDTH), torch.randn(ROWS, WIDTH)
    earlier: list[torch.Tensor] = []
    shifts: list[torch.Tensor] = []

    def f(t: torch.Tensor, penalized: bool) -> torch.Tensor:
        if penalized:
            if earlier:  # the forward; its recompute reuses the shift
                (g,) = torch.autograd.grad(earlier.pop().sum(), w)
                shifts.append(g.detach())
            t = t + shifts[-1]
        return (t * w).sin()

    def grad_of_w(run: Any) -> torch.Tensor:
        earlier.append(run(f, a * 1, False))
        run(f, b * 1, True).sum().backward()
        assert w.grad is not None
        got = w.grad.clone()
        w.grad = None
        return got

    expected = grad_of_w(lambda fn, *args: fn(*args))
    got = grad_of_w(lambda fn, *args: tierstore.checkpoint(fn, *args, store=store))
    assert torch.equal(expected, got)


class _NestedSelfCheckpointing(nn.Module):
    """A layer that checkpoints itself as transformers' GradientCheckpointingLayer does, with
    ``partial(<class forward>, self)``, and may hold another layer of its own class."""

    def __init__(self, store: tierstore.TieredStore, inner: nn.Module | None = None) -> None:
        super().__init__()
        self.store = store
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x).relu()
        return self.inner(h) if self.inner is not None else h

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        forward = functools.partial(_NestedSelfCheckpointing.forward, self)
        return tierstore.checkpoint(forward, x, store=self.store)


def test_a_layer_nested_in_one_of_its_own_class_is_checkpointed_too(
    store_factory: StoreFactory,
) -> None:
    """``partial(Class.forward, layer)`` belongs to the layer, not to the class's function.
    A failure means the inner layer ran directly, taken for the outer one running again."""
    store = store_factory("disk")
    torch.manual_seed(0)
    model = _NestedSelfCheckpointing(store, _NestedSelfCheckpointing(store))
    x = _input()
    inner = model.inner
    assert isinstance(inner, _NestedSelfCheckpointing)
    inner.lin(model.lin(x * 1).relu()).relu().sum().backward()
    expected = _grads(model, x)
    model.zero_grad()
    x.grad = None
    y = model(x * 1)
    assert store.stats().puts == 2  # the outer layer's input and the inner layer's
    with _from_disk(store):
        y.sum().backward()
    _same(expected, _grads(model, x))


def test_checkpointing_a_child_inside_its_parents_forward_runs_the_child_itself(
    store_factory: StoreFactory,
) -> None:
    """``checkpoint(self.layer, x)`` inside a parent's forward runs ``layer`` as called, as
    torch's checkpoint does: its forward hooks and an instance forward (accelerate's hook
    wrapper) included. A failure means the parent's running module call was taken for the
    child's, and the class's forward ran without them."""
    store = store_factory("disk")
    torch.manual_seed(0)
    layer = nn.Linear(WIDTH, WIDTH)
    class_forward = layer.forward
    calls: list[str] = []

    def instance_forward(t: torch.Tensor) -> torch.Tensor:
        calls.append("instance forward")
        return class_forward(t)

    layer.forward = instance_forward  # type: ignore[method-assign]
    layer.register_forward_hook(lambda *_: calls.append("forward hook"))

    class Parent(nn.Module):
        def __init__(self, run: Any) -> None:
            super().__init__()
            self.layer = layer
            self.run = run

        def forward(self, t: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.run(self.layer, t)
            return out

    seen: dict[str, list[str]] = {}
    got: dict[str, list[torch.Tensor]] = {}
    for name, run in (
        ("torch", lambda fn, t: torch_checkpoint(fn, t, use_reentrant=False)),
        ("tierstore", lambda fn, t: tierstore.checkpoint(fn, t, store=store)),
    ):
        calls.clear()
        layer.zero_grad()
        x = _input()
        y = Parent(run)(x * 1)
        assert calls == ["instance forward", "forward hook"], name
        y.sum().backward()
        seen[name] = list(calls)
        got[name] = _grads(layer, x)
    assert seen["tierstore"] == seen["torch"]
    _same(got["torch"], got["tierstore"])
