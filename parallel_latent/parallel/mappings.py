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


# Sequence parallelism: between the TP regions every rank holds a contiguous 1/t of the positions
# (dim 1 of [B, T, d]); rank r holds positions [r * T/t, (r + 1) * T/t).


def _all_gather_single(output, x, group, async_op):
    # torch 2.13 renamed all_gather_into_tensor (the old name warns at every call); looked up at call
    # time so that tests can count it.
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, x, group=group, async_op=async_op)


def _reduce_scatter_single(output, x, group, async_op):
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, x, group=group, async_op=async_op)


def gather_along_sequence(x: torch.Tensor, group, async_op: bool = False):
    """[B, n, ...] on every rank -> [B, t * n, ...], rank-major: one all-gather. With ``async_op``
    returns (work handle, a function that finishes the result once the handle is waited on)."""
    size = group_size(group)
    x = x.contiguous()
    flat = x.new_empty((size * x.shape[0], *x.shape[1:]))  # the ranks' tensors one after the other
    work = _all_gather_single(flat, x, group, async_op)

    def finish() -> torch.Tensor:
        ranks = flat.view(size, *x.shape)
        return ranks.movedim(0, 1).reshape(x.shape[0], size * x.shape[1], *x.shape[2:])

    return (work, finish) if async_op else finish()


def reduce_scatter_along_sequence(x: torch.Tensor, group, async_op: bool = False):
    """[B, t * n, ...] partial sums on every rank -> this rank's [B, n, ...] of the sum: one
    reduce-scatter. With ``async_op`` returns (work handle, the output to read after waiting)."""
    size = group_size(group)
    if x.shape[1] % size != 0:
        raise ValueError(f"sequence length {x.shape[1]} is not divisible by tensor_parallel={size}")
    n = x.shape[1] // size
    # Rank r's positions first for rank 0, ...: [t * B, n, ...], as the collective splits dim 0.
    chunks = x.reshape(x.shape[0], size, n, *x.shape[2:]).movedim(1, 0).reshape(size * x.shape[0], n, *x.shape[2:])
    out = x.new_empty((x.shape[0], n, *x.shape[2:]))
    work = _reduce_scatter_single(out, chunks.contiguous(), group, async_op)
    return (work, out) if async_op else out


def split_along_sequence(x: torch.Tensor, group) -> torch.Tensor:
    size, rank = group_size(group), group_rank(group)
    if x.shape[1] % size != 0:
        raise ValueError(f"sequence length {x.shape[1]} is not divisible by tensor_parallel={size}")
    n = x.shape[1] // size
    return x[:, rank * n : (rank + 1) * n]


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    """All-gather along the sequence forward; the gradient is a partial sum of the full sequence
    on each rank, so backward reduce-scatters it."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return gather_along_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_along_sequence(grad, ctx.group), None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """Reduce-scatter along the sequence forward (sum of partial products, each rank keeps its
    positions); backward all-gathers the positions' gradients."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_along_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return gather_along_sequence(grad, ctx.group), None


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    """A replicated tensor cut to this rank's positions; backward all-gathers the gradient so the
    replicated computation before it sees every position's."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split_along_sequence(x, group).contiguous()

    @staticmethod
    def backward(ctx, grad):
        return gather_along_sequence(grad, ctx.group), None


def gather_from_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    return x if group_size(group) == 1 else _GatherFromSequenceParallelRegion.apply(x, group)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    return x if group_size(group) == 1 else _ReduceScatterToSequenceParallelRegion.apply(x, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    return x if group_size(group) == 1 else _ScatterToSequenceParallelRegion.apply(x, group)


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


def copy_to_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    return x if group_size(group) == 1 else _CopyToTensorParallelRegion.apply(x, group)


def reduce_from_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    return x if group_size(group) == 1 else _ReduceFromTensorParallelRegion.apply(x, group)


def with_gradients_summed_together(params: list[torch.Tensor], group) -> list[torch.Tensor]:
    """``params`` (replicated over ``group``, used on this rank's positions only: sequence
    parallelism) as tensors of the same values whose gradients are summed over the group in **one**
    all-reduce of a flat buffer, before they reach the parameters, instead of one per parameter
    (:func:`.utils.mark_sequence_parallel`'s hooks). For small parameters used together, where each
    all-reduce costs its latency, not its bytes. Mark them with ``mark_sequence_parallel(...,
    summed_by_caller=True)``; the flat copy costs one small copy of them per forward."""
    if group_size(group) == 1 or not params:
        return list(params)
    flat = copy_to_tp_region(torch.cat([param.reshape(-1) for param in params]), group)
    pieces = flat.split([param.numel() for param in params])
    return [piece.view_as(param) for piece, param in zip(pieces, params, strict=True)]


@torch.no_grad()
def split_batch_and_gather(fn, inputs: tuple[torch.Tensor, ...], group) -> torch.Tensor:
    """``fn(*inputs)`` for a batch that every rank of ``group`` holds, computed once: each rank runs
    ``fn`` on its 1/t of the rows and one all-gather assembles the result on every rank (so the
    ranks hold the same bits). For frozen work only: no autograd graph, nothing in backward.

    A batch that does not split evenly is padded with copies of its last row (their results are
    dropped): every rank runs the same shapes and the all-gather stays a single collective."""
    size, rank = group_size(group), group_rank(group)
    if size == 1:
        return fn(*inputs)
    rows = inputs[0].shape[0]
    per_rank = -(-rows // size)
    padded = []
    for tensor in inputs:
        if per_rank * size != rows:
            filler = tensor[-1:].expand(per_rank * size - rows, *tensor.shape[1:])
            tensor = torch.cat([tensor, filler])
        padded.append(tensor[rank * per_rank : (rank + 1) * per_rank])
    local = fn(*padded).contiguous()
    gathered = local.new_empty((size * per_rank, *local.shape[1:]))
    _all_gather_single(gathered, local, group, async_op=False)
    return gathered[:rows]
