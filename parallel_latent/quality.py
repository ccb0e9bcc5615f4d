"""Reconstruction quality: corpus BLEU of reconstructions against their inputs, and the examples
that the trainer and ``parallel-latent evaluate`` show.

BLEU is the field's measure of a text autoencoder (LD4LG reports 97.6 on ROCStories and 98.8 on
AG News): sacrebleu's corpus BLEU with its default 13a tokenisation, as papers report it (0-100).
The reference of a sample is its text *as the model saw it*: its first ``max_length`` tokens,
detokenised, so a cut sentence is not counted as an error of the model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = [
    "CORRECT",
    "EXACT",
    "LOSS_SUM",
    "NUM_STATS",
    "SAMPLES",
    "TOKENS",
    "corpus_bleu",
    "detokenize",
    "output_totals",
    "position_accuracy",
    "reconstruction_metrics",
    "reconstruction_records",
    "truncation_note",
]


# The statistics vector of evaluation and of the trainer's steps (float64: exact integer counts up to
# 2**53): what :func:`output_totals` returns, then the samples.
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


def corpus_bleu(hypotheses: Sequence[str], references: Sequence[str]) -> float:
    """sacrebleu's corpus BLEU (0-100) of ``hypotheses`` against one reference each; NaN for none."""
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references")
    if not hypotheses:
        return math.nan
    import sacrebleu

    return float(sacrebleu.corpus_bleu(list(hypotheses), [list(references)]).score)


def detokenize(tokenizer, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[str]:
    """Each row's real tokens (where ``attention_mask`` is 1, a prefix) as text, exactly as the
    tokenizer decodes them (no special tokens dropped, no spaces "cleaned up"), so that equal ids
    give equal texts."""
    lengths = attention_mask.sum(dim=1).tolist()
    return [
        tokenizer.decode(row[:n].tolist(), skip_special_tokens=False, clean_up_tokenization_spaces=False)
        for row, n in zip(input_ids.cpu(), lengths, strict=True)
    ]


def position_accuracy(input_ids: torch.Tensor, attention_mask: torch.Tensor, predictions: torch.Tensor) -> list:
    """Token accuracy at each position [T] over the rows that have a token there (None where no
    row does): where a model's errors sit in the sequence, e.g. a few positions it confuses."""
    real = attention_mask.bool().cpu()
    correct = (predictions.cpu() == input_ids.cpu()) & real
    counts = real.sum(dim=0).tolist()
    return [None if n == 0 else c / n for c, n in zip(correct.sum(dim=0).tolist(), counts, strict=True)]


def truncation_note(max_length: int) -> str:
    return f"[... cut: the model sees the first {max_length} tokens]"


def reconstruction_records(
    tokenizer,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    predictions: torch.Tensor,
    truncated: torch.Tensor | None = None,
) -> list[dict]:
    """One record per row: the input as the model saw it, its reconstruction, whether they match
    token for token, and whether the sample was longer than the model's ``max_length`` (None where
    unknown)."""
    inputs = detokenize(tokenizer, input_ids, attention_mask)
    outputs = detokenize(tokenizer, predictions, attention_mask)
    real = attention_mask.bool().cpu()
    exact = ((predictions.cpu() == input_ids.cpu()) | ~real).all(dim=1).tolist()
    cut = [None] * len(inputs) if truncated is None else [bool(t) for t in truncated.tolist()]
    return [
        {"input": i, "reconstruction": o, "exact": e, "truncated": c}
        for i, o, e, c in zip(inputs, outputs, exact, cut, strict=True)
    ]
