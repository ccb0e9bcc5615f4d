"""The whole autoencoder at TP=2 and TP=4 equals TP=1: forward, loss, gradients and weights after
AdamW steps, with dropout on and off; replicated parameters stay bit-identical across the TP group;
a Perceiver block costs the Megatron minimum of collectives; and the model learns at TP=2.
Real gloo ranks; the TP=1 twin is built inside each rank from the same seed."""
from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist

from parallel_latent.model import LatentAutoencoder
from parallel_latent.parallel import initialize_model_parallel
from tests.model.test_autoencoder import B, D, T, overfit, tiny_batch, tiny_configs
from tests.tp_compare import count_collectives, max_param_diff

# fp32 sums taken in another order (per-rank partial products, then the all-reduce), through
# 4 Perceiver blocks and 5 Adam steps (Adam normalises updates, so weight errors stay this small).
ATOL = 5e-5
STEPS = 5


def replicated_spread(model: LatentAutoencoder, group) -> float:
    """Largest difference of any replicated parameter between this rank and the others of its group."""
    worst = 0.0
    for p in model.parameters():
        if p.tensor_model_parallel:
            continue
        copies = [torch.empty_like(p) for _ in range(dist.get_world_size(group))]
        dist.all_gather(copies, p.detach().contiguous(), group=group)
        worst = max(worst, max((c - p).abs().max().item() for c in copies))
    return worst


def compare_with_tp1(tp: int, dropout: float) -> dict:
    state = initialize_model_parallel(tp)
    ref = LatentAutoencoder(*tiny_configs(dropout), seed=1)
    par = LatentAutoencoder(*tiny_configs(dropout), tp_group=state.tp_group, seed=1)
    result = {"weights_at_init": max(max_param_diff(ref, par, state.tp_group).values())}
    optimizers = [torch.optim.AdamW(m.trainable_parameters(), lr=3e-3) for m in (ref, par)]
    for step in range(STEPS):
        ids, mask = tiny_batch(seed=step)
        outs = []
        for model, optimizer in zip((ref, par), optimizers):
            model.train()
            model.dropout_rng.step = step
            out = model(ids, mask, return_latents=True)
            out.loss.backward()
            outs.append(out)
        if step == 0:
            result["loss"] = abs(outs[0].loss.item() - outs[1].loss.item())
            result["latents"] = (outs[0].latents - outs[1].latents).abs().max().item()
            result["num_correct_equal"] = outs[0].num_correct.item() == outs[1].num_correct.item()
            result["grads"] = max(max_param_diff(ref, par, state.tp_group, grads=True).values())
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    result["weights"] = max(max_param_diff(ref, par, state.tp_group).values())
    result["replicated_spread"] = replicated_spread(par, state.tp_group)
    return result


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_model_at_tp_equals_tp1(pool4, tp, dropout):
    for rank, res in enumerate(pool4.run(compare_with_tp1, tp, dropout)):
        assert res["weights_at_init"] == 0.0, f"rank {rank}: master-weight split differs from TP=1"
        for key in ("loss", "latents", "grads", "weights"):
            assert res[key] <= ATOL, f"rank {rank} tp={tp} dropout={dropout}: {key} differs by {res[key]:.3g}"
        assert res["num_correct_equal"], f"rank {rank}: token accuracy differs from TP=1"
        # LayerNorms, row biases, positions, latents, scale: the same bits on every rank of the group.
        assert res["replicated_spread"] == 0.0, f"rank {rank}: replicated parameters drifted apart"


def count_block_collectives(tp: int) -> tuple[list, list]:
    state = initialize_model_parallel(tp)
    model = LatentAutoencoder(*tiny_configs(dropout=0.0), tp_group=state.tp_group, seed=1).train()
    ids, mask = tiny_batch()
    log, restore = count_collectives()
    try:
        out = model(ids, mask)
        forward = list(log)
        log.clear()
        out.loss.backward()
        backward = list(log)
    finally:
        restore()
    return forward, backward


def test_collectives_per_block_are_the_megatron_minimum(pool4):
    layers = tiny_configs()[0].n_encoder_layers, tiny_configs()[0].n_decoder_layers
    blocks = sum(layers)
    forward, backward = pool4.run(count_block_collectives, 2)[0]
    assert all(name == "all_reduce" for name, _, _ in forward + backward)
    forward_sizes = Counter(numel for _, numel, _ in forward)
    # Two [B, T, d] all-reduces per block (attention, MLP); one of d for the query MLP, computed
    # once without dropout; the loss's small [B, T] reductions (max; sum-exp + target; argmax).
    assert forward_sizes == Counter([B * T * D] * 2 * blocks + [D] + [B * T] * 2 + [2 * B * T])
    # Backward: one per MLP and one per attention at the region entries, plus the vocabulary head's
    # entry. Attention reduces cat(context, stream) in one go: the context gradient feeds the learned
    # ln_context, so it is needed even where the context itself (GPT-2 features) is frozen.
    backward_sizes = Counter(numel for _, numel, _ in backward)
    assert backward_sizes == Counter([B * T * D] * (blocks + 1) + [2 * B * T * D] * blocks)
    assert len(forward) - 4 == len(backward) - 1 == 2 * blocks


def overfit_at_tp(tp: int) -> int:
    state = initialize_model_parallel(tp)
    model = LatentAutoencoder(*tiny_configs(dropout=0.1), tp_group=state.tp_group, seed=1)
    ids, mask = tiny_batch()
    return overfit(model, ids, mask, max_steps=150)


def test_overfits_a_small_batch_at_tp2(pool4):
    steps = pool4.run(overfit_at_tp, 2)
    assert steps[0] > 0, "token accuracy did not reach 100% in 150 steps at TP=2"
    assert len(set(steps)) == 1  # every rank saw the same accuracy
