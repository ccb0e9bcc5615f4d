"""The tiny autoencoder at TP=N against its TP=1 twin, inside each rank of a pool (real gloo ranks): one
comparison task (forward, loss, argmax, gradients after one fp32 step, weights after five AdamW
steps in float64) and its assertion, shared by the TP tests of the model and of the latent space."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from parallel_latent.model import LatentAutoencoder
from parallel_latent.parallel import initialize_model_parallel, split_along_sequence
from tests.helpers.tiny_model import (
    VOCAB,
    B,
    D,
    T,
    reduction_length_of_model,
    tiny_batch,
    tiny_configs,
)
from tests.helpers.tp_compare import (
    argmax_agrees,
    gather_full,
    max_abs,
    max_param_diff,
    order_bound,
    terms_scale,
    weights_after_adam,
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
    """Logits of every position from the latents of every position."""
    if model.sequence_parallel:  # the decoder reads this rank's positions
        latents = split_along_sequence(latents, group)
    with torch.no_grad():
        logits = model.decoder(latents, T)
    return gather_full(logits, SPLIT_ON_LAST_DIM, group)[..., :VOCAB]


def sgd_engine(model: LatentAutoencoder, tp: int, zero_stage: int, lr: float):
    """``model``, of the configs it was built from, under DeepSpeed at TP=``tp`` x DP=the rest through
    the trainer's engine set-up: SGD at ``lr`` without clipping or schedule, a DP rank's micro-batch
    half of the tiny batch; at ZeRO-3 every parameter partitioned (DeepSpeed keeps those of up to 1e5
    elements whole once gathered otherwise)."""
    from parallel_latent.config import Config, OptimizerConfig, ParallelConfig, ScheduleConfig, TrainingConfig
    from parallel_latent.training.engine_setup import initialize_engine

    cfg = Config(
        model=model.model_cfg,
        feature_model=model.feature_cfg,
        parallel=ParallelConfig(tensor_parallel=tp, zero_stage=zero_stage),
        optimizer=OptimizerConfig(name="sgd", lr=lr, weight_decay=0.0, grad_clip=0.0),
        schedule=ScheduleConfig(warmup_steps=0, decay="constant"),
        training=TrainingConfig(micro_batch_size=B // 2, device="cpu"),
    )
    overrides = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}
    return initialize_engine(model, cfg, dist.get_world_size(), overrides).engine


# Fewer and narrower latents than positions and width, and the length learned: T=8 positions in
# N=4 latents of k=8 features.
COMPRESSED = {"num_latents": 4, "latent_dim": 8, "predict_length": True}


N_COMPRESSED, K_COMPRESSED = COMPRESSED["num_latents"], COMPRESSED["latent_dim"]


def head_configs(dropout: float, head: str = "tied", frozen: bool = True, **model_overrides):
    model_cfg, feature_cfg = tiny_configs(dropout, head=head, **model_overrides)
    return model_cfg, dataclasses.replace(feature_cfg, frozen=frozen)


def compare_with_tp1(
    tp: int, dropout: float, head: str = "tied", frozen: bool = True, model_overrides: dict | None = None, **options
) -> dict:
    """{quantity: (difference from TP=1, its bound)}, plus exact properties. ``options``: the TP
    model's parallel options (split_feature_model, tp_options); ``model_overrides``: ModelConfig keys."""
    state = initialize_model_parallel(tp)
    group, k = state.tp_group, reduction_length_of_model(tp)
    if not frozen:  # gradients also run back through the GPT-2 block kept (attention, MLP) to the table
        k += 2 * (D + 4 * D + 2 * T) + VOCAB
    configs = head_configs(dropout, head, frozen, **(model_overrides or {}))
    ref = LatentAutoencoder(*configs, seed=1).train()
    par = LatentAutoencoder(*configs, tp_group=group, seed=1, **options).train()
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

    # Five AdamW steps in float64 (see tests/helpers/tp_compare.py for why not fp32).
    ref64 = LatentAutoencoder(*configs, seed=1).double().train()
    par64 = LatentAutoencoder(*configs, tp_group=group, seed=1, **options).double().train()
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
    result["weights"] = weights_after_adam(ref64, par64, group, STEPS, LR, ADAM_EPS, grad_scale, k)
    result["replicated_spread"] = replicated_spread(_replicated(par64), group)
    return result


def assert_equals_tp1(results: list[dict], label: str) -> None:
    for rank, res in enumerate(results):
        where = f"rank {rank} {label}"
        assert res["weights_at_init"] == 0.0, f"{where}: gathered weights differ from TP=1"
        for key in ("loss", "latents", "grads", "logits", "weights"):
            diff, bound = res[key]
            assert diff <= bound, f"{where}: {key} differs by {diff:.3g} > bound {bound:.3g}"
        assert res["argmax_agrees"], f"{where}: a decided argmax differs from TP=1"
        # LayerNorms, row biases, positions, latents, scale: the same bits on every rank of the group.
        assert res["replicated_grad_spread"] == 0.0, f"{where}: replicated gradients differ across ranks"
        assert res["replicated_spread"] == 0.0, f"{where}: replicated parameters drifted apart"
