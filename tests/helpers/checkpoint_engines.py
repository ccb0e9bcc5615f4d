"""DeepSpeed engines over the core-layer Stack, for checkpoint tests that need no trainer."""

from __future__ import annotations

import random

import numpy as np
import torch
import torch.distributed as dist

from parallel_latent.checkpoint.shards import module_tensors, placement_of
from parallel_latent.parallel import (
    ModelParallelUnit,
    get_parallel_state,
    initialize_model_parallel,
    vocab_parallel_cross_entropy,
)
from parallel_latent.zero.params import (
    ADAM_MOMENTS,
    adam_step,
    base_optimizer,
    gathered,
    local_shape,
    plain_param,
)
from parallel_latent.zero.patches import skip_unused_cpu_comm_kernel
from tests.helpers.checkpoint_stack import VOCAB, Stack, T, batch

GLOBAL_BATCH = 4
BETAS, WEIGHT_DECAY, ADAM_EPS = (0.9, 0.95), 0.01, 1e-8


def make_engine(tp: int, zero_stage: int, seed: int = 0, dropout: float = 0.1, lr: float = 1e-2):
    import deepspeed

    # As the trainer does (zero/engine.py): no JIT build of DeepSpeed's CPU inference all-reduce,
    # minutes of a C++ compiler on a fresh machine, for a kernel training never calls.
    skip_unused_cpu_comm_kernel()
    state = initialize_model_parallel(tp)
    model = Stack(state.tp_group, seed=seed, dropout=dropout)
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=lr, betas=BETAS, weight_decay=WEIGHT_DECAY, eps=ADAM_EPS
    )
    # Warmup: the LR changes every step, so a scheduler that is not restored shows.
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))
    config = {
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // state.dp_size,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": zero_stage},
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config, mpu=ModelParallelUnit(state)
    )
    return engine, model


def train_step(engine, model, step: int, noise: bool = False) -> float:
    """One optimizer step on this DP rank's share of the step's fixed global batch; the DP-mean loss."""
    state = get_parallel_state()
    micro = GLOBAL_BATCH // state.dp_size
    first = state.dp_rank * micro
    model.dropout_rng.step = step
    model.dropout_rng.sample_offset = first
    x = batch(step, micro, first)
    if noise:
        # Draws from every stateful RNG (same on all ranks), so an RNG that is not restored shows.
        x = x + 0.01 * torch.randn(x.shape) * random.random() * float(np.random.rand())
    gen = torch.Generator().manual_seed(2000 + step)
    target = torch.randint(0, VOCAB, (first + micro, T), generator=gen)[first:]
    loss, _ = vocab_parallel_cross_entropy(engine(x), target, VOCAB, state.tp_group)
    loss = loss.mean()
    engine.backward(loss)
    engine.step()
    reported = loss.detach().clone()
    dist.all_reduce(reported, group=state.dp_group)
    return (reported / state.dp_size).item()


def get_master(engine, param: torch.Tensor) -> torch.Tensor:
    """The fp32 master weight of ``param`` (whole, this TP rank's; collective over DP under ZeRO)."""
    if plain_param(engine, param):
        return param.detach().float().clone()
    from deepspeed.utils import safe_get_full_fp32_param

    return safe_get_full_fp32_param(param).detach().float().cpu().reshape(local_shape(param))


def get_moment(engine, param: torch.Tensor, key: str) -> torch.Tensor:
    """Adam moment ``key`` of ``param`` (zeros before the first step, when Adam has no state yet)."""
    if not any(len(state) for state in base_optimizer(engine).state.values()):
        return torch.zeros(local_shape(param), dtype=torch.float32)
    if plain_param(engine, param):
        value = base_optimizer(engine).state.get(param, {}).get(key)
        return torch.zeros(local_shape(param)) if value is None else value.detach().float().cpu().clone()
    from deepspeed.utils import safe_get_full_optimizer_state

    return safe_get_full_optimizer_state(param, key).detach().float().cpu().reshape(local_shape(param))


def get_step(engine) -> int:
    """Adam's step count (0 before the first step)."""
    steps = [adam_step(state) for state in base_optimizer(engine).state.values()]
    return next((step for step in steps if step is not None), 0)


def _tp_whole(value: torch.Tensor, place, group) -> torch.Tensor:
    if place.partition_dim is not None and dist.get_world_size(group) > 1:
        parts = [torch.empty_like(value) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, value.contiguous(), group=group)
        value = torch.cat(parts, dim=place.partition_dim)
    if place.partition_dim is not None:
        value = value.narrow(place.partition_dim, 0, place.full_shape[place.partition_dim])
    return value


def full_state(engine, model, moments: bool = True) -> dict[str, torch.Tensor]:
    """Model weights, fp32 masters and Adam moments, whole over TP and DP (collective)."""
    state = get_parallel_state()
    tensors, _ = module_tensors(model)
    out = {}
    for name, tensor in tensors.items():
        place = placement_of(tensor, state.tp_size, name)
        with gathered([tensor]):
            out[f"model/{name}"] = _tp_whole(tensor.detach().clone(), place, state.tp_group)
        if isinstance(tensor, torch.nn.Parameter) and tensor.requires_grad:
            out[f"fp32/{name}"] = _tp_whole(get_master(engine, tensor), place, state.tp_group)
            if moments:
                for key in ADAM_MOMENTS:
                    out[f"{key}/{name}"] = _tp_whole(get_moment(engine, tensor, key), place, state.tp_group)
    return out
