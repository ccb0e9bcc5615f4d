"""Cross-entropy and token accuracy over vocabulary-parallel logits.

Each rank holds logits for a contiguous slice of the (padded) vocabulary. Full logits are never
gathered: the loss needs three [B, T]-sized reductions (max, then sum-of-exp and target logit packed
into one tensor), and the accuracy one more (the smallest global index attaining the max, which is
what ``argmax`` over the full vocabulary returns).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .compile import CompiledWithFallback
from .utils import group_rank, group_size


def _reduce(x: torch.Tensor, op, group) -> torch.Tensor:
    if group_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


def _local_max(logits: torch.Tensor, real: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Max and argmax over this rank's real (unpadded) columns, without copying the logits."""
    if real == 0:  # a rank that holds only padding
        shape = logits.shape[:-1]
        return logits.new_full(shape, float("-inf")), torch.zeros(shape, dtype=torch.long, device=logits.device)
    return logits[..., :real].max(dim=-1)


def _argmax_from_local(local_max, local_argmax, global_max, start, group) -> torch.Tensor:
    # Ties resolve to the lowest global index, as argmax over the full vocabulary does.
    big = torch.iinfo(torch.int64).max
    candidate = torch.where(local_max == global_max, local_argmax + start, torch.full_like(local_argmax, big))
    return _reduce(candidate, dist.ReduceOp.MIN, group)


# fp32 elements of one chunk of rows: the loss never holds an fp32 copy of the whole [rows, V/t]
# logits (1.6 GB at B*T = 8192 and GPT-2's vocabulary), only one chunk of this size at a time.
CHUNK_ELEMENTS = 2**25
# Shifted logits at or below this are taken as exp() = 0 exactly. Left alone, a confident model's
# logits fall 87 to 103 below the row's max, where exp() returns subnormal numbers: a CPU makes them
# in a slow path (measured: the loss's exp 20x slower late in a compressed run than at its start).
# What is dropped, e^-64 = 1.6e-28 a column, is below fp64's resolution of a sum that is at least 1
# (the max's own term) for any vocabulary under 10^12 columns.
EXP_CUTOFF = -64.0


def _rows_per_chunk(local_vocab: int, chunk_rows: int | None) -> int:
    return chunk_rows or max(1, CHUNK_ELEMENTS // max(1, local_vocab))


def _row_chunks(local_vocab: int, chunk_rows: int | None, *tensors: torch.Tensor):
    """The tensors (rows first, all with the same number of rows) chunk by chunk of rows; one chunk
    is the tensors themselves, without slicing them."""
    rows, step = tensors[0].shape[0], _rows_per_chunk(local_vocab, chunk_rows)
    if step >= rows:
        yield tensors
        return
    for first in range(0, rows, step):
        yield tuple(t[first : first + step] for t in tensors)


def _shifted_exp(logits, row_max, real: int, compute_dtype, out=None) -> torch.Tensor:
    """exp(logits - max) of a chunk of rows, in ``compute_dtype`` (into ``out`` when given, which
    has that dtype); padding columns get 0."""
    exp_logits = torch.sub(logits, row_max.unsqueeze(-1).to(compute_dtype), out=out)
    if real < logits.shape[-1]:
        exp_logits[..., real:].fill_(float("-inf"))  # (an assignment would build a tensor from Python data)
    return torch.nn.functional.threshold_(exp_logits, EXP_CUTOFF, float("-inf")).exp_()


def chunk_max_sum_exp(out_max, out_argmax, out_sum, logits, real: int, compute_dtype) -> None:
    """Forward work of one chunk of rows, one pass over its logits, written into the ``out_*`` rows:
    this rank's max (in the logits' dtype) and argmax over the real columns, and the sum of
    exp(logits - that max) (rescaled to the global max by the caller)."""
    torch.max(logits[..., :real], dim=-1, out=(out_max, out_argmax))
    torch.sum(_shifted_exp(logits, out_max, real, compute_dtype), dim=-1, out=out_sum)


def chunk_grad_into(out, logits, global_max, sum_exp, targets, hits, scale, real: int, compute_dtype):
    """Backward work of one chunk of rows: (softmax - one-hot of the target) x the incoming gradient,
    rounded once to ``out``'s dtype (the logits') and written straight into ``out``; with ``out``
    None (logits in the compute dtype), into a new tensor, which is returned."""
    # Logits already in the compute dtype (fp32 on a CPU): ``out`` (or the new tensor) itself is
    # the one temporary, so the chunk allocates and touches no second buffer of its size.
    in_place = out is None or out.dtype == compute_dtype
    softmax = _shifted_exp(logits, global_max, real, compute_dtype, out=out if in_place else None)
    softmax.div_(sum_exp[:, None])
    flat = torch.arange(softmax.shape[0], device=softmax.device)
    softmax[flat, targets] -= hits
    if in_place:
        return softmax.mul_(scale[:, None])
    return torch.mul(softmax, scale[:, None], out=out)


def chunk_grad_fused(out, logits, global_max, sum_exp, targets, hits, scale, real: int, compute_dtype):
    """:func:`chunk_grad_into` as one elementwise expression, the chunk a compiled loss runs: the
    target's one-hot subtracted by comparing each column with the row's target instead of by an
    indexed write, which inductor cannot fuse with the work around it (it would write the fp32
    softmax out and read it back). The same operations on the same values: the same bits eagerly."""
    columns = torch.arange(logits.shape[-1], device=logits.device)
    shifted = torch.sub(logits, global_max.unsqueeze(-1).to(compute_dtype))
    if real < logits.shape[-1]:
        shifted = shifted.masked_fill(columns >= real, float("-inf"))
    softmax = torch.nn.functional.threshold(shifted, EXP_CUTOFF, float("-inf")).exp() / sum_exp[:, None]
    one_hot = torch.where(columns == targets[:, None], hits[:, None], 0.0)
    grad = (softmax - one_hot) * scale[:, None]
    if out is None:
        return grad
    return out.copy_(grad)


@dataclass
class LossKernels:
    """The loss's per-chunk work: plain functions, or compiled ones (``compiled()``: each chunk's
    work fused into one kernel each way, the backward chunk written as :func:`chunk_grad_fused`).
    Owned by a model, passed to the loss, which runs :meth:`on` its logits' device: compiled there
    when ``compiled_on`` (an object with a ``compile_devices`` attribute, read at each call: the
    model's dropout generator) names that device's type."""

    sum_exp: Callable = chunk_max_sum_exp  # the forward chunk: local max, argmax and sum of exp
    grad: Callable = chunk_grad_into  # the backward chunk, written into its rows of the gradient
    compiled_on: object | None = None
    _compiled: LossKernels | None = field(default=None, repr=False, compare=False)

    @classmethod
    def compiled(cls) -> LossKernels:
        return cls(
            CompiledWithFallback(chunk_max_sum_exp, "the loss's forward chunk", dynamic=True),
            CompiledWithFallback(chunk_grad_fused, "the loss's backward chunk", dynamic=True),
        )

    @property
    def compiled_kernels(self) -> bool:
        return isinstance(self.sum_exp, CompiledWithFallback)

    def on(self, device: torch.device) -> LossKernels:
        """The kernels for logits on ``device`` (compiled once per model, on first use)."""
        if self.compiled_on is None or device.type not in self.compiled_on.compile_devices:
            return self
        if self._compiled is None:
            self._compiled = LossKernels.compiled()
        return self._compiled


PLAIN_KERNELS = LossKernels()


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Forward and backward over chunks of rows, one pass over each chunk's logits each way: per
    chunk one temporary in at least fp32 (a bf16 softmax loses the target's probability; fp64 stays
    fp64), recomputed in backward from the saved per-row max and sum instead of keeping the softmax.
    Forward finds each row's local max with its sum of exp (rescaled once to the global max: exact
    at TP=1, where the two are the same); backward writes the gradient in the logits' dtype chunk
    by chunk into one buffer: no fp32 gradient of the whole logits, no copy of a chunk's."""

    @staticmethod
    def forward(ctx, logits, target, vocab_size, ignore_index, group, chunk_rows, kernels):
        kernels = kernels.on(logits.device)
        compute_dtype = torch.promote_types(logits.dtype, torch.float32)
        local_vocab = logits.shape[-1]
        start = group_rank(group) * local_vocab
        real = max(0, min(local_vocab, vocab_size - start))  # columns past it are padding
        local_max, local_argmax, local_sum = _local_max_and_sum(logits, real, chunk_rows, kernels, compute_dtype)
        global_max = _reduce(local_max.clone(), dist.ReduceOp.MAX, group)

        ignored = target == ignore_index
        in_range = (target >= start) & (target < start + real) & ~ignored
        local_target = torch.where(in_range, target - start, torch.zeros_like(target))
        # The target logit is read from the logits themselves (exact in any dtype).
        target_logit = torch.gather(logits, -1, local_target.unsqueeze(-1)).squeeze(-1).to(compute_dtype)
        target_logit = torch.where(in_range, target_logit - global_max, torch.zeros_like(target_logit))
        if group_size(group) > 1:  # each rank's sum to the global max (one rank: the same max)
            local_sum = local_sum * torch.exp(local_max - global_max)
        sums = torch.stack([local_sum, target_logit])
        sum_exp, target_logit = _reduce(sums, dist.ReduceOp.SUM, group)

        loss = torch.log(sum_exp) - target_logit
        loss = torch.where(ignored, torch.zeros_like(loss), loss)
        ctx.save_for_backward(logits, global_max, sum_exp, in_range, local_target, ignored)
        ctx.real, ctx.chunk_rows, ctx.kernels = real, chunk_rows, kernels

        prediction = _argmax_from_local(local_max, local_argmax, global_max, start, group)
        correct = (prediction == target) & ~ignored
        ctx.mark_non_differentiable(correct)
        return loss, correct

    @staticmethod
    def backward(ctx, grad_loss, _grad_correct):
        logits, global_max, sum_exp, in_range, local_target, ignored = ctx.saved_tensors
        compute_dtype = global_max.dtype
        local_vocab = logits.shape[-1]
        rows = logits.reshape(-1, local_vocab)
        scale = torch.where(ignored, torch.zeros_like(grad_loss), grad_loss).reshape(-1)
        row_max, row_sum = global_max.reshape(-1), sum_exp.reshape(-1)
        targets, hits = local_target.reshape(-1), in_range.reshape(-1).to(compute_dtype)
        if logits.dtype == compute_dtype and rows.shape[0] <= _rows_per_chunk(local_vocab, ctx.chunk_rows):
            # One chunk in the compute dtype: its temporary is the gradient, no buffer to copy it into.
            grad = ctx.kernels.grad(None, rows, row_max, row_sum, targets, hits, scale, ctx.real, compute_dtype)
            return grad.view_as(logits), None, None, None, None, None, None
        grad = torch.empty_like(logits)  # in the logits' dtype
        each = _row_chunks(local_vocab, ctx.chunk_rows, grad.view(-1, local_vocab), rows, row_max, row_sum, targets,
                           hits, scale)  # fmt: skip
        for chunk in each:
            ctx.kernels.grad(*chunk, ctx.real, compute_dtype)
        return grad, None, None, None, None, None, None


def _local_max_and_sum(logits, real: int, chunk_rows, kernels, compute_dtype):
    """Per row of ``logits``: this rank's max (in ``compute_dtype``) and argmax over its real
    columns, and the sum of exp(logits - that max); chunk by chunk of rows."""
    shape = logits.shape[:-1]
    if real == 0:  # a rank that holds only padding: no probability here
        no_max = logits.new_full(shape, float("-inf"), dtype=compute_dtype)
        return no_max, torch.zeros(shape, dtype=torch.long, device=logits.device), torch.zeros_like(no_max)
    local_max = logits.new_empty(shape)
    local_argmax = torch.empty(shape, dtype=torch.long, device=logits.device)
    local_sum = torch.empty(shape, dtype=compute_dtype, device=logits.device)
    rows = logits.reshape(-1, logits.shape[-1])
    each = _row_chunks(logits.shape[-1], chunk_rows, local_max.view(-1), local_argmax.view(-1), local_sum.view(-1),
                       rows)  # fmt: skip
    for chunk in each:
        kernels.sum_exp(*chunk, real, compute_dtype)
    return local_max.to(compute_dtype), local_argmax, local_sum


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    vocab_size: int,
    tp_group=None,
    ignore_index: int = -100,
    chunk_rows: int | None = None,
    kernels: LossKernels = PLAIN_KERNELS,
):
    """Per-token loss (float32, 0 where ignored) and a bool tensor of correct argmax predictions.

    ``logits`` is this rank's slice ``[..., padded_vocab / tp]``; ``vocab_size`` is the true size:
    columns at or beyond it are padding and get no probability. ``chunk_rows``: rows per fp32
    temporary (default: :data:`CHUNK_ELEMENTS` elements' worth); ``kernels``: the per-chunk work,
    plain or compiled (:class:`LossKernels`).
    """
    if not torch.is_grad_enabled():
        # Evaluation (no autograd: other batch sizes, no backward) runs the chunks eagerly, as the
        # compiled blocks do, so that it adds no compiled variant towards dynamo's recompile limit.
        kernels = PLAIN_KERNELS
    return _VocabParallelCrossEntropy.apply(logits, target, vocab_size, ignore_index, tp_group, chunk_rows, kernels)


@torch.no_grad()
def vocab_parallel_argmax(logits: torch.Tensor, vocab_size: int, tp_group=None) -> torch.Tensor:
    """Global token ids of the argmax over the full (unpadded) vocabulary, from split logits:
    two [B, T]-sized reductions instead of gathering [B, T, V]."""
    start = group_rank(tp_group) * logits.shape[-1]
    local_max, local_argmax = _local_max(logits, max(0, min(logits.shape[-1], vocab_size - start)))
    global_max = _reduce(local_max.clone(), dist.ReduceOp.MAX, tp_group)
    return _argmax_from_local(local_max, local_argmax, global_max, start, tp_group)
