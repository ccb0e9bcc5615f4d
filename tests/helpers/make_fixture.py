"""Writes tests/checkpoint/fixtures/v1: checkpoints in the format of manifest version 1, kept so
that every later version of the code is tested against files an earlier one wrote.

    python -m tests.helpers.make_fixture [OUT]    # two gloo ranks, about a minute on 2 cores

OUT defaults to fixtures/v1 and must not exist: a fixture is written once, by the code of its
version, and never rewritten (a new format gets a new directory).

Two tiny autoencoders (d=16, T=8, a vocabulary of 300, a 3-layer GPT-2 of which one block is
held), each trained on the trainer's engine (``build_model`` + ``initialize_engine``, TP=2 x DP=1,
ZeRO-2, fp32) until it reconstructs a fixed batch, so the decoded ids have wide argmax margins:

* ``run/checkpoints/step_*``: a training checkpoint (DeepSpeed's files, RNG states, client state,
  ``model/`` portable weights) of the model with its own vocabulary head (``head: normal``: a
  split tensor with padding rows at TP=2);
* ``portable``: the portable weights of the model with the head tied to GPT-2's token table
  (``head: tied``: stored once, as an alias).

It prints the decoded ids of the batch, which tests/checkpoint/test_fixture.py records.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

FIXTURE = Path(__file__).resolve().parents[1] / "checkpoint" / "fixtures" / "v1"
T, D, VOCAB, MASK, PAD = 8, 16, 300, 298, 299
FACTS = {"vocab_size": VOCAB, "mask_token_id": MASK, "pad_token_id": PAD, "eos_token_id": None}
STEPS = {"normal": 60, "tied": 200}


def fixture_config(head: str):
    from parallel_latent.config import (
        CheckpointConfig,
        Config,
        FeatureModelConfig,
        ModelConfig,
        OptimizerConfig,
        ParallelConfig,
        ScheduleConfig,
        TrainingConfig,
    )

    model = ModelConfig(
        d_model=D,
        n_heads=2,
        n_encoder_layers=1,
        n_decoder_layers=1,
        max_length=T,
        dropout=0.0,
        init_std=0.1,
        vocab_size=VOCAB,
        mask_token_id=MASK,
        pad_token_id=PAD,
        head=head,
        encoder_context_positions=False,  # the encoder the fixture was written with (before the key)
    )
    return Config(
        model=model,
        feature_model=FeatureModelConfig(n_layer=3, n_head=2, n_embd=D, n_positions=T),
        parallel=ParallelConfig(tensor_parallel=2, zero_stage=2),
        optimizer=OptimizerConfig(lr=1e-2),
        schedule=ScheduleConfig(warmup_steps=2),
        training=TrainingConfig(seed=7, max_steps=STEPS[head], micro_batch_size=4, precision="fp32", device="cpu"),
        checkpoint=CheckpointConfig(keep_last=2, export_portable=True),
    )


def fixture_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Four sequences of T tokens (the third padded after 5)."""
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(0, MASK, (4, T), generator=gen)
    mask = torch.ones_like(ids)
    mask[2, 5:] = 0
    return ids.masked_fill(mask == 0, PAD), mask


def train(head: str):
    from parallel_latent.model import build_model
    from parallel_latent.parallel import initialize_model_parallel
    from parallel_latent.training.engine_setup import initialize_engine

    cfg = fixture_config(head)
    state = initialize_model_parallel(cfg.parallel.tensor_parallel)
    model = build_model(cfg, state.tp_group)
    bundle = initialize_engine(model, cfg, state.world_size)
    ids, mask = fixture_batch()
    for step in range(STEPS[head]):
        model.dropout_rng.step = step
        out = bundle.engine(ids, mask)
        bundle.engine.backward(out.loss)
        bundle.engine.step()
    return cfg, state, bundle.engine, model


def decoded_ids(model) -> tuple[list[list[int]], float]:
    """The decoded ids of the batch and the smallest argmax margin over its real tokens."""
    ids, mask = fixture_batch()
    model.eval()
    with torch.no_grad():
        latents = model.encode(ids, mask)
        logits = model.decoder(latents, ids.shape[1])
        group = model.tp_group
        if group is not None and torch.distributed.get_world_size(group) > 1:
            parts = [torch.empty_like(logits) for _ in range(torch.distributed.get_world_size(group))]
            torch.distributed.all_gather(parts, logits.contiguous(), group=group)
            logits = torch.cat(parts, dim=-1)
        top = logits[..., :VOCAB].topk(2, dim=-1).values
        margin = (top[..., 0] - top[..., 1])[mask.bool()].min().item()
        return model.decode(latents, mask).tolist(), margin


def write_task(directory: str):
    from parallel_latent.checkpoint import save_portable, save_training_checkpoint

    directory = Path(directory)
    cfg, state, engine, model = train("normal")
    save_training_checkpoint(
        engine,
        directory / "run" / "checkpoints",
        STEPS["normal"],
        {"step": STEPS["normal"], "skipped_steps": 0},
        model=model,
        cfg=cfg,
        tokenizer_facts=FACTS,
        keep_last=cfg.checkpoint.keep_last,
        export_portable=True,
        tp_group=state.tp_group,
    )
    normal = decoded_ids(model)
    cfg, state, engine, model = train("tied")
    save_portable(model, directory / "portable", cfg, FACTS, state.tp_group, step=STEPS["tied"])
    return {"normal": normal, "tied": decoded_ids(model)}


def main(out: Path) -> None:
    from tests.helpers.distributed import DistributedPool

    if out.exists():
        raise SystemExit(f"{out}: already exists; a fixture is never rewritten")
    out.mkdir(parents=True)
    pool = DistributedPool(2, env={"DS_ACCELERATOR": "cpu"})
    try:
        results = pool.run(write_task, str(out))
    finally:
        pool.close()
    assert results[0] == results[1]
    ids, _ = fixture_batch()
    print("input ids:", json.dumps(ids.tolist()))
    for name, (decoded, margin) in results[0].items():
        print(f"{name}: decoded {json.dumps(decoded)}, smallest argmax margin {margin:.3f}")
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"{out}: {size} bytes")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else FIXTURE)
