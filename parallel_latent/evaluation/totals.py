"""The statistics vector of evaluation and of the trainer's steps: what each forward adds up (loss
sum, tokens, correct tokens, exact samples), then the samples, in float64 (exact integer counts up
to 2**53); its sum over the data-parallel ranks, and the loss, token accuracy and exact-match rate
it gives.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = [
    "CORRECT",
    "EXACT",
    "LOSS_SUM",
    "NUM_STATS",
    "SAMPLES",
    "TOKENS",
    "output_totals",
    "reconstruction_metrics",
    "reduce_stats",
]


# The statistics vector's layout: what :func:`output_totals` returns, then the samples.
LOSS_SUM, TOKENS, CORRECT, EXACT, SAMPLES = range(5)
NUM_STATS = 5


def output_totals(out) -> torch.Tensor:
    """[loss sum, tokens, correct tokens, exact samples] of one forward's AutoencoderOutput, float64
    on its device: what evaluation (and the trainer's statistics) add up over batches and ranks."""
    return torch.stack([out.loss_sum.detach(), out.num_tokens, out.num_correct, out.num_exact]).to(torch.float64)


def reconstruction_metrics(loss_sum: float, tokens: float, correct: float, exact: float, samples: float) -> dict:
    """Loss per token, token accuracy and exact-match rate from summed totals."""
    return {
        "loss": loss_sum / max(tokens, 1.0),
        "token_accuracy": correct / max(tokens, 1.0),
        "exact_match": exact / max(samples, 1.0),
    }


def reduce_stats(stats: torch.Tensor, device: torch.device, tp_size: int) -> torch.Tensor:
    """Sum over the world, divided by TP: the ranks of a TP group hold identical statistics (same
    samples, the loss is reduced over the vocabulary slices), so this is the sum over the
    data-parallel group (on the host: the one read of these numbers)."""
    reduced = stats.to(device, copy=True)
    dist.all_reduce(reduced)
    return reduced.cpu() / tp_size
