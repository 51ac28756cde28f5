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
