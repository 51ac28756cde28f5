"""torch.compile: tierstore around compiled code changes no gradient bit and prints nothing.

The model is the one of ``examples/compiled.py`` at its default sizes (its blocks compiled in
place; inputs 1 MiB, hidden activations 4 MiB), so that inductor compiles its kernels once for
this file and for the example's test. Every store has ``host_bytes=0``: what is stored goes
to disk and is read back from it. The reference of each backend is the same compiled model
without tierstore (inductor rounds differently from eager PyTorch; tierstore must not).
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import pytest
import torch
from _adapters_util import skip_unless_compile_traces_without_hooks
from differential import settle
from torch import nn

import tierstore

if TYPE_CHECKING:
    from collections.abc import Callable

    from _adapters_util import StoreFactory

ROOT = Path(__file__).resolve().parents[2]
STEPS = 2

pytestmark = [
    # PyTorch's own, with or without tierstore: inductor imports a deprecated torch.jit API,
    # and Dynamo reads .grad of a block's input, a non-leaf tensor, when it wraps it.
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf"),
]


@pytest.fixture(autouse=True)
def _a_compiler_that_traces_without_hooks() -> None:
    skip_unless_compile_traces_without_hooks()


@functools.cache
def example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("compiled_example", ROOT / "examples/compiled.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # Dynamo looks up the module of the code it traces
    spec.loader.exec_module(module)
    return module


def compiled_blocks(backend: str, wrapped: bool = False) -> nn.ModuleList:
    """The example's blocks, compiled in place or (``wrapped``) as ``torch.compile(block)``."""
    blocks: nn.ModuleList = example().build(128, 2)
    if wrapped:
        return nn.ModuleList(torch.compile(block, backend=backend) for block in blocks)
    for block in blocks:
        block.compile(backend=backend)
    return blocks


def batch(step: int) -> torch.Tensor:
    torch.manual_seed(step)  # the batch and the dropout masks, as the example draws them
    return torch.randn(8, 256, 128)


def graphs() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def train(
    backend: str, mode: str, store: tierstore.TieredStore | None, wrapped: bool = False
) -> tuple[list[torch.Tensor], list[int]]:
    """Every gradient of every step, and how many graphs had been compiled after each step."""
    torch._dynamo.reset()  # its counters go on counting
    start = graphs()
    blocks = compiled_blocks(backend, wrapped)
    forward = example().forward
    grads: list[torch.Tensor] = []
    compiled: list[int] = []
    for step in range(STEPS):
        x = batch(step)
        if mode == "hooks" and store is not None:
            with tierstore.offload_activations(store):
                y = forward(blocks, x)
        else:
            y = forward(blocks, x, store if mode == "checkpoint" else None)
        if store is not None:
            settle(store)  # every write lands: backward reads each tensor back from disk
        y.pow(2).mean().backward()
        grads += [p.grad.clone() for p in blocks.parameters() if p.grad is not None]
        blocks.zero_grad(set_to_none=True)
        compiled.append(graphs() - start)
    return grads, compiled


@functools.cache
def reference(backend: str) -> tuple[list[torch.Tensor], list[int]]:
    return train(backend, "none", None)


def grads_of_steps(
    loss_of: Callable[[torch.Tensor], torch.Tensor], blocks: nn.Module, store: tierstore.TieredStore
) -> list[torch.Tensor]:
    """Every gradient of STEPS steps of ``loss_of``, the store's writes landed before each
    backward."""
    got: list[torch.Tensor] = []
    for step in range(STEPS):
        loss = loss_of(batch(step))
        settle(store)
        loss.backward()
        got += [p.grad.clone() for p in blocks.parameters() if p.grad is not None]
        blocks.zero_grad(set_to_none=True)
    return got


def assert_equal(expected: list[torch.Tensor], got: list[torch.Tensor]) -> None:
    assert len(expected) == len(got) > 0
    for i, (a, b) in enumerate(zip(expected, got, strict=True)):
        assert torch.equal(a, b), f"gradient {i} differs: max |diff| {(a - b).abs().max()}"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["hooks", "checkpoint"])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_tierstore_around_compiled_blocks_changes_no_gradient(
    store_factory: StoreFactory, capfd: pytest.CaptureFixture[str], backend: str, mode: str
) -> None:
    expected, expected_graphs = reference(backend)
    store = store_factory("disk")
    got, got_graphs = train(backend, mode, store)
    assert_equal(expected, got)
    # The store changed no graph: as many as without it, all compiled in the first step.
    assert got_graphs == expected_graphs
    assert got_graphs[0] == got_graphs[-1] > 0
    stats = store.stats()
    # hooks: what the compiled graphs save, 4 MiB activations among it; checkpoint: each
    # block's 1 MiB input. All of it went to disk.
    least = STEPS * 2 * (4 << 20 if mode == "hooks" else 1 << 20)
    assert stats.bytes_to_disk >= least
    assert stats.skipped.get("unsupported", 0) == 0
    # No "Exception ignored in ...__del__" and nothing else on stderr (warnings fail the
    # test by the suite's filterwarnings).
    assert capfd.readouterr().err == ""


@pytest.mark.slow
def test_offload_around_torch_compile_of_modules_says_nothing(
    store_factory: StoreFactory, capfd: pytest.CaptureFixture[str]
) -> None:
    """``torch.compile(block)`` warned at every call while a block was open, when
    ``offload_activations`` installed a global module hook (Note: [Buffers are found on the
    stack]); with in-place ``compile()`` that hook made every step recompile every block."""
    expected, expected_graphs = reference("aot_eager")
    store = store_factory("disk")
    got, got_graphs = train("aot_eager", "hooks", store, wrapped=True)
    assert_equal(expected, got)
    assert got_graphs == expected_graphs
    assert store.stats().bytes_to_disk >= STEPS * 2 * (4 << 20)
    assert capfd.readouterr().err == ""


@pytest.mark.slow
def test_offload_block_inside_a_compiled_function(
    store_factory: StoreFactory, capfd: pytest.CaptureFixture[str]
) -> None:
    """The ``with`` inside the compiled function: Dynamo runs that function eagerly.

    Dynamo cannot trace saved-tensor hooks being installed, so it falls back to eager for the
    function holding the block and compiles the blocks it calls, each on its own. Before the
    hooks were excluded from tracing (Note: [Hooks run eagerly under torch.compile]), Dynamo
    traced them there: a warning on ``_thread.get_ident``, "Exception ignored in
    StorageWeakRef.__del__", then a ``TensorModifiedError`` in backward.
    """
    expected, _ = reference("aot_eager")
    store = store_factory("disk")
    torch._dynamo.reset()
    blocks = compiled_blocks("aot_eager")
    forward = example().forward

    @torch.compile(backend="aot_eager")
    def loss_of(x: torch.Tensor) -> torch.Tensor:
        with tierstore.offload_activations(store):
            return forward(blocks, x).pow(2).mean()

    assert_equal(expected, grads_of_steps(loss_of, blocks, store))
    assert store.stats().bytes_to_disk >= STEPS * 2 * (4 << 20)
    assert capfd.readouterr().err == ""


@pytest.mark.slow
def test_checkpoint_inside_a_compiled_function(store_factory: StoreFactory) -> None:
    """What Hugging Face models do with gradient checkpointing on and the model compiled."""
    store = store_factory("disk")
    runs: list[list[torch.Tensor]] = []
    for with_store in (False, True):
        torch._dynamo.reset()
        blocks = example().build(128, 2)
        forward = example().forward

        @torch.compile(backend="aot_eager")
        def loss_of(x: torch.Tensor) -> torch.Tensor:
            return forward(blocks, x, store if with_store else None).pow(2).mean()  # noqa: B023

        runs.append(grads_of_steps(loss_of, blocks, store))
    assert_equal(runs[0], runs[1])
    assert store.stats().bytes_to_disk >= STEPS * 2 * (1 << 20)
