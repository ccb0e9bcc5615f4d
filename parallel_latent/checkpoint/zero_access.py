"""DeepSpeed's side of checkpoints: whole parameters and optimizer state under any ZeRO stage, and
DeepSpeed's own files read without running pickled code.

Inside a DeepSpeed engine a parameter is not simply ``param.data``: ZeRO-3 partitions it over DP
(``param.ds_tensor`` is this rank's flat piece), ZeRO-1/2 and the bf16 optimizer keep fp32 masters and
moments in flat partitions (a fragment mapping per parameter), and only ZeRO-0 in fp32 hands the
parameters to the torch optimizer as they are. The functions here take or give the *whole* tensor of
this TP rank. They rely on internals of DeepSpeed 0.19 (as :mod:`.universal` does), reached through
:mod:`parallel_latent.deepspeed_patches`, and :func:`import_deepspeed` refuses any other release.
"""

import contextlib
import copy
import io
import pickle
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from parallel_latent import deepspeed_patches

from .layout import CheckpointError, attempt

ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")


def moments_of(kind: str) -> tuple[str, ...]:
    """The per-parameter state tensors of an optimizer of ``kind`` (a checkpoint records the class name)."""
    return ("momentum_buffer",) if "SGD" in kind else ADAM_MOMENTS


# The DeepSpeed series whose private checkpoint keys and classes this code reads (pyproject.toml).
SUPPORTED_DEEPSPEED = deepspeed_patches.SUPPORTED[0][:2]


def import_deepspeed():
    import deepspeed

    if tuple(int(part) for part in deepspeed.__version__.split(".")[:2]) != SUPPORTED_DEEPSPEED:
        major, minor = SUPPORTED_DEEPSPEED
        raise CheckpointError(
            f"DeepSpeed {deepspeed.__version__} is installed, but checkpoints read DeepSpeed's private keys "
            f"of the {major}.{minor} series: pip install 'deepspeed>={major}.{minor},<{major}.{minor + 1}'"
        )
    return deepspeed


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
    if is_zero3(param) or deepspeed_patches.has_zero_master(param):
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
    deepspeed_patches.relink_optimizer_state(engine.optimizer)


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


def safe_torch_load(path: str | Path, map_location=None):
    """``torch.load(weights_only=True)`` with DeepSpeed's allowlist; a file that needs anything
    else raises :class:`CheckpointError` naming the offending global instead of being unpickled."""
    import_deepspeed()
    # The DeepSpeed types in its checkpoint files: plain data holders whose unpickling runs no code
    # of theirs beyond setting attributes or building an enum/namedtuple.
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    try:
        with torch.serialization.safe_globals([LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]):
            return torch.load(path, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file missing") from None
    except (pickle.UnpicklingError, RuntimeError, AttributeError, TypeError) as error:
        lines = str(error).splitlines() or [type(error).__name__]
        detail = next((line.strip() for line in lines if "global" in line.lower()), lines[0])
        raise CheckpointError(f"{path}: refused to load with weights_only=True ({detail[:300]})") from None


def weights_only_loading(engine):
    """Route DeepSpeed's checkpoint reads through :func:`safe_torch_load` (its own engine calls
    ``torch.load(weights_only=False)``)."""
    return deepspeed_patches.checkpoint_reads(
        engine, lambda path, map_location=None: safe_torch_load(path, map_location)
    )


class _ErrnoFile(io.FileIO):
    """An unbuffered file that keeps the first OSError of its writes (torch.save's zip writer turns
    it into an opaque RuntimeError) and writes every byte it is given, or raises."""

    error: OSError | None = None

    def write(self, data) -> int:
        view, done = memoryview(data).cast("B"), 0
        try:
            while done < len(view):
                done += super().write(view[done:])
        except OSError as error:
            self.error = self.error or error
            raise
        return done


def _save_keeping_errno(state_dict, path: str, zipfile: bool) -> None:
    """DeepSpeed's ``TorchCheckpointEngine.save``, with the OS's reason for a failed write kept."""
    with _ErrnoFile(path, "wb") as handle:
        try:
            torch.save(state_dict, handle, _use_new_zipfile_serialization=zipfile)
        except RuntimeError as error:
            raise handle.error or error from None


class HostCopies:
    """Host memory a background save copies the training state into, kept for the next save. A
    fresh buffer costs a page fault per page on its first touch, most of a copy's time on a CPU
    (a copy into a buffer already touched runs 3-4x faster), and on CUDA a copy into pageable
    memory is slow: so each slot (a place in the checkpoint: a file and a key path) keeps its
    buffer, pinned where the tensor is on a GPU. Within one save, tensors that view the same memory
    the same way (a tied weight under two names, the module's weights in DeepSpeed's file and in the
    portable one) are copied once, into one tensor: torch.save writes it once. One save at a time
    uses them: the trainer waits for a save before it starts the next."""

    def __init__(self):
        self._slots: dict[tuple, torch.Tensor] = {}
        self._taken: dict[tuple, torch.Tensor] = {}

    def begin(self) -> None:
        """A new save: nothing of it copied yet (the buffers stay)."""
        self._taken = {}

    def copy(self, tensor: torch.Tensor, slot: tuple) -> torch.Tensor:
        source = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
                  tensor.stride(), tensor.dtype, tensor.device)  # fmt: skip
        if source in self._taken:
            return self._taken[source]
        buffer = self._slots.get(slot)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            pinned = tensor.is_cuda and torch.cuda.is_available()
            buffer = self._slots[slot] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pinned)
        buffer.copy_(tensor.detach())
        self._taken[source] = buffer
        return buffer


def snapshot(value: Any, copies: HostCopies, slot: tuple = ()) -> Any:
    """A copy of ``value`` that later training steps cannot change: tensors copied to host memory
    (``copies``, each at its ``slot``: the path of keys to it), containers rebuilt, anything else
    deep-copied (DeepSpeed's state dicts hold small Python objects, such as its parameter groups'
    settings, beside the tensors)."""
    if isinstance(value, torch.Tensor):
        return copies.copy(value, slot)
    if isinstance(value, dict):
        copied = copy.copy(value)  # the same kind of mapping (an OrderedDict, a defaultdict and its factory)
        for key, item in value.items():
            copied[key] = snapshot(item, copies, (*slot, key))
        return copied
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        return type(value)(*(snapshot(item, copies, (*slot, i)) for i, item in enumerate(value)))
    if isinstance(value, (list, tuple)):
        return type(value)(snapshot(item, copies, (*slot, i)) for i, item in enumerate(value))
    return copy.deepcopy(value)


def deferred_writes(engine, failures: list[str], jobs: list, copies: HostCopies | None = None):
    """Inside the block, each file DeepSpeed's save writes becomes a job appended to ``jobs`` (its
    state taken now with ``copies``: a :func:`snapshot`, so training may go on), and a write it
    fails (a directory, the recovery script) appends the reason to ``failures`` instead of raising,
    so that DeepSpeed's save still reaches the barriers the other ranks wait at."""

    def save(state_dict, path: str, zipfile: bool) -> None:
        state = snapshot(state_dict, copies, (Path(path).name,)) if copies is not None else state_dict
        jobs.append(lambda: _save_keeping_errno(state, path, zipfile))

    def recorded(write):
        return lambda *args, **kwargs: attempt(failures, lambda: write(*args, **kwargs))

    return deepspeed_patches.checkpoint_writes(engine, save, recorded)
