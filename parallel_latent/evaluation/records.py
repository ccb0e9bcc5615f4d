"""Reconstruction records: each sample as the model saw it (its first ``max_length`` tokens,
detokenised), its reconstruction and whether they match, which the trainer and ``parallel-latent
evaluate`` show and score with BLEU (:mod:`.bleu`); and where in the sequence the errors sit.
"""

from __future__ import annotations

import torch

__all__ = ["detokenize", "position_accuracy", "reconstruction_records", "truncation_note"]


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
