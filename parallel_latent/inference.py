"""Held-out evaluation of a loaded autoencoder in one process: loss, token accuracy, exact match
and BLEU of its reconstructions, on token ids, on texts, or on the held-out split of the run it was
loaded from (what ``parallel-latent evaluate`` and ``save-pretrained`` print and record)."""

from __future__ import annotations

import torch

from parallel_latent.checkpoint import PortableCheckpoint
from parallel_latent.config import config_from_dict
from parallel_latent.data import build_datasets, get_batch, tokenize_samples
from parallel_latent.errors import UsageError
from parallel_latent.model import eval_mode
from parallel_latent.quality import (
    NUM_STATS,
    SAMPLES,
    TOKENS,
    corpus_bleu,
    detokenize,
    output_totals,
    reconstruction_metrics,
)


@torch.no_grad()
def evaluate_ids(
    autoencoder, input_ids: torch.Tensor, attention_mask: torch.Tensor, batch_size: int = 32, truncated: int = 0
) -> dict:
    """Loss per token, token accuracy, exact-match rate of whole sequences and corpus BLEU of the
    reconstructions against the inputs as the model saw them, for tokenised samples [N, T]
    (``truncated``: how many of them were cut to ``max_length`` tokens, reported as is)."""
    model, tokenizer = autoencoder.model, autoencoder.tokenizer
    totals = torch.zeros(NUM_STATS, dtype=torch.float64)
    references, hypotheses = [], []
    with eval_mode(model):
        for start in range(0, input_ids.shape[0], batch_size):
            ids = input_ids[start : start + batch_size].to(autoencoder.device)
            mask = attention_mask[start : start + batch_size].to(autoencoder.device)
            out = model(ids, mask, return_predictions=True)
            totals[:SAMPLES] += output_totals(out).cpu()
            totals[SAMPLES] += ids.shape[0]
            references += detokenize(tokenizer, ids, mask)
            hypotheses += detokenize(tokenizer, out.predictions, mask)
    n = input_ids.shape[0]
    return {
        "samples": n,
        "tokens": int(totals[TOKENS]),
        "truncated": int(truncated),
        **reconstruction_metrics(*totals.tolist()),
        "bleu": corpus_bleu(hypotheses, references) if n else None,
    }


def evaluate_texts(autoencoder, texts: list[str], batch_size: int = 32) -> dict:
    """:func:`evaluate_ids` of ``texts``, each cut to the model's ``max_length`` tokens."""
    cfg = autoencoder.model.model_cfg
    data = tokenize_samples(texts, autoencoder.tokenizer, cfg.max_length, cfg.pad_token_id)
    return evaluate_ids(autoencoder, data.input_ids, data.attention_mask, batch_size, data.num_truncated)


def evaluate_held_out(autoencoder, batch_size: int = 32, max_samples: int = 0) -> dict:
    """:func:`evaluate_ids` on the held-out split of the run ``autoencoder`` was loaded from (its
    config travels with the checkpoint): the very token ids the trainer evaluates."""
    source = autoencoder.source
    config = PortableCheckpoint(source, verify_checksums=False).manifest.get("config")
    if not config:
        raise UsageError(f"{source}: saved without its training config, so without a held-out split; give --data")
    cfg = config_from_dict(config, source=str(source))
    held_out = build_datasets(cfg, autoencoder.tokenizer, announce=False)[1]  # stdout is the JSON result
    indices = list(range(min(len(held_out), max_samples) if max_samples else len(held_out)))
    batch = get_batch(held_out, indices)
    truncated = int(held_out.truncated_at(indices).sum()) if hasattr(held_out, "truncated_at") else 0
    return evaluate_ids(autoencoder, batch["input_ids"], batch["attention_mask"], batch_size, truncated)


__all__ = ["evaluate_held_out", "evaluate_ids", "evaluate_texts"]
