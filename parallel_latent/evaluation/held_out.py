"""The held-out evaluation of a loaded autoencoder in one process: loss, token accuracy, exact match
and BLEU of its reconstructions, with the latent evaluations, on token ids, on texts, or on the
held-out split of the run it was loaded from (what ``parallel-latent evaluate`` and
``save-pretrained`` print and record). It scores with the trainer's loop (:func:`.scoring.score_samples`).
"""

from __future__ import annotations

import torch

from parallel_latent.checkpoint import PortableCheckpoint
from parallel_latent.config import config_from_dict
from parallel_latent.data import build_datasets, get_batch, tokenize_samples
from parallel_latent.errors import UsageError
from parallel_latent.model import eval_mode

from .bleu import reconstruction_bleu
from .latent_space import latent_space_metrics
from .records import reconstruction_records
from .scoring import EvaluationWorld, score_samples
from .totals import TOKENS, reconstruction_metrics

__all__ = ["evaluate_held_out", "evaluate_ids", "evaluate_texts"]


def evaluate_ids(
    autoencoder, input_ids: torch.Tensor, attention_mask: torch.Tensor, batch_size: int = 32, truncated: int = 0
) -> dict:
    """Loss per token, token accuracy, exact-match rate of whole sequences and corpus BLEU of the
    reconstructions against the inputs as the model saw them, for tokenised samples [N, T]
    (``truncated``: how many of them were cut to ``max_length`` tokens, reported as is), with the
    trainer's evaluation loop (:func:`score_samples`)."""
    model = autoencoder.model
    with eval_mode(model):
        scored = score_samples(
            lambda ids, mask, features: model(
                ids, mask, return_predictions=True, return_latents=True, features=features
            ),
            input_ids, attention_mask, batch_size, autoencoder.device,
        )  # fmt: skip
        world = EvaluationWorld(model.model_cfg, model.feature_model.width, autoencoder.tokenizer)
        n = input_ids.shape[0]
        latent_metrics = {}
        if n:
            latent_metrics, _ = latent_space_metrics(
                scored, model.decode, world, input_ids, attention_mask, batch_size, autoencoder.device
            )
    records = reconstruction_records(autoencoder.tokenizer, input_ids, attention_mask, scored.predictions.cpu())
    totals = scored.stats
    return {
        "samples": n,
        "tokens": int(totals[TOKENS]),
        "truncated": int(truncated),
        **reconstruction_metrics(*totals.tolist()),
        "bleu": reconstruction_bleu(records) if n else None,
        # The trainer's names without its eval_ prefix: floats_per_token, bleu_noise_0.1, latent_std_min, ...
        **{name.removeprefix("eval_"): value for name, value in latent_metrics.items()},
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
