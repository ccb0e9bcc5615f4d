"""Small arithmetic shared by the tensor-parallel layers."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


def group_size(group) -> int:
    """Size of a tensor-parallel group; ``None`` means "no tensor parallelism"."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def divide(numerator: int, denominator: int, what: str = "value") -> int:
    if numerator % denominator != 0:
        raise ValueError(f"{what}={numerator} is not divisible by tensor_parallel={denominator}")
    return numerator // denominator


def partition_ranges(full_size: int, local_size: int, tp_rank: int, stride: int = 1) -> list[tuple[int, int, int]]:
    """The ranges ``[start, stop)`` of a split dim of ``full_size`` that ``tp_rank`` holds, each with
    where it starts among the rank's ``local_size``. With ``stride`` s (Megatron's
    ``partition_stride``) the dim is s equal parts split alike (GPT-2's q, k and v side by side): the
    rank holds its 1/tp of each part, one after the other. A range stops at the full size: rows past
    it are padding (the vocabulary head), which only an unstrided dim has."""
    part, per_part = full_size // stride, local_size // stride
    ranges = []
    for j in range(stride):
        start = min(j * part + tp_rank * per_part, (j + 1) * part)
        ranges.append((start, min(start + per_part, (j + 1) * part), j * per_part))
    return ranges


def pad_vocab_size(vocab_size: int, tp_size: int, multiple: int = 128) -> int:
    """Pad so every TP rank holds the same number of rows and the GEMM stays aligned."""
    step = multiple * tp_size
    return ((vocab_size + step - 1) // step) * step


def set_tensor_parallel_attributes(
    param: torch.Tensor, is_parallel: bool, partition_dim: int | None, stride: int = 1
) -> None:
    """The flags Megatron and DeepSpeed read: they keep replicated parameters from being counted
    once per TP rank in the gradient norm, and tell checkpoints how to reshard."""
    param.tensor_model_parallel = is_parallel
    param.partition_dim = partition_dim if is_parallel else None
    param.partition_stride = stride


def mark_replicated(module: torch.nn.Module) -> None:
    """Flag every parameter of ``module`` that has no TP flags yet as replicated."""
    for param in module.parameters():
        if not hasattr(param, "tensor_model_parallel"):
            set_tensor_parallel_attributes(param, False, None)


def mark_sequence_parallel(param: torch.nn.Parameter, group, summed_by_caller: bool = False) -> None:
    """``param`` is replicated over the TP group but used on each rank's positions only (a
    LayerNorm or bias between the regions, under sequence parallelism): each rank's gradient is a
    partial sum over its positions. A hook sums the incoming gradient over the group before it is
    accumulated, so the optimizer (and ZeRO's reduction, which reads the accumulated gradient at any
    stage) sees the whole gradient, the same on every rank. One small all-reduce per such parameter
    per backward. ``summed_by_caller``: no hook, the model uses the parameter through
    :func:`.mappings.with_gradients_summed_together` (one all-reduce for several)."""
    param.sequence_parallel = True
    if summed_by_caller or group_size(group) == 1 or getattr(param, "_sequence_parallel_hook", None) is not None:
        return

    def sum_over_group(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()  # the incoming gradient may be shared with other consumers
        dist.all_reduce(grad, group=group)
        return grad

    param._sequence_parallel_hook = param.register_hook(sum_over_group)


@dataclass(frozen=True)
class TensorParallelOptions:
    """How the TP regions of a model communicate; neither option changes its parameters, so a
    checkpoint saved with one setting loads with the other."""

    sequence_parallel: bool = False  # 1/tp of the positions per rank between the regions
    overlap_comm: bool = True  # the column-parallel backward overlaps its input-gradient collective

    def active(self, group) -> TensorParallelOptions:
        """These options as they apply to ``group`` (nothing to split at TP=1): resolved once, by
        whoever builds the model, and passed whole to every layer."""
        return TensorParallelOptions(self.sequence_parallel and group_size(group) > 1, self.overlap_comm)


SINGLE_PROCESS = TensorParallelOptions()
