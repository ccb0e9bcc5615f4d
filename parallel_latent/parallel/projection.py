"""The entry of a tensor-parallel region: one input, one or more column-parallel projections of it,
and one backward collective for the input's gradient, overlapped with the weight gradients.

Megatron's pattern. Each rank's input gradient is a partial sum (its slice of the output features
contributes its share), so it must be all-reduced over the TP group, or reduce-scattered along the
sequence under sequence parallelism. Autograd would compute the input gradient and the weight
gradients and only then reach the region's entry; here the input gradient is computed first, its
collective is started asynchronously, and the weight-gradient GEMMs run while it is in flight.

Several projections of one input (attention's queries, keys and values) share the entry, so they
cost one collective, not three. A projection may read only some positions of the input (queries
read the stream, not the context): ``index`` selects them along dimension 1.

Under sequence parallelism the input holds this rank's positions; it is all-gathered along the
sequence in forward (rank-major: the positions of rank 0, then rank 1, ...) and the gradient is
reduce-scattered back. A ``prefix`` (a tensor that needs no gradient and that every rank holds
whole, e.g. a frozen context) is concatenated in front of the (gathered) input.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .mappings import gather_along_sequence, reduce_scatter_along_sequence
from .utils import group_size


@dataclass(frozen=True)
class Projection:
    weight: torch.Tensor  # [out_per_rank, in]
    bias: torch.Tensor | None = None
    index: torch.Tensor | None = None  # positions (dim 1) of the region's input it reads; None = all


def column_parallel_projections(
    x: torch.Tensor,
    projections: list[Projection],
    group,
    *,
    sequence_parallel: bool = False,
    overlap: bool = True,
    prefix: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """``[F.linear(region_input[:, index], weight, bias) for each projection]``, where the region's
    input is ``cat(prefix, x)`` (``x`` all-gathered along the sequence first under sequence
    parallelism). Backward: one all-reduce (or reduce-scatter) of ``x``'s gradient, started before
    the weight gradients are computed and waited for after them (``overlap``)."""
    if group_size(group) == 1:  # no collective: plain autograd
        full = x if prefix is None else torch.cat([prefix, x], dim=1)
        return [
            F.linear(full if p.index is None else full.index_select(1, p.index), p.weight, p.bias) for p in projections
        ]
    tensors, layout = [], []
    for p in projections:
        layout.append((p.bias is not None, p.index is not None))
        tensors += [p.weight] + ([p.bias] if p.bias is not None else []) + ([p.index] if p.index is not None else [])
    return list(_ColumnParallelProjections.apply(x, prefix, group, sequence_parallel, overlap, tuple(layout), *tensors))


def _unpack(layout, tensors) -> list[tuple]:
    """(weight, bias, index) per projection from the flat tensor list autograd.Function needs."""
    projections, position = [], 0
    for has_bias, has_index in layout:
        weight = tensors[position]
        bias = tensors[position + 1] if has_bias else None
        index = tensors[position + 1 + has_bias] if has_index else None
        position += 1 + has_bias + has_index
        projections.append((weight, bias, index))
    return projections


class _ColumnParallelProjections(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, prefix, group, sequence_parallel, overlap, layout, *tensors):
        full = gather_along_sequence(x, group) if sequence_parallel else x
        if prefix is not None:
            full = torch.cat([prefix, full], dim=1)
        projections = _unpack(layout, tensors)
        outputs = [F.linear(full if i is None else full.index_select(1, i), w, b) for w, b, i in projections]
        ctx.group, ctx.sequence_parallel, ctx.overlap, ctx.layout = group, sequence_parallel, overlap, layout
        ctx.prefix_length = 0 if prefix is None else prefix.shape[1]
        ctx.save_for_backward(full, *tensors)
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads):
        full, *tensors = ctx.saved_tensors
        projections = _unpack(ctx.layout, tensors)

        # 1. The input's gradient, then its collective, in flight while 2. runs.
        grad_full = work = None
        if ctx.needs_input_grad[0]:
            grad_full = torch.zeros_like(full)
            for (weight, _, index), grad in zip(projections, grads, strict=True):
                if grad is None:
                    continue
                part = grad.matmul(weight)
                if index is None:
                    grad_full += part
                else:
                    grad_full.index_add_(1, index, part)
            grad_x = grad_full[:, ctx.prefix_length :]
            if ctx.sequence_parallel and ctx.overlap:
                work, grad_x = reduce_scatter_along_sequence(grad_x, ctx.group, async_op=True)
            elif ctx.sequence_parallel:
                grad_x = reduce_scatter_along_sequence(grad_x, ctx.group)
            else:
                grad_x = grad_x.contiguous()
                work = dist.all_reduce(grad_x, group=ctx.group, async_op=ctx.overlap)
        # 2. The weight gradients.
        tensor_grads = []
        for (weight, bias, index), grad in zip(projections, grads, strict=True):
            if grad is None:
                tensor_grads += [None] * (1 + (bias is not None) + (index is not None))
                continue
            inputs = full if index is None else full.index_select(1, index)
            flat_grad = grad.reshape(-1, grad.shape[-1])
            tensor_grads.append(flat_grad.t().matmul(inputs.reshape(-1, inputs.shape[-1])).to(weight.dtype))
            if bias is not None:
                tensor_grads.append(flat_grad.sum(dim=0).to(bias.dtype))
            if index is not None:
                tensor_grads.append(None)
        grad_input = None
        if grad_full is not None:
            if work is not None:
                work.wait()
            grad_input = grad_x
        return (grad_input, None, None, None, None, None, *tensor_grads)
