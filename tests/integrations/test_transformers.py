"""tierstore.integrations.transformers on a tiny random Llama: identical gradients, Trainer."""

from __future__ import annotations

import gc
import inspect
import logging
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import tierstore
from optional_modules import importorskip_transformers

transformers = importorskip_transformers()

from tierstore.integrations.transformers import enable_offloaded_checkpointing  # noqa: E402

# Newer transformers (5.24 has them, 5.17 not) call gradient checkpointing "activation
# checkpointing": a TrainingArguments field, model methods and a property. The tests speak both.
HAS_ACTIVATION_NAMES = hasattr(transformers.PreTrainedModel, "activation_checkpointing_enable")


def checkpointing_on(model: torch.nn.Module) -> bool:
    name = "is_activation_checkpointing" if HAS_ACTIVATION_NAMES else "is_gradient_checkpointing"
    return bool(getattr(model, name))


def turn_checkpointing_off(model: torch.nn.Module) -> None:
    name = "activation" if HAS_ACTIVATION_NAMES else "gradient"
    getattr(model, f"{name}_checkpointing_disable")()


def tiny_llama(seed: int = 0, dropout: float = 0.1, layers: int = 2) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attention_dropout=dropout,
        use_cache=False,
    )
    model = transformers.LlamaForCausalLM(config)
    model.train()
    return model


@pytest.fixture
def store(tmp_path: Path) -> Iterator[tierstore.TieredStore]:
    with tierstore.TieredStore(
        device_bytes=0, host_bytes=0, min_bytes=0, disk_dir=str(tmp_path)
    ) as s:
        yield s


def step_grads(
    model: torch.nn.Module, ids: torch.Tensor, store: object = None
) -> list[torch.Tensor]:
    model.zero_grad()
    torch.manual_seed(11)
    loss = model(input_ids=ids, labels=ids).loss
    if isinstance(store, tierstore.TieredStore):
        deadline = time.monotonic() + 10
        while store.stats().inflight_bytes and time.monotonic() < deadline:
            time.sleep(0.005)
    loss.backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_gradients_identical_to_no_checkpointing(store: tierstore.TieredStore) -> None:
    model = tiny_llama(dropout=0.2)
    ids = torch.randint(0, 128, (2, 24))
    expected = step_grads(model, ids)
    enable_offloaded_checkpointing(model, store)
    assert checkpointing_on(model)
    got = step_grads(model, ids, store)
    assert len(got) == len(expected) > 0
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a, b)
    stats = store.stats()
    assert stats.puts > 0 and stats.bytes_to_disk > 0 and stats.bytes_from_disk > 0
    # Each layer's hidden states go in; the mask and rotary tables shared by both layers once.
    assert stats.puts < 2 * 4
    turn_checkpointing_off(model)
    assert not checkpointing_on(model)


def test_every_n_layers_stands_when_the_trainer_turns_checkpointing_on(
    store: tierstore.TieredStore,
) -> None:
    model = tiny_llama(dropout=0.2, layers=4)
    ids = torch.randint(0, 128, (2, 24))
    expected = step_grads(model, ids)
    setter = model._set_gradient_checkpointing
    if "every_n_layers" not in inspect.signature(setter).parameters:
        with pytest.raises(ValueError, match="every_n_layers=2"):
            enable_offloaded_checkpointing(model, store, every_n_layers=2)
        return

    def checkpointed() -> list[bool]:
        return [bool(layer.gradient_checkpointing) for layer in model.model.layers]

    enable_offloaded_checkpointing(model, store, every_n_layers=2)
    assert checkpointed() == [True, False, True, False]
    # What the Trainer calls when its own switch is on: no layer count of its own.
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert checkpointed() == [True, False, True, False]
    if HAS_ACTIVATION_NAMES:
        model.activation_checkpointing_enable()
        assert checkpointed() == [True, False, True, False]
    got = step_grads(model, ids, store)
    assert len(got) == len(expected) > 0
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a, b)
    assert store.stats().puts > 0
    # The Trainer of transformers 5.24 passes 1 when its kwargs name no count: that is no
    # choice, and the count chosen at install stands. Another count wins.
    if HAS_ACTIVATION_NAMES:
        model.activation_checkpointing_enable(None, every_n_layers=1, offload=False)
        assert checkpointed() == [True, False, True, False]
    model.gradient_checkpointing_enable(every_n_layers=4)
    assert checkpointed() == [True, False, False, False]
    enable_offloaded_checkpointing(model, store, every_n_layers=1)
    assert checkpointed() == [True] * 4
    turn_checkpointing_off(model)


def test_every_n_layers_stands_under_a_real_trainers_switch(
    store: tierstore.TieredStore, tmp_path: Path
) -> None:
    model = tiny_llama(layers=4)
    if "every_n_layers" not in inspect.signature(model._set_gradient_checkpointing).parameters:
        pytest.skip(f"transformers {transformers.__version__} checkpoints every layer or none")
    enable_offloaded_checkpointing(model, store, every_n_layers=2)
    rows = [torch.randint(0, 128, (16,)) for _ in range(2)]
    name = "activation_checkpointing" if HAS_ACTIVATION_NAMES else "gradient_checkpointing"
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=2,
        max_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        **{name: True},  # type: ignore[arg-type]
    )
    dataset = [{"input_ids": r, "labels": r} for r in rows]
    transformers.Trainer(model=model, args=args, train_dataset=dataset).train()
    assert [bool(layer.gradient_checkpointing) for layer in model.model.layers] == [
        True, False, True, False,
    ]  # fmt: skip
    assert store.stats().puts > 0


def test_the_trainers_checkpointing_kwargs_reach_tierstores_checkpoint(
    store: tierstore.TieredStore,
) -> None:
    """The Trainer passes its ``gradient_checkpointing_kwargs`` to the model's enable: they
    must reach every call of :func:`tierstore.checkpoint`. Dropped, ``use_reentrant``,
    ``preserve_rng_state`` or a selective-checkpointing ``context_fn`` were ignored silently."""
    import contextlib

    model = tiny_llama()
    ids = torch.randint(0, 128, (2, 24))
    enable_offloaded_checkpointing(model, store)
    contexts: list[int] = []

    def counting_context_fn() -> tuple[Any, Any]:
        contexts.append(1)
        return contextlib.nullcontext(), contextlib.nullcontext()

    kwargs = {"preserve_rng_state": False, "context_fn": counting_context_fn}
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    for layer in model.model.layers:
        func = layer._gradient_checkpointing_func
        assert func.func is tierstore.checkpoint
        assert func.keywords == {"store": store, **kwargs}
    step_grads(model, ids, store)
    assert len(contexts) == len(model.model.layers)  # one checkpointed forward per layer
    assert store.stats().puts > 0
    if HAS_ACTIVATION_NAMES:  # the new name takes them positionally, as the Trainer passes
        model.activation_checkpointing_enable({"determinism_check": "none"})
        func = model.model.layers[0]._gradient_checkpointing_func
        assert func.keywords == {"store": store, "determinism_check": "none"}
    turn_checkpointing_off(model)


def test_a_deep_copy_checkpoints_into_the_same_store_and_switches_itself(
    store: tierstore.TieredStore,
) -> None:
    import copy

    model = tiny_llama()
    ids = torch.randint(0, 128, (2, 24))
    expected = step_grads(model, ids)
    enable_offloaded_checkpointing(model, store)
    twin = copy.deepcopy(model)  # raised on the store's lock
    assert twin.model.layers[0]._gradient_checkpointing_func.keywords["store"] is store
    # A Trainer on the copy switches it on again with the copy's own method, which must
    # install the store the original was enabled with: a copied method that lost it put
    # the default store on every layer, and this store received nothing.
    name = "activation" if HAS_ACTIVATION_NAMES else "gradient"
    getattr(twin, f"{name}_checkpointing_enable")()
    for layer in twin.model.layers:
        assert layer._gradient_checkpointing_func.func is tierstore.checkpoint
        assert layer._gradient_checkpointing_func.keywords["store"] is store
    puts = store.stats().puts
    got = step_grads(twin, ids, store)
    assert store.stats().puts > puts
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a, b)
    turn_checkpointing_off(twin)  # the copy's own method: the original stays on
    assert not checkpointing_on(twin) and checkpointing_on(model)
    assert "gradient_checkpointing_enable" in vars(model)
    with pytest.raises(TypeError, match="TieredStore cannot be pickled"):
        import pickle

        pickle.dumps(store)


def test_rejects_models_without_checkpointing_support() -> None:
    with pytest.raises(ValueError, match="does not support gradient checkpointing"):
        enable_offloaded_checkpointing(torch.nn.Linear(2, 2))


def trainer_run(
    tmp_path: Path, store: tierstore.TieredStore | None
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    model = tiny_llama(seed=1, dropout=0.1)
    initial = [p.detach().clone() for p in model.parameters()]
    if store is not None:
        enable_offloaded_checkpointing(model, store)
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, 128, (16,), generator=g) for _ in range(8)]
    dataset = [{"input_ids": r, "labels": r} for r in rows]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / ("offload" if store else "plain")),
        per_device_train_batch_size=2,
        max_steps=3,
        learning_rate=1e-3,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        use_cpu=True,
        seed=7,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset)
    trainer.train()
    return initial, [p.detach().clone() for p in model.parameters()]


def test_trainer_steps_give_identical_weights(tmp_path: Path) -> None:
    initial, expected = trainer_run(tmp_path, None)
    assert not all(torch.equal(a, b) for a, b in zip(initial, expected, strict=True))
    with tierstore.TieredStore(
        device_bytes=0, host_bytes=0, min_bytes=0, disk_dir=str(tmp_path)
    ) as store:
        _, got = trainer_run(tmp_path, store)
        # The last step's writes may still be in flight; their bytes count when they end.
        deadline = time.monotonic() + 30
        while store.stats().inflight_bytes and time.monotonic() < deadline:
            time.sleep(0.001)
        stats = store.stats()
    assert stats.puts > 0 and stats.gets > 0 and stats.bytes_to_disk > 0
    assert stats.live_entries == 0
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a, b)


def test_tierstore_imports_without_transformers() -> None:
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "import tierstore, tierstore.integrations.transformers as t\n"
        "assert callable(t.enable_offloaded_checkpointing)\n"
        "assert 'transformers' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
    )
    src = Path(__file__).resolve().parents[2] / "src"
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env={"PYTHONPATH": str(src), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr


# -- the Trainer's own checkpointing switch, and the callback (2 MiB layer inputs, on disk) --


def _llama_2mib(seed: int = 3) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        attention_dropout=0.1,
        use_cache=False,
    )
    model = transformers.LlamaForCausalLM(config)
    model.train()
    return model


def _trainer(model: torch.nn.Module, out: Path, **extra: object) -> Any:
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, 128, (1024,), generator=g) for _ in range(4)]
    args = transformers.TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=2,  # layer inputs: 2 x 1024 x 256 x 4 bytes = 2 MiB
        max_steps=2,
        learning_rate=1e-3,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        use_cpu=True,
        seed=7,
        dataloader_num_workers=0,
        disable_tqdm=True,
        **extra,  # type: ignore[arg-type]
    )
    return transformers.Trainer(
        model=model, args=args, train_dataset=[{"input_ids": r, "labels": r} for r in rows]
    )


@pytest.mark.parametrize(
    "switch",
    [
        pytest.param(
            {"activation_checkpointing": True},
            id="activation_checkpointing",
            marks=pytest.mark.skipif(
                not HAS_ACTIVATION_NAMES,
                reason=f"transformers {transformers.__version__} has no activation_checkpointing",
            ),
        ),
        pytest.param({"gradient_checkpointing": True}, id="gradient_checkpointing"),
    ],
)
def test_the_trainers_own_checkpointing_switch_installs_tierstores(
    tmp_path: Path, switch: dict[str, object]
) -> None:
    """Note: [The Trainer's own switch]: it used to install torch's checkpoint (puts 0)."""
    plain = _llama_2mib()
    _trainer(plain, tmp_path / "plain").train()
    model = _llama_2mib()
    with tierstore.TieredStore(
        device_bytes=0, host_bytes=0, min_bytes=0, disk_dir=str(tmp_path)
    ) as store:
        enable_offloaded_checkpointing(model, store)
        kwargs = {**switch, "gradient_checkpointing_kwargs": {"use_reentrant": False}}
        _trainer(model, tmp_path / "offload", **kwargs).train()
        stats = store.stats()
    assert stats.puts > 0 and stats.bytes_to_disk > 2 * 2**20 and stats.bytes_from_disk > 0
    for a, b in zip(plain.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)
    turn_checkpointing_off(model)
    assert not checkpointing_on(model)
    # The instance is itself again.
    replaced = {"activation_checkpointing_enable", "gradient_checkpointing_enable"}
    assert not replaced & set(vars(model))


def test_the_callback_puts_the_stores_figures_into_the_logs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from tierstore.integrations.transformers import TierStoreCallback, attach_callback

    seen: list[dict[str, float]] = []

    class Recorder(transformers.TrainerCallback):  # type: ignore[misc]
        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            if logs and "loss" in logs:
                seen.append(dict(logs))

    model = _llama_2mib()
    with tierstore.TieredStore(
        device_bytes=0, host_bytes=0, min_bytes=0, disk_dir=str(tmp_path)
    ) as store:
        enable_offloaded_checkpointing(model, store)
        trainer = _trainer(model, tmp_path / "out")
        trainer.add_callback(Recorder())
        callback = attach_callback(trainer, store)
        assert isinstance(callback, TierStoreCallback)
        assert isinstance(callback, transformers.TrainerCallback)
        with caplog.at_level(logging.INFO, logger="tierstore"):
            trainer.train()
    history = [h for h in trainer.state.log_history if "loss" in h]
    assert len(history) == len(seen) == 2
    # One line per optimizer step on the tierstore logger, numbered by the Trainer's step.
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("tierstore: step")]
    assert [ln.split()[2] for ln in lines] == ["1", "2"], lines
    for ln in lines:
        assert " offloaded " in ln and "(host 0.0, disk " in ln and "peak off-device " in ln
        assert "backward waited " in ln and ln.endswith("skipped nothing"), ln
    for logs in (*history, *seen):
        assert logs["tierstore/peak_off_device_gib"] > 0
        assert logs["tierstore/offloaded_gib"] > 0 and logs["tierstore/disk_gib"] > 0
        assert logs["tierstore/host_gib"] == 0 and logs["tierstore/backward_wait_s"] >= 0
        assert logs["tierstore/read_errors"] == logs["tierstore/write_errors"] == 0


def test_the_callbacks_figures_are_per_step_since_the_last_training_log() -> None:
    """The callback driven by hand as the Trainer drives it: a run resumed at global step 10,
    logging every 2 steps, an evaluation log between, the store used before training began.
    Each figure is per optimizer step since the last training log, the peak the highest of
    those steps'. Wrong figures here meant: steps counted from 0 rather than from the last log
    (a resumed run's figures divided by its global step), the bytes stored before
    ``on_train_begin`` counted in the first log, a peak kept from an earlier log or taken
    from the last step only, or an evaluation's log (no ``"loss"``) taking the figures and
    leaving the next training log with nothing."""
    import types

    from tierstore.integrations.transformers import TierStoreCallback

    mib = 1 << 20

    def optimizer_step(store: tierstore.TieredStore, size_mib: int) -> None:
        x = torch.randn(size_mib * mib // 4, requires_grad=True)
        with tierstore.offload_activations(store):
            y = x.sin().sum()  # saves x: size_mib MiB handed to the store
        y.backward()

    def in_mib(logs: dict[str, float]) -> dict[str, float]:
        return {k.split("/")[1]: v * 1024 for k, v in logs.items() if k.endswith("_gib")}

    with tierstore.TieredStore(host_bytes="64MiB", min_bytes=0) as store:
        optimizer_step(store, 8)  # before training: an earlier run, an evaluation
        store.end_step()
        callback = TierStoreCallback(store)
        state = types.SimpleNamespace(global_step=10, log_history=[])
        callback.on_train_begin(None, state, None)
        logged: list[dict[str, float]] = []
        for step, size in zip(range(11, 15), (4, 2, 2, 2), strict=True):
            optimizer_step(store, size)
            state.global_step = step
            callback.on_step_end(None, state, None)
            if step == 13:  # an evaluation's log: no figures, and it takes none
                evaluation = {"eval_loss": 1.0}
                callback.on_log(None, state, None, logs=evaluation)
                assert evaluation == {"eval_loss": 1.0}
            if step % 2 == 0:
                logs = {"loss": 1.0}
                state.log_history.append({"loss": 1.0, "step": step})
                callback.on_log(None, state, None, logs=logs)
                assert state.log_history[-1] == {**logs, "step": step}
                logged.append(logs)
    # Steps 11-12 stored 4 and 2 MiB, steps 13-14 2 and 2: per step 3 then 2, peaks 4 then 2.
    assert [in_mib(logs) for logs in logged] == [
        {"offloaded_gib": 3.0, "host_gib": 3.0, "disk_gib": 0.0, "peak_off_device_gib": 4.0},
        {"offloaded_gib": 2.0, "host_gib": 2.0, "disk_gib": 0.0, "peak_off_device_gib": 2.0},
    ]
    for logs in logged:
        assert logs["tierstore/skipped_mib"] == 0 and logs["tierstore/backward_wait_s"] >= 0
        assert logs["tierstore/read_errors"] == logs["tierstore/write_errors"] == 0


def test_offloading_context_is_the_one_line_swap_for_trl_and_torchtune(tmp_path: Path) -> None:
    from tierstore.integrations.transformers import offloading_context

    ids = torch.randint(0, 128, (2, 1024), generator=torch.Generator().manual_seed(1))
    plain = _llama_2mib()
    torch.manual_seed(4)
    plain(input_ids=ids, labels=ids).loss.backward()
    put: dict[bool, int] = {}
    for keep in (True, False):
        model = _llama_2mib()
        with tierstore.TieredStore(
            device_bytes=0, host_bytes=0, min_bytes=0, disk_dir=str(tmp_path)
        ) as store:
            torch.manual_seed(4)
            with offloading_context(model, store, min_bytes=1024, keep_output_head=keep):
                loss = model(input_ids=ids, labels=ids).loss
            put[keep] = store.stats().bytes_put
            loss.backward()
            assert store.stats().bytes_from_disk > 2 * 2**20
        for a, b in zip(plain.parameters(), model.parameters(), strict=True):
            assert torch.equal(a.grad, b.grad)
        assert not model.lm_head._forward_pre_hooks and not model.lm_head._forward_hooks
    # The head's saved input (the final hidden states, 2 MiB) stays in place when kept.
    assert put[False] - put[True] >= 2 * 1024 * 256 * 4


@pytest.mark.filterwarnings("ignore:tierstore. offloading is on:RuntimeWarning")  # A's block
def test_one_offloading_context_entered_nested_and_by_two_threads_leaves_no_hook(
    tmp_path: Path,
) -> None:
    """Each enter registered the head's hooks over the last ones' handles: a nested or a
    second thread's enter leaked a pair, which kept switching ``no_offload`` on around the
    head in every later call."""
    from tierstore.integrations.transformers import offloading_context

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 256)
    )
    head = model[2]
    x = torch.randn(256, 256, requires_grad=True)  # 256 KiB activations

    with tierstore.TieredStore(
        device_bytes=0, host_bytes=0, min_bytes=0, disk_dir=str(tmp_path)
    ) as store:
        ctx = offloading_context(model, store, min_bytes=1024)

        def put_by_forward() -> int:
            before = store.stats().bytes_put
            model(x).sum()
            return store.stats().bytes_put - before

        with ctx:
            once = put_by_forward()
        with ctx:
            with ctx:
                assert put_by_forward() == once
            assert put_by_forward() == once  # the head still kept after the inner exit
        assert not head._forward_pre_hooks and not head._forward_hooks

        # Two threads: A enters, B enters, A exits, B runs its forward and exits.
        entered_a, entered_b, exited_a = threading.Event(), threading.Event(), threading.Event()
        got: dict[str, int] = {}

        def a() -> None:
            with ctx:
                entered_a.set()
                entered_b.wait(10)
            exited_a.set()

        def b() -> None:
            entered_a.wait(10)
            with ctx:
                entered_b.set()
                exited_a.wait(10)
                got["b"] = put_by_forward()

        threads = [threading.Thread(target=a), threading.Thread(target=b)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert got["b"] == once
        assert not head._forward_pre_hooks and not head._forward_hooks
        # Outside every block, the head is an ordinary module: nothing is stored.
        before = store.stats().bytes_put
        model(x).sum()
        assert store.stats().bytes_put == before


@pytest.mark.filterwarnings("ignore:tierstore. offloading is on:RuntimeWarning")  # A's block
def test_a_thread_in_another_offloading_block_offloads_the_head_it_calls(
    tmp_path: Path,
) -> None:
    """The head's hooks stay on the module while any thread is inside the context, and they
    act only in the threads inside it: a thread in a plain ``offload_activations`` block
    calling the same head must offload its activations, not keep them in place."""
    from tierstore.integrations.transformers import offloading_context

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
    head = model[1]
    x = torch.randn(256, 256, requires_grad=True)  # 256 KiB activations
    with tierstore.TieredStore(
        device_bytes=0, host_bytes=0, min_bytes=0, disk_dir=str(tmp_path)
    ) as store:
        ctx = offloading_context(model, store, min_bytes=1024)
        entered, done = threading.Event(), threading.Event()
        put: dict[str, int] = {}

        def inside_the_context() -> None:
            with ctx:
                entered.set()
                done.wait(30)

        def in_another_block() -> None:
            entered.wait(30)
            with tierstore.offload_activations(store, min_bytes=1024):
                before = store.stats().bytes_put
                head(x).sum()  # saves x: 256 KiB, handed to the store
                put["head"] = store.stats().bytes_put - before
            done.set()

        threads = [
            threading.Thread(target=inside_the_context),
            threading.Thread(target=in_another_block),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert put["head"] == x.numel() * x.element_size()
        assert not head._forward_pre_hooks and not head._forward_hooks


def test_a_head_that_raises_inside_the_block_leaves_later_saves_offloaded(
    tmp_path: Path,
) -> None:
    """A head whose forward raises, caught inside the same ``offloading_context`` block (a bad
    batch skipped): the ``no_offload`` opened around the head must close with it. Left open
    until the block's exit, it kept every later saved tensor of the block in place."""
    from tierstore.integrations.transformers import offloading_context

    class FailingOnceHead(torch.nn.Linear):
        fail = True

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.fail:
                self.fail = False
                raise ValueError("bad batch")
            return super().forward(x)

    torch.manual_seed(0)
    head = FailingOnceHead(256, 256)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), head)
    x = torch.randn(256, 256, requires_grad=True)  # 256 KiB
    with tierstore.TieredStore(
        device_bytes=0, host_bytes=0, min_bytes=0, disk_dir=str(tmp_path)
    ) as store:
        with offloading_context(model, store, min_bytes=1024):
            with pytest.raises(ValueError, match="bad batch"):
                model(x)
            before = store.stats().bytes_put
            y = x.sin().sum()  # saves x: 256 KiB, after the failed head
            assert store.stats().bytes_put - before == x.numel() * x.element_size()
            before = store.stats().bytes_put
            z = torch.randn(256, 256, requires_grad=True)
            loss = model(z).sum()  # the head's own input still stays in place
            put = store.stats().bytes_put - before
        assert put == z.numel() * z.element_size()  # the first layer's input only
        assert not head._forward_pre_hooks and not head._forward_hooks
        (y + loss).backward()
    assert x.grad is not None and z.grad is not None


def test_a_model_wrapped_by_peft_before_enabling_keeps_tierstores_checkpoint(
    store: tierstore.TieredStore,
) -> None:
    """Note: [A wrapped model]: enabled on a ``PeftModel``, the guards passed (it forwards
    them to the model it wraps) but no method was replaced on its class, so the Trainer's
    ``activation_checkpointing_enable`` put torch's checkpoint back on every layer and the
    store received nothing, silently. The replacements now go on the wrapped model."""
    peft = pytest.importorskip("peft")
    model = tiny_llama(dropout=0.2)
    ids = torch.randint(0, 128, (2, 24))
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    wrapped = peft.get_peft_model(model, lora)
    expected = step_grads(wrapped, ids)
    enable_offloaded_checkpointing(wrapped, store)
    # What the Trainer calls when its own switch is on.
    name = "activation" if HAS_ACTIVATION_NAMES else "gradient"
    getattr(wrapped, f"{name}_checkpointing_enable")()
    assert checkpointing_on(model)
    got = step_grads(wrapped, ids, store)
    assert len(got) == len(expected) > 0
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a, b)
    assert store.stats().puts > 0 and store.stats().bytes_from_disk > 0
    getattr(wrapped, f"{name}_checkpointing_disable")()
    assert not checkpointing_on(model)


@pytest.mark.parametrize("bad", [0, -1, None, "2", True, 1.5])
def test_every_n_layers_must_be_a_positive_integer(
    store: tierstore.TieredStore, bad: object
) -> None:
    """0 raised ZeroDivisionError from inside transformers with the first layer switched on
    and the others not; -1 checkpointed every layer; None and "2" a bare TypeError."""
    model = tiny_llama(layers=4)
    with pytest.raises(ValueError, match=f"every_n_layers={bad!r}"):
        enable_offloaded_checkpointing(model, store, every_n_layers=bad)  # type: ignore[arg-type]
    assert not checkpointing_on(model)
    assert not any(layer.gradient_checkpointing for layer in model.model.layers)
    enable_offloaded_checkpointing(model, store)
    if HAS_ACTIVATION_NAMES and bad is not None:
        with pytest.raises(ValueError, match="every_n_layers"):
            model.activation_checkpointing_enable(every_n_layers=bad)
    turn_checkpointing_off(model)


def test_the_replaced_methods_take_what_transformers_methods_take(
    store: tierstore.TieredStore,
) -> None:
    """A misspelt keyword raises TypeError, as without tierstore (it was swallowed), and the
    signature shown is the method's own, not the keywords bound inside."""
    model = tiny_llama()
    enable_offloaded_checkpointing(model, store)
    name = "activation" if HAS_ACTIVATION_NAMES else "gradient"
    enable = getattr(model, f"{name}_checkpointing_enable")
    # Named as the method called: the message named tierstore's private function behind it.
    with pytest.raises(TypeError, match=rf"{name}_checkpointing_enable\(\).*every_n_layer"):
        enable(every_n_layer=2)
    with pytest.raises(TypeError, match=rf"{name}_checkpointing_disable\(\)"):
        getattr(model, f"{name}_checkpointing_disable")(True)
    if HAS_ACTIVATION_NAMES:  # the old name forwards its keywords to the new one
        with pytest.raises(TypeError, match=r"activation_checkpointing_enable\(\).*'foo'"):
            model.gradient_checkpointing_enable(foo=1)
    shown = inspect.signature(enable).parameters
    original = inspect.signature(getattr(type(model), f"{name}_checkpointing_enable"))
    assert list(shown) == list(original.parameters)[1:]
    assert "store" not in shown and "chosen" not in shown
    turn_checkpointing_off(model)


def test_del_model_frees_it_at_once(store: tierstore.TieredStore) -> None:
    """The replaced methods held the model strongly: a cycle through the model's __dict__
    kept ``del model`` (between notebook runs, a Trainer's model_init) from freeing the
    weights until the cycle collector ran."""
    model = tiny_llama()
    enable_offloaded_checkpointing(model, store)
    model.train()
    step_grads(model, torch.randint(0, 64, (2, 16)), store)
    gone = weakref.ref(model)
    gc.disable()
    try:
        del model
        assert gone() is None
    finally:
        gc.enable()


def test_a_model_with_tierstores_checkpoint_pickles(tmp_path: Path) -> None:
    """``torch.save(model)`` pickles the replaced methods by name: they had none
    (``'functools.partial' object has no attribute '__name__'``)."""
    model = tiny_llama()
    enable_offloaded_checkpointing(model)  # the default store: nothing unpicklable bound
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    assert checkpointing_on(loaded)
    # The loaded model's methods are still tierstore's, bound to it: the Trainer's enable
    # keeps tierstore's checkpoint on every layer. They were transformers' own (unpickling
    # looked the name up before the instance's dict was back), and the Trainer's call put
    # torch's checkpoint there.
    name = "activation" if HAS_ACTIVATION_NAMES else "gradient"
    getattr(loaded, f"{name}_checkpointing_enable")()
    for layer in loaded.model.layers:
        assert layer._gradient_checkpointing_func.func is tierstore.checkpoint
    ids = torch.randint(0, 128, (2, 24))
    store = tierstore.default_store()  # its min_bytes leaves these small inputs in place

    def seen() -> int:
        stats = store.stats()
        return stats.puts + sum(stats.skipped.values())

    before = seen()
    loaded.train()
    loaded(ids, labels=ids).loss.backward()
    assert seen() > before
    turn_checkpointing_off(loaded)  # the loaded model's own, not the original's
    assert not checkpointing_on(loaded) and checkpointing_on(model)


def test_a_pickled_model_keeps_its_every_n_layers(tmp_path: Path) -> None:
    """A model enabled with ``every_n_layers=2``, saved whole and loaded back: the Trainer's
    enable on the loaded model must keep every other layer checkpointed. Its replaced methods
    were rebuilt with a count of 1, and the Trainer's call checkpointed every layer."""
    model = tiny_llama(layers=4)
    if "every_n_layers" not in inspect.signature(model._set_gradient_checkpointing).parameters:
        pytest.skip(f"transformers {transformers.__version__} checkpoints every layer or none")
    enable_offloaded_checkpointing(model, every_n_layers=2)  # the default store: picklable
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)

    def checkpointed() -> list[bool]:
        return [bool(layer.gradient_checkpointing) for layer in loaded.model.layers]

    assert checkpointed() == [True, False, True, False]
    # What the Trainer calls when its own switch is on: no layer count of its own.
    name = "activation" if HAS_ACTIVATION_NAMES else "gradient"
    getattr(loaded, f"{name}_checkpointing_enable")()
    assert checkpointed() == [True, False, True, False]
    loaded.gradient_checkpointing_enable()  # the name before transformers renamed it
    assert checkpointed() == [True, False, True, False]
    for layer in loaded.model.layers[::2]:
        assert layer._gradient_checkpointing_func.func is tierstore.checkpoint
    turn_checkpointing_off(loaded)
    assert not any(checkpointed())


def test_peft_tuner_models_are_looked_through() -> None:
    """A bare tuner model (``peft_model.base_model``) wraps the transformers model in
    ``.model``; it has no ``get_base_model``."""
    peft = pytest.importorskip("peft")
    from tierstore.integrations.transformers import _wrapped_model

    model = tiny_llama()
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    assert _wrapped_model(wrapped) is model
    assert _wrapped_model(wrapped.base_model) is model
    assert _wrapped_model(model) is model


def test_a_method_looked_up_on_a_temporary_copy_does_nothing(
    store: tierstore.TieredStore,
) -> None:
    import copy

    model = tiny_llama()
    enable_offloaded_checkpointing(model, store)
    name = "activation" if HAS_ACTIVATION_NAMES else "gradient"
    # The copy dies when its method is looked up, before the call: a bound method would
    # have switched it; this one must not raise ReferenceError.
    getattr(copy.deepcopy(model), f"{name}_checkpointing_disable")()
    getattr(copy.deepcopy(model), f"{name}_checkpointing_enable")()
    assert checkpointing_on(model)


@pytest.mark.parametrize("wrapper", ["ddp", "compile"])
def test_offloading_context_finds_the_head_inside_ddp_and_compile(
    tmp_path: Path, wrapper: str
) -> None:
    """The head was the wrapper's last child, which is the whole model: everything ran inside
    no_offload and nothing was offloaded. TRL's context unwraps ``.module`` first."""
    import torch.distributed as dist

    from tierstore.integrations.transformers import _output_head, offloading_context

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 256)
    )
    started = False
    if wrapper == "ddp":
        dist.init_process_group(
            "gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1
        )
        started = True
        wrapped: torch.nn.Module = torch.nn.parallel.DistributedDataParallel(model)
    else:
        wrapped = torch.compile(model)  # type: ignore[assignment]
    try:
        assert _output_head(wrapped) is model[2]
        if wrapper == "ddp":
            x = torch.randn(256, 256)
            with tierstore.TieredStore(
                device_bytes=0, host_bytes=0, min_bytes=0, disk_dir=str(tmp_path)
            ) as store:
                with offloading_context(wrapped, store, min_bytes=1024):
                    loss = wrapped(x).sum()
                assert store.stats().puts > 0
                loss.backward()
    finally:
        if started:
            dist.destroy_process_group()


def test_offloading_context_warns_where_the_one_child_is_the_whole_model() -> None:
    from tierstore.integrations.transformers import _output_head

    class Outer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))

    with pytest.warns(RuntimeWarning, match="cannot tell the output head of Outer"):
        assert _output_head(Outer()) is None


def test_enable_on_a_ddp_wrapped_model_checkpoints_the_model_inside(
    store: tierstore.TieredStore, tmp_path: Path
) -> None:
    """DDP's ``.module`` was not looked through: the error said DistributedDataParallel does
    not support gradient checkpointing and told the user to wrap the layers by hand."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1
    )
    try:
        model = tiny_llama()
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
        enable_offloaded_checkpointing(wrapped, store)
        assert checkpointing_on(model)
    finally:
        dist.destroy_process_group()
