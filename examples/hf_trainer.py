"""Hugging Face Trainer with offloaded gradient checkpointing, on a tiny random Llama.

    python examples/hf_trainer.py --output-dir /tmp/tierstore-hf --steps 4
    python examples/hf_trainer.py --output-dir /tmp/tierstore-hf --steps 4 --no-offload

Needs ``transformers`` and ``accelerate`` (``pip install transformers accelerate``; the test
extra, ``pip install -e ".[test]"``, has both). Nothing is downloaded: the model is built from a
LlamaConfig with random weights and the data set is random token ids. With a real model, call
``enable_offloaded_checkpointing`` the same way right after loading it; the Trainer's own
``activation_checkpointing=True`` then installs tierstore's checkpoint too. ``attach_callback``
adds the store's figures to every logged step and logs one line per optimizer step on the
``tierstore`` logger (shown here at INFO), e.g. ``tierstore: step 2 offloaded 4.3 MiB (host 0.0,
disk 4.3), peak off-device 4.3 MiB, ...``. Each layer's input is 2 MiB here (batch 4, 512
tokens, width 256). Every step prints its loss exactly, so the run can be compared with
``--no-offload``: the losses are the same, bit for bit.
"""

from __future__ import annotations

import argparse
import logging

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

import tierstore
from tierstore.integrations.transformers import attach_callback, enable_offloaded_checkpointing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--disk-dir", help="parent of the spill directory (default: config)")
    parser.add_argument("--no-offload", action="store_true", help="train without tierstore")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
    logging.getLogger("transformers").setLevel(logging.WARNING)

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        attention_dropout=0.1,
        use_cache=False,
    )
    model = LlamaForCausalLM(config)
    store = None
    if not args.no_offload:
        # Host tier 0 bytes: every layer input goes to disk, to show the whole path working.
        overrides: dict[str, object] = {"device_bytes": 0, "host_bytes": 0, "min_bytes": 0}
        if args.disk_dir:
            overrides["disk_dir"] = args.disk_dir
        store = tierstore.TieredStore(**overrides)
        enable_offloaded_checkpointing(model, store)
    # The Trainer logs a rounded loss; print each step's own, exactly.
    model.register_forward_hook(lambda module, args, out: print(f"loss {out.loss.item()!r}"))

    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, 256, (512,), generator=g) for _ in range(16)]
    dataset = [{"input_ids": r, "labels": r} for r in rows]
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=training_args, train_dataset=dataset)
    if store is not None:
        # Each step logs its line ("tierstore: step 1 offloaded ..."), and each logged step
        # shows what the store did: tierstore/offloaded_gib, disk_gib, ...
        attach_callback(trainer, store)
    trainer.train()
    if store is not None:
        stats = store.stats()
        print(
            f"{stats.puts} layer inputs stored, {stats.bytes_to_disk} bytes written to disk, "
            f"{stats.live_entries} still held"
        )
        store.close()  # logs the one-line summary


if __name__ == "__main__":
    main()
