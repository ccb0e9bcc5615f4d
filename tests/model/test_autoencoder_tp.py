"""The whole autoencoder at TP=2 and TP=4 equals TP=1: forward, loss, argmax and gradients after one
fp32 step (bounds derived in :mod:`tests.tp_compare`), weights after five AdamW steps in float64,
with dropout on and off; replicated parameters stay bit-identical across the TP group; a Perceiver
block costs the Megatron minimum of collectives; and the model learns at TP=2.
Real gloo ranks; the TP=1 twin is built inside each rank from the same seed."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist

from parallel_latent.model import LatentAutoencoder
from parallel_latent.parallel import initialize_model_parallel
from tests.model.test_autoencoder import (
    VOCAB,
    B,
    D,
    T,
    overfit,
    reduction_length_of_model,
    tiny_batch,
    tiny_configs,
)
from tests.tp_compare import (
    adam_steps_bound,
    argmax_agrees,
    count_collectives,
    gather_full,
    max_abs,
    max_param_diff,
    order_bound,
    terms_scale,
)

STEPS, LR, ADAM_EPS = 5, 3e-3, 1e-8


class SPLIT_ON_LAST_DIM:  # describes vocab-parallel logits to gather_full
    tensor_model_parallel, partition_dim = True, -1


def replicated_spread(tensors: dict[str, torch.Tensor], group) -> float:
    """Largest difference of any replicated tensor between this rank and the others of its group."""
    worst = 0.0
    for value in tensors.values():
        copies = [torch.empty_like(value) for _ in range(dist.get_world_size(group))]
        dist.all_gather(copies, value.detach().contiguous(), group=group)
        worst = max(worst, *((c - value).abs().max().item() for c in copies))
    return worst


def _replicated(model, grads: bool = False) -> dict[str, torch.Tensor]:
    return {
        n: (p.grad if grads else p)
        for n, p in model.named_parameters()
        if not p.tensor_model_parallel and p.requires_grad
    }


def _logits(model, latents, group):
    with torch.no_grad():
        logits = model.decoder(latents)
    return gather_full(logits, SPLIT_ON_LAST_DIM, group)[..., :VOCAB]


def compare_with_tp1(tp: int, dropout: float) -> dict:
    """{quantity: (difference from TP=1, its bound)}, plus exact properties."""
    state = initialize_model_parallel(tp)
    group, k = state.tp_group, reduction_length_of_model(tp)
    ref = LatentAutoencoder(*tiny_configs(dropout), seed=1).train()
    par = LatentAutoencoder(*tiny_configs(dropout), tp_group=group, seed=1).train()
    result = {"weights_at_init": max(max_param_diff(ref, par, group).values())}

    ids, mask = tiny_batch(seed=0)
    outs = []
    for model in (ref, par):
        model.dropout_rng.step = 0
        out = model(ids, mask, return_latents=True)
        out.loss.backward()
        outs.append(out)
    for key, want, got in (
        ("loss", outs[0].loss, outs[1].loss),
        ("latents", outs[0].latents, outs[1].latents),
    ):
        result[key] = ((want - got).abs().max().item(), order_bound(k, terms_scale(max_abs([want]), k)))
    grad_scale = max_abs([p.grad for p in ref.parameters() if p.requires_grad])
    result["grads"] = (
        max(max_param_diff(ref, par, group, grads=True).values()),
        order_bound(k, terms_scale(grad_scale, k)),
    )
    ref_logits, par_logits = _logits(ref, outs[0].latents, None), _logits(par, outs[1].latents, group)
    logit_bound = order_bound(k, terms_scale(max_abs([ref_logits]), k))
    result["logits"] = ((ref_logits - par_logits).abs().max().item(), logit_bound)
    result["argmax_agrees"] = argmax_agrees(ref_logits, par_logits, logit_bound)
    result["replicated_grad_spread"] = replicated_spread(_replicated(par, grads=True), group)

    # Five AdamW steps in float64 (see tests/tp_compare.py for why not fp32).
    ref64 = LatentAutoencoder(*tiny_configs(dropout), seed=1).double().train()
    par64 = LatentAutoencoder(*tiny_configs(dropout), tp_group=group, seed=1).double().train()
    optimizers = [torch.optim.AdamW(m.trainable_parameters(), lr=LR, eps=ADAM_EPS) for m in (ref64, par64)]
    grad_scale = 0.0
    for step in range(STEPS):
        ids, mask = tiny_batch(seed=step)
        for model in (ref64, par64):
            model.dropout_rng.step = step
            model(ids, mask).loss.backward()
        grad_scale = max(grad_scale, max_abs([p.grad for p in ref64.parameters() if p.requires_grad]))
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    grad_bound = order_bound(k, terms_scale(grad_scale, k), torch.float64)
    result["weights"] = (
        max(max_param_diff(ref64, par64, group).values()),
        adam_steps_bound(STEPS, LR, ADAM_EPS, grad_bound),
    )
    result["replicated_spread"] = replicated_spread(_replicated(par64), group)
    return result


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_model_at_tp_equals_tp1(pool4, tp, dropout):
    for rank, res in enumerate(pool4.run(compare_with_tp1, tp, dropout)):
        where = f"rank {rank} tp={tp} dropout={dropout}"
        assert res["weights_at_init"] == 0.0, f"{where}: master-weight split differs from TP=1"
        for key in ("loss", "latents", "grads", "logits", "weights"):
            diff, bound = res[key]
            assert diff <= bound, f"{where}: {key} differs by {diff:.3g} > bound {bound:.3g}"
        assert res["argmax_agrees"], f"{where}: a decided argmax differs from TP=1"
        # LayerNorms, row biases, positions, latents, scale: the same bits on every rank of the group.
        assert res["replicated_grad_spread"] == 0.0, f"{where}: replicated gradients differ across ranks"
        assert res["replicated_spread"] == 0.0, f"{where}: replicated parameters drifted apart"


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
