"""DeepSpeed glue: the DeepSpeed config built from our YAML, the optimizer, the learning-rate
schedule and ``deepspeed.initialize``.

Our YAML (:mod:`parallel_latent.config`) is the single source of truth; the DeepSpeed JSON is
derived from it (and written next to the run for the record), never edited by hand.  Expert
settings that our schema does not cover (offload, bucket sizes, ...) can be merged in with
``deepspeed_overrides``.

Optimizer: ``torch.optim.AdamW`` handed to DeepSpeed as ``optimizer=``.  DeepSpeed's own
FusedAdam / DeepSpeedCPUAdam need compiled ops (a CUDA toolchain, or a C++ build of the CPU
Adam), which a fresh machine does not have; torch's AdamW works everywhere and runs its
``fused`` kernel on CUDA.  ZeRO wraps it (``zero_allow_untested_optimizer``), keeps fp32 master
weights for bf16 / fp16 and partitions its state over the data-parallel group.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
from dataclasses import dataclass
from types import MethodType, SimpleNamespace
from typing import Any

import torch

from parallel_latent.config import Config, ConfigError, ScheduleConfig
from parallel_latent.parallel import ModelParallelUnit
from parallel_latent.world import dp_size, resolved_global_batch_size

__all__ = [
    "EngineBundle",
    "NonFiniteGuard",
    "NonFiniteGuardAdamW",
    "NonFiniteGuardSGD",
    "build_lr_scheduler",
    "build_optimizer",
    "deepspeed_config",
    "initialize_engine",
    "lr_factor",
    "merge_overrides",
    "parameter_groups",
    "resolve_device",
    "sync_free_zero_step",
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


def resolve_device(cfg: Config, source: str = "<runtime>", check_precision: bool = True) -> str:
    """``cpu`` or ``cuda`` for ``training.device`` (``auto`` = cuda when visible); ConfigError when
    there is no such device, or (``check_precision``) the precision needs one it is not: fp16 needs
    CUDA."""
    wanted = cfg.training.device
    if wanted == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif wanted == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{source}: training.device=cuda but no CUDA device is visible")
    else:
        device = wanted
    if check_precision and cfg.training.precision == "fp16" and device != "cuda":
        raise ConfigError(f"{source}: training.precision=fp16 needs a CUDA device (use bf16 or fp32 on CPU)")
    return device


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


def deepspeed_config(cfg: Config, world_size: int, overrides: dict | None = None) -> dict:
    """The DeepSpeed config dict for ``cfg`` on ``world_size`` processes.

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
            and resolve_device(cfg, check_precision=False) == "cuda"
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


class NonFiniteGuard:
    """An optimizer mixin that clips by the global gradient norm and skips a step whose norm is
    not finite.

    Used only where DeepSpeed hands the bare optimizer the gradients (ZeRO stage 0 in fp32, see
    :func:`uses_stage0_guard`).  The norm is DeepSpeed's ``clip_grad_norm_`` with our mpu, so a
    replicated parameter is counted once per tensor-parallel group (its
    ``tensor_model_parallel`` flag) and split ones once per slice, exactly as ZeRO does.  The
    engine reads ``overflow`` (skip: gradients are zeroed, the schedule does not advance,
    ``skipped_steps`` counts it) and ``_global_grad_norm`` (``engine.get_global_grad_norm()``).
    """

    def __init__(self, params, *, max_grad_norm: float, mpu, **optimizer_kwargs):
        super().__init__(params, **optimizer_kwargs)
        self.max_grad_norm = max_grad_norm
        self.mpu = mpu
        self.overflow = False
        self._global_grad_norm: float | None = None

    @torch.no_grad()
    def step(self, closure=None):
        from deepspeed.runtime.utils import clip_grad_norm_

        with_grad = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        if not with_grad:  # nothing to do (and the norm helper needs one tensor)
            self.overflow, self._global_grad_norm = False, 0.0
            return super().step(closure)
        max_norm = self.max_grad_norm if self.max_grad_norm > 0 else math.inf
        # Collective over the model-parallel and data-parallel groups: every rank gets the same
        # norm, so every rank takes the same decision.
        norm = float(clip_grad_norm_(with_grad, max_norm=max_norm, mpu=self.mpu))
        self._global_grad_norm = norm
        self.overflow = not math.isfinite(norm)
        if self.overflow:
            return None
        return super().step(closure)


class NonFiniteGuardAdamW(NonFiniteGuard, torch.optim.AdamW):
    pass


class NonFiniteGuardSGD(NonFiniteGuard, torch.optim.SGD):
    pass


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
# ZeRO-1/2's step under bf16 without host synchronisations.
# --------------------------------------------------------------------------- #


def sync_free_zero_step(optimizer) -> bool:
    """Make the bf16 step of one ZeRO-1/2 optimizer (``DeepSpeedZeroOptimizer``) free of host
    synchronisations and of tensors built from Python data; True if it applied.

    DeepSpeed 0.19's step (``stage_1_and_2.py: step``) at bf16 without the overflow scan
    (``check_grad_overflow: False``, see :func:`deepspeed_config`) computes the global gradient
    norm, clips, runs our AdamW on each group's flat fp32 partition, copies it back to the bf16
    weights and all-gathers them over the data-parallel group. Two of its per-step helpers, called
    once per parameter group, wait for the device, and one launches a kernel per parameter:

    - ``get_grad_norm_direct``: one ``vector_norm`` of ``g.to(fp64)`` per gradient tensor (2 kernels
      per tensor), then ``mask_nan_or_inf_with_val_inplace``, whose ``torch.tensor(-1.0,
      device=...)`` is a blocking host-to-device copy. Replaced by :func:`_grad_norm_direct`: the
      same tensors (the model-parallel filter: split parameters on every TP rank, replicated ones
      on TP rank 0 only), one ``torch._foreach_norm`` in DeepSpeed's norm dtype, the same
      stack/pow/sum, all-reduces and root, and the NaN/inf -> -1 mask as a scalar ``masked_fill_``.
    - ``unscale_and_clip_grads``: ``is_invalid_grad_norm(norm)`` is ``bool(tensor)``, a device read
      (DeepSpeed then substitutes an infinite norm). Replaced by :func:`_unscale_and_clip_grads`:
      the substitution as a ``masked_fill`` on the device, then DeepSpeed's own arithmetic,
      ``clamp(((norm / scale) + 1e-6) / clip, min=1) * scale`` and ``grad.mul_(1 / that)``.

    Everything else is DeepSpeed's: the step, the partitioning, the optimizer state and its
    checkpoints (one format for every layout), the skip decision (under bf16 without the scan,
    ``overflow`` stays the Python ``False``, so ``engine.was_step_applied()`` reads no device
    value), and ``_global_grad_norm`` (a device tensor, read only on log lines).

    Numbers: on the CPU ``_foreach_norm`` runs ``vector_norm`` per tensor in the requested dtype,
    which is DeepSpeed's own computation: the weights are bit-identical (tested). On CUDA its
    multi-tensor kernel accumulates each tensor's sum of squares in fp32 (written as fp64) where
    DeepSpeed's ``vector_norm`` of the fp64 copy accumulates in fp64: a sum of ``n`` positive
    terms in fp32 is within ``n * u`` (``u = eps_fp32 / 2``) of the exact one, so the global norm
    differs from DeepSpeed's by a relative ``n * eps_fp32 / 2`` at most (half that on the root,
    plus the final roundings), ``n`` the element count of the largest gradient tensor. The norm
    reaches the weights only through the clip coefficient: a step that does not clip (the
    coefficient clamps to 1) gives DeepSpeed's weights bit for bit on CUDA too.

    Kernels (dispatched non-view operators of one ``engine.step()``, counted on the CPU) for
    configs/gpt2.yaml's Perceiver, bf16, DP=1, ZeRO-1 or 2 (217 trainable tensors, 89.9M
    parameters in two groups, decayed and not): 522 with DeepSpeed's helpers (221 casts to fp64
    and 218 ``vector_norm``: 2 per tensor), 94 with these. What is left, none per tensor: per
    group one ``_foreach_norm`` (on CUDA ``ceil(chunks / 320)`` multi-tensor launches of 65,536
    elements each, plus one cleanup), ~20 operators on 0-d tensors (norm, mask, combine, clip),
    the flat gradient's ``cat`` and fp32 cast, the unscale ``mul_``, AdamW (foreach on the CPU,
    ~8 operators per group; one ``_fused_adamw_`` per group on CUDA) and the fp32 -> bf16 copy;
    the all-reduces of the norm. Bytes per trainable parameter: 2 (norm) + 4 (cat, bf16) + 6
    (fp32 cast) + 8 (unscale) + 28 (fused AdamW: weights, gradient and both moments read, three
    written) + 6 (bf16 copy) = 54 B, ~1.2 ms at 4 TB/s for 89.9M parameters (1.7 ms for 129M),
    and ~85 launches (~0.4 ms at 5 us).

    Only for the bf16 ZeRO-1/2 optimizer without CPU offload: fp16 decides on its loss scale on
    the host by design; ZeRO-3 (``stage3.py``) keeps its own helpers (its norm's mask and its
    ``is_invalid_grad_norm`` skip check still synchronise), and ZeRO stage 0 under bf16 runs
    DeepSpeed's ``BF16_Optimizer``, whose norm and clip (``clip_tensors_by_global_norm``'s
    ``if clip_coef < 1``) also read the device. The methods are bound to this instance only.
    """
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if type(optimizer) is not DeepSpeedZeroOptimizer:
        return False
    if optimizer.dtype != torch.bfloat16 or optimizer.check_grad_overflow or optimizer.cpu_offload:
        return False
    optimizer.get_grad_norm_direct = MethodType(_grad_norm_direct, optimizer)
    optimizer.unscale_and_clip_grads = MethodType(_unscale_and_clip_grads, optimizer)
    return True


def _grad_norm_direct(self, gradients, params, norm_type=2):
    """DeepSpeedZeroOptimizer.get_grad_norm_direct (L2) with one multi-tensor norm and no host
    round trip; any other norm type goes to DeepSpeed's own."""
    from deepspeed import comm as dist
    from deepspeed.runtime.utils import is_model_parallel_parameter
    from deepspeed.runtime.zero.utils import get_norm_dtype

    if float(norm_type) != 2.0:
        return type(self).get_grad_norm_direct(self, gradients, params, norm_type)
    # DeepSpeed's selection: padding gradients dropped (zip then pairs the rest with their
    # parameters, as DeepSpeed's does: strict=False), a pipeline-replicated parameter not counted,
    # a replicated one counted on TP rank 0 only, a split one on every TP rank.
    unpadded = (g for g in gradients if not getattr(g, "_zero_padding", False))
    counted = [
        g.data
        for g, p in zip(unpadded, params, strict=False)
        if not getattr(p, "ds_pipe_replicated", False)
        and (is_model_parallel_parameter(p) or self.model_parallel_rank == 0)
    ]
    if counted:
        norms = torch._foreach_norm(counted, 2, dtype=get_norm_dtype())
        total = torch.stack(norms).to(self.device).pow(2.0).sum().float()
    else:  # nothing of this group is counted on this rank
        total = torch.zeros((), dtype=torch.float32, device=self.device)
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.dp_process_group)
    self._model_parallel_all_reduce(tensor=total, op=dist.ReduceOp.SUM)
    total = total.pow(0.5)
    return total.masked_fill_(~torch.isfinite(total), -1.0)  # DeepSpeed's "invalid" sentinel


def _unscale_and_clip_grads(self, grad_groups_flat, total_norm):
    """DeepSpeedZeroOptimizer.unscale_and_clip_grads with the invalid-norm test on the device."""
    if not torch.is_tensor(total_norm) or (self.clip_grad == 0.0 and self.loss_scale == 1.0):
        return type(self).unscale_and_clip_grads(self, grad_groups_flat, total_norm)
    combined_scale = self.loss_scale
    if self.clip_grad > 0.0:
        # An invalid norm (non-finite, or DeepSpeed's -1 sentinel) clips as an infinite one.
        clip_norm = total_norm.masked_fill(~torch.isfinite(total_norm) | (total_norm < 0), math.inf)
        clip = ((clip_norm / self.loss_scale) + 1e-6) / self.clip_grad
        combined_scale = torch.clamp(clip, min=1.0) * self.loss_scale
    for grad in grad_groups_flat:
        for g in grad if isinstance(grad, list) else [grad]:
            g.data.mul_(1.0 / combined_scale)


# --------------------------------------------------------------------------- #
# deepspeed.initialize
# --------------------------------------------------------------------------- #


@dataclass
class EngineBundle:
    engine: Any  # deepspeed.DeepSpeedEngine
    optimizer: Any  # what DeepSpeed made of our AdamW (a ZeRO wrapper, or the AdamW itself)
    lr_scheduler: torch.optim.lr_scheduler.LambdaLR
    config: dict  # the DeepSpeed config it runs with


def quiet_deepspeed_logs(level: int = logging.WARNING) -> None:
    """DeepSpeed logs its whole config and every bucket at INFO on every rank; keep warnings."""
    from deepspeed.utils import logger as ds_logger

    ds_logger.setLevel(level)


def skip_unused_cpu_comm_kernel() -> None:
    """On the CPU accelerator, keep DeepSpeed from JIT-compiling its shared-memory all-reduce
    kernel (``deepspeed_shm_comm``).

    DeepSpeed builds it when its communication backend starts, but only its *inference*
    all-reduce calls it; training collectives go through torch.distributed (gloo).  The build
    needs a C++ toolchain, takes tens of seconds on a small machine, holds a machine-wide lock
    that serialises every starting rank, and is redone whenever another environment sharing
    ~/.cache/torch_extensions builds it with other paths.  Marking the op incompatible makes
    DeepSpeed skip it, exactly as on a machine without a compiler.
    """
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu":
        return
    builder = accelerator.create_op_builder("ShareMemCommBuilder")
    if builder is not None:
        deepspeed.ops.__compatible_ops__[builder.NAME] = False


def initialize_engine(
    model: torch.nn.Module, cfg: Config, world_size: int, overrides: dict | None = None, mpu=None
) -> EngineBundle:
    """``deepspeed.initialize`` with the trainable parameters only, our AdamW and schedule, the
    config derived from ``cfg`` and the tensor/data-parallel ``mpu``.

    Process groups must exist first (:func:`parallel_latent.parallel.init_distributed`):
    DeepSpeed then adopts the default group instead of creating its own.
    """
    import deepspeed

    quiet_deepspeed_logs()
    skip_unused_cpu_comm_kernel()
    device = resolve_device(cfg)
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
    ds_config = deepspeed_config(cfg, world_size, overrides)
    # DeepSpeed would otherwise call set_device(LOCAL_RANK) itself, which is wrong under srun with
    # one GPU per task (every task sees its GPU as device 0): it follows our one device choice.
    device_args = None
    if device == "cuda":
        device_args = SimpleNamespace(device_rank=torch.cuda.current_device(), local_rank=int(os.environ["LOCAL_RANK"]))
    engine, ds_optimizer, _, ds_scheduler = deepspeed.initialize(
        args=device_args,
        model=model,
        model_parameters=trainable,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        config=ds_config,
        mpu=mpu,
        dist_init_required=False,
    )
    sync_free_zero_step(ds_optimizer)
    return EngineBundle(engine=engine, optimizer=ds_optimizer, lr_scheduler=ds_scheduler, config=ds_config)


def dump_deepspeed_config(config: dict) -> str:
    return json.dumps(config, indent=2, sort_keys=True)
