"""DeepSpeed's engine: ``deepspeed.initialize`` with the patches that apply to it, its logs kept to
warnings, the ZeRO-3 registration of parameters a module reads but does not own, and the optimizer
guard for the one layout where the engine hands a bare torch optimizer the gradients.

What the engine is given (the DeepSpeed config derived from our YAML, the optimizer, the schedule)
is the trainer's: :mod:`parallel_latent.training.engine_setup`.
"""

from __future__ import annotations

import logging
import math
import os
from types import SimpleNamespace

import torch
from torch import nn

from .params import is_zero3
from .patches import (
    bulk_zero_gradients,
    report_grad_norm,
    skip_unused_cpu_comm_kernel,
    sync_free_zero_step,
    zero_optimizer_check_without_muon,
)

__all__ = [
    "NonFiniteGuard",
    "NonFiniteGuardAdamW",
    "NonFiniteGuardSGD",
    "initialize",
    "quiet_deepspeed_logs",
    "register_borrowed_parameters",
]


class NonFiniteGuard:
    """An optimizer mixin that clips by the global gradient norm and skips a step whose norm is
    not finite.

    Used only where DeepSpeed hands the bare optimizer the gradients (ZeRO stage 0 in fp32, see
    :func:`parallel_latent.training.engine_setup.uses_stage0_guard`).  The norm is DeepSpeed's
    ``clip_grad_norm_`` with our mpu, so a replicated parameter is counted once per tensor-parallel
    group (its ``tensor_model_parallel`` flag) and split ones once per slice, exactly as ZeRO does.
    The engine reads whether it skipped (gradients are zeroed, the schedule does not advance,
    ``skipped_steps`` counts it) and the norm (``engine.get_global_grad_norm()``), as
    :func:`.patches.report_grad_norm` tells it.
    """

    def __init__(self, params, *, max_grad_norm: float, mpu, **optimizer_kwargs):
        super().__init__(params, **optimizer_kwargs)
        self.max_grad_norm = max_grad_norm
        self.mpu = mpu
        report_grad_norm(self, None, overflow=False)

    @torch.no_grad()
    def step(self, closure=None):
        from deepspeed.runtime.utils import clip_grad_norm_

        with_grad = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        if not with_grad:  # nothing to do (and the norm helper needs one tensor)
            report_grad_norm(self, 0.0, overflow=False)
            return super().step(closure)
        max_norm = self.max_grad_norm if self.max_grad_norm > 0 else math.inf
        # Collective over the model-parallel and data-parallel groups: every rank gets the same
        # norm, so every rank takes the same decision.
        norm = float(clip_grad_norm_(with_grad, max_norm=max_norm, mpu=self.mpu))
        report_grad_norm(self, norm, overflow=not math.isfinite(norm))
        if self.overflow:
            return None
        return super().step(closure)


class NonFiniteGuardAdamW(NonFiniteGuard, torch.optim.AdamW):
    pass


class NonFiniteGuardSGD(NonFiniteGuard, torch.optim.SGD):
    pass


def register_borrowed_parameters(model: nn.Module) -> None:
    """Have ZeRO-3 gather, for the forward and backward of each module of ``model`` that declares
    ``borrowed_parameters()`` (the parameters it reads but another module owns), those parameters too.

    ZeRO-3 partitions every parameter and gathers one only around the forward and backward of the
    module that owns it, so DeepSpeed must be told that the borrowing module uses it as well. The
    registration runs in a forward pre-hook put first (before DeepSpeed's own pre-forward hook,
    whenever that is registered), and only for a parameter DeepSpeed has converted already."""
    for module in model.modules():
        if callable(getattr(module, "borrowed_parameters", None)):
            module.register_forward_pre_hook(_register_borrowed, prepend=True)


def _register_borrowed(module: nn.Module, args) -> None:
    for param in module.borrowed_parameters():
        if is_zero3(param) and id(param) not in getattr(module, "_external_params", {}):
            import deepspeed  # converted by DeepSpeed: it is imported already

            deepspeed.zero.register_external_parameter(module, param)


def quiet_deepspeed_logs(level: int = logging.WARNING) -> None:
    """DeepSpeed logs its whole config and every bucket at INFO on every rank; keep warnings."""
    from deepspeed.utils import logger as ds_logger

    ds_logger.setLevel(level)


def initialize(
    model: nn.Module, trainable: list, optimizer, scheduler, config: dict, mpu, *, device: str, bulk_gradients: bool
):
    """``deepspeed.initialize`` of ``model`` with the ``trainable`` parameters, ``optimizer`` and
    ``scheduler``, the DeepSpeed ``config`` and the tensor/data-parallel ``mpu``, on ``device``;
    then the sync-free ZeRO-1/2 step and, with ``bulk_gradients``, ZeRO-1/2's gradients in bulk.
    Returns (engine, what DeepSpeed made of the optimizer, the scheduler).

    Process groups must exist first (:func:`parallel_latent.parallel.init_distributed`):
    DeepSpeed then adopts the default group instead of creating its own.
    """
    import deepspeed

    quiet_deepspeed_logs()
    skip_unused_cpu_comm_kernel()
    if config.get("zero_optimization", {}).get("stage") == 3:
        register_borrowed_parameters(model)
    # DeepSpeed would otherwise call set_device(LOCAL_RANK) itself, which is wrong under srun with
    # one GPU per task (every task sees its GPU as device 0): it follows our one device choice.
    device_args = None
    if device == "cuda":
        device_args = SimpleNamespace(device_rank=torch.cuda.current_device(), local_rank=int(os.environ["LOCAL_RANK"]))
    with zero_optimizer_check_without_muon():
        engine, ds_optimizer, _, ds_scheduler = deepspeed.initialize(
            args=device_args,
            model=model,
            model_parameters=trainable,
            optimizer=optimizer,
            lr_scheduler=scheduler,
            config=config,
            mpu=mpu,
            dist_init_required=False,
        )
    sync_free_zero_step(ds_optimizer)
    if bulk_gradients:
        bulk_zero_gradients(ds_optimizer)
    return engine, ds_optimizer, ds_scheduler
