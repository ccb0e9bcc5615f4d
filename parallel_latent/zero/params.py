"""ZeRO parameter access: whole parameters and optimizer state under any ZeRO stage.

Inside a DeepSpeed engine a parameter is not simply ``param.data``: ZeRO-3 partitions it over DP
(``param.ds_tensor`` is this rank's flat piece), ZeRO-1/2 and the bf16 optimizer keep fp32 masters and
moments in flat partitions (a fragment mapping per parameter), and only ZeRO-0 in fp32 hands the
parameters to the torch optimizer as they are. The functions here take or give the *whole* tensor of
this TP rank. They rely on internals of the DeepSpeed releases of :data:`.version.SUPPORTED`, reached
through :mod:`.patches`, and :func:`.version.import_deepspeed` refuses any other release.
"""

import contextlib
from collections.abc import Iterable

import torch
import torch.distributed as dist

from parallel_latent.errors import CheckpointError

from .patches import has_zero_master, relink_optimizer_state
from .version import import_deepspeed

__all__ = [
    "ADAM_MOMENTS",
    "adam_step",
    "base_optimizer",
    "ensure_optimizer_state",
    "gathered",
    "is_zero3",
    "kept_moments",
    "local_shape",
    "moments_of",
    "plain_param",
    "set_master",
    "set_moment",
    "write_param",
]

ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")


def moments_of(kind: str) -> tuple[str, ...]:
    """The per-parameter state tensors of an optimizer of ``kind`` (a checkpoint records the class name)."""
    return ("momentum_buffer",) if "SGD" in kind else ADAM_MOMENTS


def kept_moments(engine, kind: str) -> tuple[str, ...]:
    """The per-parameter state tensors (:func:`moments_of` ``kind``) that ``engine``'s optimizer keeps:
    SGD without momentum (in every group, as the trainer builds it) keeps none."""
    optimizer = base_optimizer(engine)
    if isinstance(optimizer, torch.optim.SGD) and not any(g.get("momentum", 0) for g in optimizer.param_groups):
        return ()
    return moments_of(kind)


def is_zero3(param: torch.Tensor) -> bool:
    return hasattr(param, "ds_id")


def local_shape(tensor: torch.Tensor) -> tuple[int, ...]:
    """Shape of this TP rank's tensor (a ZeRO-3 parameter's ``shape`` is empty; ``ds_shape`` is not)."""
    return tuple(tensor.ds_shape) if is_zero3(tensor) else tuple(tensor.shape)


def gathered(params: Iterable[torch.Tensor]):
    """Make ZeRO-3 parameters whole for reading inside the block (collective over their DP group)."""
    zero3 = [p for p in params if is_zero3(p)]
    return import_deepspeed().zero.GatheredParameters(zero3, modifier_rank=None) if zero3 else contextlib.nullcontext()


def write_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set the model (low precision) copy of ``param`` to ``value``, this TP rank's whole tensor.
    Under ZeRO-3 each rank writes its own partition of the ``value`` all DP ranks hold: no communication."""
    with torch.no_grad():
        if is_zero3(param):
            partition, group = param.ds_tensor, param.ds_process_group
            world, rank, size = dist.get_world_size(group), dist.get_rank(group), partition.numel()
            if size * world < value.numel():
                raise CheckpointError(f"ZeRO-3 partition of {size} x {world} cannot hold {value.numel()} elements")
            piece = value.reshape(-1).to(partition.device, partition.dtype)[rank * size : (rank + 1) * size]
            partition.data.view(-1).zero_()
            partition.data.view(-1)[: piece.numel()].copy_(piece)
        else:
            param.data.copy_(value.to(param.device, param.dtype).view(param.shape))


def base_optimizer(engine) -> torch.optim.Optimizer:
    """The torch optimizer that owns the state (DeepSpeed wraps it under ZeRO and bf16/fp16)."""
    for optimizer in (getattr(engine.optimizer, "optimizer", None), engine.optimizer):
        if isinstance(optimizer, torch.optim.Optimizer):
            return optimizer
    raise CheckpointError(f"cannot find the torch optimizer inside {type(engine.optimizer).__name__}")


def adam_step(state: dict) -> int | None:
    """Adam's step count in one parameter's (or flat group's) state; None before the first step."""
    step = state.get("step")
    return None if step is None else int(step.item() if torch.is_tensor(step) else step)


def plain_param(engine, param: torch.Tensor) -> bool:
    """ZeRO-0 in fp32: the torch optimizer steps the model's own parameters."""
    if is_zero3(param) or has_zero_master(param):
        return False
    if engine.optimizer is base_optimizer(engine):
        return True
    raise CheckpointError(
        f"{type(engine.optimizer).__name__} (ZeRO-0 with fp16) keeps master weights that "
        "this code cannot address; use ZeRO >= 1 or bf16/fp32"
    )


def _stepped_tensors(engine, optimizer) -> list[tuple[dict, torch.Tensor]]:
    """(param group, tensor) for every tensor the torch optimizer steps. ZeRO-3 swaps its flat fp32
    sub-groups into the param group only for the duration of a step, so they are listed here."""
    sub_groups = getattr(engine.optimizer, "fp32_partitioned_groups_flat", None)
    if sub_groups is not None:
        group_of = getattr(engine.optimizer, "sub_group_to_group_id", {})
        return [(optimizer.param_groups[group_of.get(i, 0)], flat) for i, flat in enumerate(sub_groups)]
    return [(group, flat) for group in optimizer.param_groups for flat in group["params"]]


def ensure_optimizer_state(engine, step: int) -> None:
    """Create the optimizer's state where it has none yet (Adam's zero moments and ``step``, SGD's
    zero momentum) and link DeepSpeed's per-parameter views of it: torch creates it at the first
    step, so a resumed run would use zeros instead of the loaded state. (SGD's first step makes the
    buffer the gradient itself, which equals momentum x 0 + gradient without dampening.)"""
    optimizer = base_optimizer(engine)
    sgd = isinstance(optimizer, torch.optim.SGD)  # subclasses too
    if not sgd and not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        raise CheckpointError(f"resharded optimizer state supports Adam, AdamW and SGD, not {type(optimizer).__name__}")
    for group, flat in _stepped_tensors(engine, optimizer):
        if sgd:
            if group.get("momentum", 0) and "momentum_buffer" not in optimizer.state[flat]:
                optimizer.state[flat]["momentum_buffer"] = torch.zeros_like(flat, memory_format=torch.preserve_format)
            continue
        state = optimizer.state[flat]
        if not state:
            for key in (*ADAM_MOMENTS, "max_exp_avg_sq") if group.get("amsgrad") else ADAM_MOMENTS:
                state[key] = torch.zeros_like(flat, memory_format=torch.preserve_format)
        # torch keeps the step as a float32 tensor on the CPU unless capturable/fused.
        device = flat.device if (group.get("capturable") or group.get("fused")) else "cpu"
        like = state["step"] if torch.is_tensor(state.get("step")) else torch.tensor(0.0, device=device)
        state["step"] = torch.tensor(float(step), dtype=like.dtype, device=like.device)
    relink_optimizer_state(engine.optimizer)


def _fp32_local(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    device = param.ds_tensor.device if is_zero3(param) else param.device
    return value.to(device, torch.float32).reshape(local_shape(param))


def set_master(engine, param: torch.Tensor, value: torch.Tensor) -> None:
    """Set the fp32 master weight and the model copy of ``param`` (no communication)."""
    write_param(param, value)
    if not plain_param(engine, param):
        import_deepspeed().utils.safe_set_full_fp32_param(param, _fp32_local(param, value))


def set_moment(engine, param: torch.Tensor, key: str, value: torch.Tensor) -> None:
    """Set optimizer state ``key`` of ``param``, after :func:`ensure_optimizer_state`."""
    if plain_param(engine, param):
        base_optimizer(engine).state[param][key].copy_(value.view(param.shape))
    else:
        import_deepspeed().utils.safe_set_full_optimizer_state(param, _fp32_local(param, value), key)
