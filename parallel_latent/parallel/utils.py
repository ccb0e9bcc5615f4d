"""Small arithmetic shared by the tensor-parallel layers."""

from __future__ import annotations

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
