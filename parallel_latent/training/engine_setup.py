"""What the trainer hands DeepSpeed: the DeepSpeed config built from our YAML, the optimizer and the
learning-rate schedule; the engine is built from them by :func:`parallel_latent.zero.engine.initialize`.

Our YAML (:mod:`parallel_latent.config`) is the single source of truth; the DeepSpeed JSON is
derived from it (and written next to the run for the record), never edited by hand.  Expert
settings that our schema does not cover (offload, bucket sizes, ...) can be merged in with
``deepspeed_overrides``.

Optimizer: ``torch.optim.AdamW`` handed to DeepSpeed as ``optimizer=``.  DeepSpeed's own
FusedAdam / DeepSpeedCPUAdam need compiled ops (a CUDA toolchain, or a C++ build of the CPU
Adam), which a fresh machine does not have; torch's AdamW works everywhere and runs its
``fused`` kernel on CUDA.  ZeRO wraps it (``zero_allow_untested_optimizer``), keeps fp32 master
weights for bf16 / fp16 and partitions its state over the data-parallel group.  At ZeRO stage 0 in
fp32 it is the guarded AdamW of :mod:`parallel_latent.zero.engine`, which clips and skips a
non-finite step itself.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass
from typing import Any

import torch

from parallel_latent.config import Config, ScheduleConfig
from parallel_latent.parallel import ModelParallelUnit
from parallel_latent.zero.engine import NonFiniteGuardAdamW, NonFiniteGuardSGD, initialize

from .preflight import resolve_device
from .world import dp_size, resolved_global_batch_size

__all__ = [
    "EngineBundle",
    "build_lr_scheduler",
    "build_optimizer",
    "deepspeed_config",
    "initialize_engine",
    "lr_factor",
    "merge_overrides",
    "parameter_groups",
    "resolve_device",
]

# DeepSpeed's dynamic fp16 loss scaling: start at 2**16, halve on overflow (after `hysteresis`
# overflows in a row), double after `loss_scale_window` clean steps.
FP16_LOSS_SCALING = {
    "loss_scale": 0,  # 0 = dynamic
    "initial_scale_power": 16,
    "loss_scale_window": 1000,
    "hysteresis": 2,
    "min_loss_scale": 1,
}
# DeepSpeed prints a progress line every `steps_per_print` steps; we have our own metrics.
NEVER = 10**12


def uses_stage0_guard(cfg: Config) -> bool:
    """Whether our own AdamW guard clips and skips non-finite steps.

    ZeRO stages 1-3, bf16 and fp16 all run a DeepSpeed optimizer wrapper that computes the
    gradient norm (model-parallel aware), clips, and skips a step whose norm is not finite.
    Only ZeRO stage 0 in fp32 hands the bare torch optimizer to DeepSpeed, whose clipping path
    neither reports the norm nor skips; there :class:`NonFiniteGuardAdamW` does both, with
    DeepSpeed's own ``clip_grad_norm_``.
    """
    return cfg.parallel.zero_stage == 0 and cfg.training.precision == "fp32"


def merge_overrides(base: dict, overrides: dict) -> dict:
    """Deep-merge ``overrides`` into a copy of ``base`` (nested dicts merge, anything else replaces)."""
    merged = copy.deepcopy(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_overrides(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def deepspeed_config(cfg: Config, world_size: int, overrides: dict | None = None, device: str | None = None) -> dict:
    """The DeepSpeed config dict for ``cfg`` on ``world_size`` processes of ``device`` kind (start-up
    resolves it once; None: :func:`.preflight.resolve_device` of ``cfg``).

    Batch sizes: DeepSpeed checks ``train_batch_size == micro * grad_accum * dp`` itself, where
    dp is the mpu's data-parallel size, so the value must be the global batch over data-parallel
    ranks only (tensor-parallel ranks share their samples).
    """
    training = cfg.training
    stage = cfg.parallel.zero_stage
    data_parallel = dp_size(cfg, world_size)
    config: dict[str, Any] = {
        "train_batch_size": resolved_global_batch_size(cfg, world_size),
        "train_micro_batch_size_per_gpu": training.micro_batch_size,
        "gradient_accumulation_steps": training.grad_accum_steps,
        "gradient_clipping": 0.0 if uses_stage0_guard(cfg) else cfg.optimizer.grad_clip,
        "zero_optimization": {"stage": stage},
        "fp16": ({"enabled": True, **FP16_LOSS_SCALING} if training.precision == "fp16" else {"enabled": False}),
        # No overflow scan in bf16: it has fp32's exponent range, so there is no loss scale to
        # protect, and the scan costs a kernel per gradient tensor and a device read every step.
        # A non-finite bf16 step is caught by the trainer at the next log line or checkpoint
        # (Trainer._refuse_nonfinite_bf16), which never publishes its weights.
        "bf16": {"enabled": training.precision == "bf16", "check_grad_overflow": False},
        "zero_allow_untested_optimizer": True,  # torch.optim.AdamW under ZeRO
        "steps_per_print": NEVER,
        "wall_clock_breakdown": False,
        # DeepSpeed's throughput timer synchronises the device at every forward and step; we time
        # steps ourselves, on the host.
        "timers": {"throughput": {"enabled": False, "synchronized": False}},
        "dump_state": False,
    }
    if stage >= 1:
        parallel = cfg.parallel
        # Overlapping the gradient reduction with backward needs CUDA streams; on CPU it only
        # adds copies.
        overlap = parallel.zero_overlap_comm == "on" or (
            parallel.zero_overlap_comm == "auto"
            and (device or resolve_device(cfg, check_precision=False)) == "cuda"
            and data_parallel > 1
        )
        config["zero_optimization"].update(
            {
                "contiguous_gradients": True,
                "overlap_comm": overlap,
                "reduce_bucket_size": parallel.reduce_bucket_size,
                "allgather_bucket_size": parallel.allgather_bucket_size,
            }
        )
    if training.precision in ("bf16", "fp16"):
        # DeepSpeed reduces (and, at ZeRO 2, accumulates the reduced partition of) gradients in the
        # training dtype unless told otherwise.
        config["communication_data_type"] = cfg.parallel.grad_reduce_dtype
        # DeepSpeed casts parameters to the 16-bit dtype but leaves buffers as loaded; the
        # model's frozen buffers (the decoder's mask vector) feed the same matmuls as its
        # parameters, so they must be cast too.
        config["data_types"] = {"buffer_dtype": training.precision}
    return merge_overrides(config, overrides or {})


# --------------------------------------------------------------------------- #
# Learning-rate schedule.
# --------------------------------------------------------------------------- #


def lr_factor(step: int, schedule: ScheduleConfig, max_steps: int) -> float:
    """Multiplier of the peak learning rate after ``step`` applied optimizer steps.

    Linear warmup from ``1/warmup`` to 1 over ``warmup_steps`` steps, then ``decay`` from 1 to
    ``min_lr_ratio`` at ``max_steps`` (cosine: half a cosine period; linear; constant: stays 1).
    """
    warmup = schedule.warmup_steps
    if step < warmup:
        return (step + 1) / warmup
    if schedule.decay == "constant":
        return 1.0
    decay_steps = max(1, max_steps - warmup)
    progress = min(1.0, (step - warmup) / decay_steps)
    floor = schedule.min_lr_ratio
    if schedule.decay == "linear":
        return 1.0 - (1.0 - floor) * progress
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: Config) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR over :func:`lr_factor`.  DeepSpeed steps it after every *applied* optimizer
    step (a skipped fp16-overflow / non-finite step does not advance the schedule) and saves
    its state in the training checkpoint."""
    schedule, max_steps = cfg.schedule, cfg.training.max_steps
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, schedule, max_steps))


# --------------------------------------------------------------------------- #
# Optimizer.
# --------------------------------------------------------------------------- #


def parameter_groups(parameters: list[torch.nn.Parameter], weight_decay: float) -> list[dict]:
    """Weight decay on matrices only: biases, LayerNorm gains and scalar scales (1-D or 0-D
    tensors) are not decayed, as is usual for transformers.  Empty groups are dropped."""
    decayed = [p for p in parameters if p.dim() >= 2]
    not_decayed = [p for p in parameters if p.dim() < 2]
    groups = [
        {"params": decayed, "weight_decay": weight_decay},
        {"params": not_decayed, "weight_decay": 0.0},
    ]
    return [group for group in groups if group["params"]]


def build_optimizer(parameters: list[torch.nn.Parameter], cfg: Config, device: str, mpu) -> torch.optim.Optimizer:
    """AdamW (the default), or SGD with momentum: its update is linear in the gradient, which makes
    it the optimizer for comparing layouts over many steps (Adam divides by sqrt(v) + eps, and so
    magnifies the summation-order noise of gradients that are ~0)."""
    opt = cfg.optimizer
    if opt.name == "sgd":
        kwargs: dict[str, Any] = {"lr": opt.lr, "momentum": opt.momentum}
        plain, guarded = torch.optim.SGD, NonFiniteGuardSGD
    else:
        kwargs = {"lr": opt.lr, "betas": tuple(opt.betas), "eps": opt.eps}
        plain, guarded = torch.optim.AdamW, NonFiniteGuardAdamW
    if opt.fused == "on" or (opt.fused == "auto" and device == "cuda"):
        kwargs["fused"] = True  # one kernel for all parameters
    groups = parameter_groups(parameters, opt.weight_decay)
    if uses_stage0_guard(cfg):
        return guarded(groups, max_grad_norm=opt.grad_clip, mpu=mpu, **kwargs)
    return plain(groups, **kwargs)


# --------------------------------------------------------------------------- #
# deepspeed.initialize
# --------------------------------------------------------------------------- #


@dataclass
class EngineBundle:
    engine: Any  # deepspeed.DeepSpeedEngine
    optimizer: Any  # what DeepSpeed made of our AdamW (a ZeRO wrapper, or the AdamW itself)
    lr_scheduler: torch.optim.lr_scheduler.LambdaLR
    config: dict  # the DeepSpeed config it runs with


def initialize_engine(
    model: torch.nn.Module, cfg: Config, world_size: int, overrides: dict | None = None, mpu=None, device=None
) -> EngineBundle:
    """``deepspeed.initialize`` with the trainable parameters only, our AdamW and schedule, the
    config derived from ``cfg`` and the tensor/data-parallel ``mpu``
    (:func:`parallel_latent.zero.engine.initialize`).

    Process groups must exist first (:func:`parallel_latent.parallel.init_distributed`):
    DeepSpeed then adopts the default group instead of creating its own. ``device``: the kind
    start-up resolved (None: resolved here from ``cfg``).
    """
    device = device or resolve_device(cfg)
    mpu = mpu or ModelParallelUnit()
    if cfg.training.precision == "fp64":
        model.double()  # DeepSpeed leaves the dtype of an fp32-configured model as it finds it
    trainable = (
        list(model.trainable_parameters())
        if hasattr(model, "trainable_parameters")
        else [p for p in model.parameters() if p.requires_grad]
    )
    optimizer = build_optimizer(trainable, cfg, device, mpu)
    scheduler = build_lr_scheduler(optimizer, cfg)
    ds_config = deepspeed_config(cfg, world_size, overrides, device)
    bulk = cfg.parallel.zero_gradients == "bulk"
    engine, ds_optimizer, ds_scheduler = initialize(
        model, trainable, optimizer, scheduler, ds_config, mpu, device=device, bulk_gradients=bulk
    )
    return EngineBundle(engine=engine, optimizer=ds_optimizer, lr_scheduler=ds_scheduler, config=ds_config)


def dump_deepspeed_config(config: dict) -> str:
    return json.dumps(config, indent=2, sort_keys=True)
