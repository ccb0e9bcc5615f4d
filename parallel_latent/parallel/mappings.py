"""Megatron's four autograd mappings between replicated and tensor-parallel regions.

Every one of them is the identity when the group has a single rank, so a TP=1 model pays nothing.
The collectives are looked up on ``torch.distributed`` at call time, which lets tests count them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .utils import group_rank, group_size


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    # In place: callers hand us a fresh tensor (a matmul output or an incoming gradient).
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


def _split_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    size, rank = group_size(group), group_rank(group)
    if x.shape[-1] % size != 0:
        raise ValueError(f"last dim {x.shape[-1]} is not divisible by tensor_parallel={size}")
    return x.chunk(size, dim=-1)[rank].contiguous()


def _gather_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    size = group_size(group)
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=-1)


class _CopyToTensorParallelRegion(torch.autograd.Function):
    """Identity forward; the input's gradient is a partial sum on each rank, so reduce it."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTensorParallelRegion(torch.autograd.Function):
    """All-reduce forward (sum of partial products); the gradient is already replicated."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last_dim(grad, ctx.group), None


class _GatherFromTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_last_dim(grad, ctx.group), None


def copy_to_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    return x if group_size(group) == 1 else _CopyToTensorParallelRegion.apply(x, group)


def reduce_from_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    return x if group_size(group) == 1 else _ReduceFromTensorParallelRegion.apply(x, group)


def scatter_to_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    return x if group_size(group) == 1 else _ScatterToTensorParallelRegion.apply(x, group)


def gather_from_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    return x if group_size(group) == 1 else _GatherFromTensorParallelRegion.apply(x, group)
