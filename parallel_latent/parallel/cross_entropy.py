"""Cross-entropy and token accuracy over vocabulary-parallel logits.

Each rank holds logits for a contiguous slice of the (padded) vocabulary. Full logits are never
gathered: the loss needs three [B, T]-sized reductions (max, then sum-of-exp and target logit packed
into one tensor), and the accuracy one more (the smallest global index attaining the max, which is
what ``argmax`` over the full vocabulary returns).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

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


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_size, ignore_index, group):
        # One temporary of the logits' size, in at least fp32 (a bf16 softmax loses the target's
        # probability; fp64 stays fp64): the shifted logits, exponentiated and normalised in
        # place, and saved as the softmax for backward. The max and the target logit are read
        # from the logits themselves (exact in any dtype).
        compute_dtype = torch.promote_types(logits.dtype, torch.float32)
        local_vocab = logits.shape[-1]
        start = group_rank(group) * local_vocab
        real = max(0, min(local_vocab, vocab_size - start))  # columns past it are padding

        local_max, local_argmax = _local_max(logits, real)
        local_max = local_max.to(compute_dtype)
        global_max = _reduce(local_max.clone(), dist.ReduceOp.MAX, group)

        ignored = target == ignore_index
        in_range = (target >= start) & (target < start + real) & ~ignored
        local_target = torch.where(in_range, target - start, torch.zeros_like(target))

        exp_logits = torch.sub(logits, global_max.unsqueeze(-1).to(compute_dtype))  # the temporary
        if real < local_vocab:
            exp_logits[..., real:] = float("-inf")  # padding gets no probability
        exp_logits.exp_()
        target_logit = torch.gather(logits, -1, local_target.unsqueeze(-1)).squeeze(-1).to(compute_dtype)
        target_logit = torch.where(in_range, target_logit - global_max, torch.zeros_like(target_logit))
        sums = torch.stack([exp_logits.sum(dim=-1), target_logit])
        sum_exp, target_logit = _reduce(sums, dist.ReduceOp.SUM, group)

        loss = torch.log(sum_exp) - target_logit
        loss = torch.where(ignored, torch.zeros_like(loss), loss)

        softmax = exp_logits.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, in_range, local_target, ignored)

        prediction = _argmax_from_local(local_max, local_argmax, global_max, start, group)
        correct = (prediction == target) & ~ignored
        ctx.mark_non_differentiable(correct)
        return loss, correct

    @staticmethod
    def backward(ctx, grad_loss, _grad_correct):
        softmax, in_range, local_target, ignored = ctx.saved_tensors
        grad = softmax  # reuse the saved buffer: backward runs once
        rows = grad.view(-1, grad.shape[-1])
        flat = torch.arange(rows.shape[0], device=grad.device)
        rows[flat, local_target.view(-1)] -= in_range.view(-1).to(grad.dtype)
        scale = torch.where(ignored, torch.zeros_like(grad_loss), grad_loss)
        grad.mul_(scale.unsqueeze(-1))
        return grad, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, vocab_size: int, tp_group=None, ignore_index: int = -100
):
    """Per-token loss (float32, 0 where ignored) and a bool tensor of correct argmax predictions.

    ``logits`` is this rank's slice ``[..., padded_vocab / tp]``; ``vocab_size`` is the true size:
    columns at or beyond it are padding and get no probability.
    """
    return _VocabParallelCrossEntropy.apply(logits, target, vocab_size, ignore_index, tp_group)


@torch.no_grad()
def vocab_parallel_argmax(logits: torch.Tensor, vocab_size: int, tp_group=None) -> torch.Tensor:
    """Global token ids of the argmax over the full (unpadded) vocabulary, from split logits:
    two [B, T]-sized reductions instead of gathering [B, T, V]."""
    start = group_rank(tp_group) * logits.shape[-1]
    local_max, local_argmax = _local_max(logits, max(0, min(logits.shape[-1], vocab_size - start)))
    global_max = _reduce(local_max.clone(), dist.ReduceOp.MAX, tp_group)
    return _argmax_from_local(local_max, local_argmax, global_max, start, tp_group)
