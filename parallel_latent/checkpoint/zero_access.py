"""Reading and writing whole parameters, master weights and Adam moments under any ZeRO stage.

Inside a DeepSpeed engine a parameter is not simply ``param.data``:

* ZeRO-3 partitions every parameter over the data-parallel group (``param.ds_tensor`` holds this
  rank's flat piece; ``param.data`` is empty);
* ZeRO-1/2 (and the bf16 optimizer) keep fp32 master weights and Adam moments in flat partitions,
  reachable per parameter through ``param._hp_mapping``;
* ZeRO-0 in fp32 hands the parameters to the torch optimizer as they are.

Everything here returns or accepts the *whole* tensor of this tensor-parallel rank (gathered over
data parallelism). The ``get_*`` functions are collective over the data-parallel group under ZeRO:
every rank must call them for the same parameters in the same order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch
import torch.distributed as dist

from .errors import CheckpointError

ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")


def is_zero3(param: torch.Tensor) -> bool:
    return hasattr(param, "ds_id")


def has_hp_mapping(param: torch.Tensor) -> bool:
    # The attribute exists (possibly None) on every parameter that ZeRO-1/2 or the bf16 optimizer
    # manages; None only means this rank owns no fragment of it, yet it still joins the all-reduce.
    return hasattr(param, "_hp_mapping")


def local_shape(tensor: torch.Tensor) -> tuple[int, ...]:
    """Shape of this TP rank's tensor (a ZeRO-3 parameter's ``shape`` is empty; ``ds_shape`` is not)."""
    return tuple(tensor.ds_shape) if is_zero3(tensor) else tuple(tensor.shape)


@contextlib.contextmanager
def gathered(params: Iterable[torch.Tensor]):
    """Make ZeRO-3 parameters whole for reading inside the block (collective over their DP group)."""
    zero3 = [p for p in params if is_zero3(p)]
    if not zero3:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(zero3, modifier_rank=None):
        yield


def write_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set the model (low precision) copy of ``param`` to ``value`` (this TP rank's whole tensor).

    Under ZeRO-3 each rank writes only its own flat partition: every rank of the DP group holds the
    same ``value``, so no communication is needed.
    """
    with torch.no_grad():
        if is_zero3(param):
            partition = param.ds_tensor
            world = dist.get_world_size(param.ds_process_group)
            rank = dist.get_rank(param.ds_process_group)
            size = partition.numel()
            if size * world < value.numel():
                raise CheckpointError(f"ZeRO-3 partition of {size} x {world} cannot hold {value.numel()} elements")
            flat = value.reshape(-1).to(partition.device, partition.dtype)
            piece = flat[rank * size : (rank + 1) * size]
            partition.data.view(-1).zero_()
            partition.data.view(-1)[: piece.numel()].copy_(piece)
        else:
            param.data.copy_(value.to(param.device, param.dtype).view(param.shape))


def base_optimizer(engine) -> torch.optim.Optimizer:
    """The torch optimizer that owns the Adam state (DeepSpeed wraps it under ZeRO and bf16/fp16)."""
    optimizer = engine.optimizer
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer):
        return inner
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    raise CheckpointError(f"cannot find the torch optimizer inside {type(optimizer).__name__}")


def _check_adam(engine) -> torch.optim.Optimizer:
    optimizer = base_optimizer(engine)
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        raise CheckpointError(f"resharded optimizer state supports Adam/AdamW, not {type(optimizer).__name__}")
    return optimizer


def _plain_param(engine, param: torch.Tensor) -> bool:
    """ZeRO-0 in fp32: the torch optimizer steps the model's own parameters."""
    if is_zero3(param) or has_hp_mapping(param):
        return False
    if engine.optimizer is base_optimizer(engine):
        return True
    raise CheckpointError(
        f"{type(engine.optimizer).__name__} (ZeRO-0 with fp16) keeps master weights that "
        "this code cannot address; use ZeRO >= 1 or bf16/fp32"
    )


def get_master(engine, param: torch.Tensor) -> torch.Tensor:
    """The fp32 master weight of ``param`` (whole, this TP rank's)."""
    if _plain_param(engine, param):
        return param.detach().float().clone()
    from deepspeed.utils import safe_get_full_fp32_param

    return safe_get_full_fp32_param(param).detach().float().cpu().reshape(local_shape(param))


def optimizer_has_state(engine) -> bool:
    return any(len(state) for state in base_optimizer(engine).state.values())


def get_moment(engine, param: torch.Tensor, key: str) -> torch.Tensor:
    """Adam moment ``key`` of ``param`` (zeros before the first step, when Adam has no state yet)."""
    if not optimizer_has_state(engine):
        return torch.zeros(local_shape(param), dtype=torch.float32)
    if _plain_param(engine, param):
        state = base_optimizer(engine).state.get(param, {})
        value = state.get(key)
        return torch.zeros(local_shape(param)) if value is None else value.detach().float().cpu().clone()
    from deepspeed.utils import safe_get_full_optimizer_state

    return safe_get_full_optimizer_state(param, key).detach().float().cpu().reshape(local_shape(param))


def get_step(engine) -> int:
    """Adam's step count (0 before the first step)."""
    for state in base_optimizer(engine).state.values():
        if "step" in state:
            step = state["step"]
            return int(step.item() if torch.is_tensor(step) else step)
    return 0


def _stepped_tensors(engine, optimizer) -> list[tuple[dict, torch.Tensor]]:
    """(param group, tensor) for every tensor the torch optimizer steps. ZeRO-3 swaps its flat fp32
    sub-groups into the param group only for the duration of a step, so they are listed here."""
    sub_groups = getattr(engine.optimizer, "fp32_partitioned_groups_flat", None)
    if sub_groups is not None:
        group_of = getattr(engine.optimizer, "sub_group_to_group_id", {})
        return [(optimizer.param_groups[group_of.get(i, 0)], flat) for i, flat in enumerate(sub_groups)]
    return [(group, flat) for group in optimizer.param_groups for flat in group["params"]]


def ensure_optimizer_state(engine, step: int) -> None:
    """Create Adam's state (zero moments, the given step) where the optimizer has none yet, and set
    every entry's step; under ZeRO-1/2 also link the per-parameter views DeepSpeed reads and writes.

    torch's Adam creates its state lazily at the first step; a resumed run must have it before that
    step so the loaded moments are used, not zeros."""
    optimizer = _check_adam(engine)
    for group, flat in _stepped_tensors(engine, optimizer):
        state = optimizer.state[flat]
        if not state:
            state["exp_avg"] = torch.zeros_like(flat, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(flat, memory_format=torch.preserve_format)
            if group.get("amsgrad"):
                state["max_exp_avg_sq"] = torch.zeros_like(flat, memory_format=torch.preserve_format)
        previous = state.get("step")
        if torch.is_tensor(previous):
            state["step"] = torch.tensor(float(step), dtype=previous.dtype, device=previous.device)
        else:
            # torch keeps the step as a float32 tensor on the CPU unless capturable/fused.
            device = flat.device if (group.get("capturable") or group.get("fused")) else "cpu"
            state["step"] = torch.tensor(float(step), dtype=torch.float32, device=device)
    link = getattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state", None)
    if link is not None:
        engine.optimizer._hp_optimizer_states_linked = False
        link()


def set_master(engine, param: torch.Tensor, value: torch.Tensor) -> None:
    """Set the fp32 master weight and the model copy of ``param`` (no communication)."""
    write_param(param, value)
    if _plain_param(engine, param):
        return
    from deepspeed.utils import safe_set_full_fp32_param

    device = param.ds_tensor.device if is_zero3(param) else param.device
    safe_set_full_fp32_param(param, value.to(device, torch.float32).reshape(local_shape(param)))


def set_moment(engine, param: torch.Tensor, key: str, value: torch.Tensor) -> None:
    """Set Adam moment ``key`` of ``param``; call :func:`ensure_optimizer_state` first."""
    if _plain_param(engine, param):
        base_optimizer(engine).state[param][key].copy_(value.view(param.shape))
        return
    from deepspeed.utils import safe_set_full_optimizer_state

    device = param.ds_tensor.device if is_zero3(param) else param.device
    safe_set_full_optimizer_state(param, value.to(device, torch.float32).reshape(local_shape(param)), key)
