"""The differential matrix: every adapter, every tier and engine, bit-identical gradients.

See ``differential.py`` for what the model saves and why; a failure names the configuration,
the step and the gradient that differ.
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path
from typing import Any

import pytest
import torch
from differential import CONFIGS, MiB, Run, differences, make_store, settle, tiny_llama, train

import tierstore
from optional_modules import importorskip_transformers


@functools.cache
def reference() -> Run:
    return train("none", None)


@pytest.mark.parametrize("mode", ["hooks", "checkpoint"])
@pytest.mark.parametrize("config", CONFIGS)
def test_offloaded_training_is_bit_identical(tmp_path: Path, config: str, mode: str) -> None:
    with make_store(config, tmp_path) as store:
        sizes: list[int] = []
        put = store.put

        def recorded(t: torch.Tensor, **kwargs: Any) -> tierstore.TensorHandle:
            sizes.append(t.numel() * t.element_size())
            return put(t, **kwargs)

        store.put = recorded  # type: ignore[method-assign]
        got = train(mode, store)
        stats = store.stats()
    assert differences(reference(), got) == []
    if "io_chunk_bytes" in CONFIGS[config]:
        # Some blob is cut in four chunks or more, whose order a mix-up would change (two
        # per directory when striped).
        assert max(sizes) >= 4 * store.config.io_chunk_bytes, (max(sizes), store.config)
    elif config == "disk-raw-default" and mode == "hooks":
        # The default chunk: the 24 MiB blob is cut in three, and written from its own pages.
        assert max(sizes) >= 3 * store.config.io_chunk_bytes == 24 * MiB, max(sizes)
    # The configuration really took the path it is named after.
    if config.startswith("disk"):
        assert stats.bytes_to_disk == stats.bytes_put > 0
        assert stats.bytes_from_disk >= stats.bytes_to_disk
    elif config == "tiny-host":
        assert stats.host.total_entries > 0 and stats.bytes_from_disk > 0
    elif config == "host":
        assert stats.host.total_entries == stats.puts > 0 and stats.bytes_to_disk == 0
    else:
        assert stats.device.total_entries == stats.puts > 0 and stats.host.total_entries == 0


# -- Hugging Face: a random Llama whose layer inputs are 2 MiB and attention maps 8 MiB ------

HF_CONFIGS = ["tiny-host", "disk-raw-direct", "disk-zarr", "disk-striped"]


def _llama() -> torch.nn.Module:
    importorskip_transformers()
    model = tiny_llama(max_positions=1024)
    model.train()
    return model


def _llama_run(mode: str, store: tierstore.TieredStore | None) -> Run:
    model = _llama()
    if mode == "integration":
        from tierstore.integrations.transformers import enable_offloaded_checkpointing

        enable_offloaded_checkpointing(model, store)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run = Run([], [])
    for step in range(2):
        ids = torch.randint(0, 256, (2, 1024), generator=torch.Generator().manual_seed(step))
        torch.manual_seed(70 + step)
        with tierstore.offload_activations(store) if mode == "hooks" else contextlib.nullcontext():
            loss = model(input_ids=ids, labels=ids).loss
        if store is not None:
            settle(store)
        loss.backward()
        run.losses.append(loss.detach().clone())
        run.grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
        opt.step()
        opt.zero_grad(set_to_none=True)
    return run


@functools.cache
def _llama_reference() -> Run:
    return _llama_run("none", None)


@pytest.mark.parametrize("mode", ["integration", "hooks"])
@pytest.mark.parametrize("config", HF_CONFIGS)
def test_hugging_face_llama_is_bit_identical(tmp_path: Path, config: str, mode: str) -> None:
    with make_store(config, tmp_path) as store:
        got = _llama_run(mode, store)
        stats = store.stats()
    assert differences(_llama_reference(), got) == []
    assert stats.bytes_from_disk > 0
