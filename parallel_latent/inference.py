"""Scoring an autoencoder on held-out samples: the one loop that scores samples
(:func:`score_samples`, which the trainer's evaluator runs too) and the latent evaluations (size,
statistics, noise), and the held-out evaluation of a loaded autoencoder in one process: loss, token
accuracy, exact match and BLEU of its reconstructions on token ids, on texts, or on the held-out
split of the run it was loaded from (what ``parallel-latent evaluate`` and ``save-pretrained`` print
and record)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from parallel_latent.checkpoint import PortableCheckpoint
from parallel_latent.config import config_from_dict
from parallel_latent.data import build_datasets, get_batch, tokenize_samples
from parallel_latent.data.prefetch import to_device
from parallel_latent.errors import UsageError
from parallel_latent.latent_space import (
    NOISE_LEVELS,
    NOISE_SEED,
    LatentMoments,
    LatentStats,
    latent_size_metrics,
    noised,
)
from parallel_latent.model import eval_mode
from parallel_latent.model.autoencoder import length_mask, predicted_lengths
from parallel_latent.quality import (
    NUM_STATS,
    SAMPLES,
    TOKENS,
    corpus_bleu,
    detokenize,
    output_totals,
    reconstruction_metrics,
    reconstruction_records,
)

__all__ = [
    "EvaluationWorld",
    "Scored",
    "evaluate_held_out",
    "evaluate_ids",
    "evaluate_texts",
    "latent_space_metrics",
    "reconstruction_bleu",
    "score_samples",
]


@dataclass
class Scored:
    """What :func:`score_samples` returns for N samples."""

    stats: torch.Tensor  # quality's statistics vector, float64 on the host
    predictions: torch.Tensor  # [N, T] predicted ids (the pad id at pad positions)
    latents: torch.Tensor  # [N, num_latents, latent_dim] on the host
    length_exact: int  # samples whose predicted length is exact (model.predict_length; else 0)


def score_samples(forward, input_ids: torch.Tensor, attention_mask: torch.Tensor, batch_size: int, device) -> Scored:
    """The statistics, predicted ids and latents of the samples [N, T], run through ``forward(ids,
    mask)`` (an AutoencoderOutput with predictions and latents) in batches of ``batch_size``,
    without autograd."""
    stats = torch.zeros(NUM_STATS, dtype=torch.float64)
    predictions, latents, length_exact = [], [], 0
    with torch.no_grad():
        for start in range(0, input_ids.shape[0], batch_size):
            rows = slice(start, start + batch_size)
            ids, mask = to_device({"input_ids": input_ids[rows], "attention_mask": attention_mask[rows]}, device)
            out = forward(ids, mask)
            stats[:SAMPLES] += output_totals(out).cpu()
            stats[SAMPLES] += ids.shape[0]
            predictions.append(out.predictions)
            latents.append(out.latents.cpu())
            if out.num_length_exact is not None:
                length_exact += int(out.num_length_exact)
    predicted = torch.cat(predictions) if predictions else input_ids.new_empty((0, input_ids.shape[1]))
    return Scored(stats, predicted, torch.cat(latents) if latents else torch.empty(0), length_exact)


def decode_batches(decode, latents: torch.Tensor, attention_mask: torch.Tensor | None, batch_size: int, device):
    """``decode(latents, mask)`` [S, T] ids of host latents in batches (``attention_mask`` None: the
    predicted length), on the host."""
    out = []
    with torch.no_grad():
        for start in range(0, latents.shape[0], batch_size):
            rows = slice(start, start + batch_size)
            mask = None if attention_mask is None else attention_mask[rows].to(device)
            out.append(decode(latents[rows].to(device), mask).cpu())
    return torch.cat(out) if out else torch.empty(0, dtype=torch.long)


def noise_scores(tokenizer, input_ids, attention_mask, predictions, pad_token_id: int, predict_length: bool):
    """(token accuracy over the real tokens, corpus BLEU) of ``predictions`` [S, T] of noised
    latents: a hypothesis ends at its predicted length where the model predicts one, else at its mask."""
    real = attention_mask.bool().cpu()
    correct = ((predictions.cpu() == input_ids.cpu()) & real).sum().item()
    accuracy = correct / max(real.sum().item(), 1)
    ends = length_mask(predicted_lengths(predictions, pad_token_id), predictions.shape[1])
    hypotheses = detokenize(tokenizer, predictions, ends if predict_length else attention_mask)
    return accuracy, corpus_bleu(hypotheses, detokenize(tokenizer, input_ids, attention_mask))


@dataclass
class EvaluationWorld:
    """Whom the evaluated samples are shared by: this process alone (the identity operations), or the
    data-parallel ranks of a run, each holding a contiguous share (sums over the ranks, gathers in
    rank order, a computation on rank 0 whose numbers every rank gets)."""

    model_cfg: Any
    feature_width: int
    tokenizer: Any
    sum: Callable[[torch.Tensor], torch.Tensor] = lambda values: values
    gather: Callable[[torch.Tensor], torch.Tensor] = lambda values: values
    on_main: Callable[[Callable[[], tuple]], tuple] = lambda compute: compute()


def latent_space_metrics(
    scored: Scored, decode, world: EvaluationWorld, input_ids, attention_mask, batch_size: int, device, first: int = 0
) -> tuple[dict[str, float], LatentStats]:
    """The latent evaluations (see :mod:`parallel_latent.latent_space`): size, per-feature
    statistics and reconstruction from noised latents, with the model's ``decode(latents, mask)``.
    ``scored``: this rank's share, samples ``first`` .. of the evaluated ``input_ids`` [S, T] /
    ``attention_mask`` (all of them, on the host)."""
    cfg = world.model_cfg
    moments = LatentMoments.from_tensor(world.sum(LatentMoments.of(scored.latents).as_tensor()))
    samples = input_ids.shape[0]
    stats = moments.stats(samples)
    rms = moments.global_rms()
    metrics = {**latent_size_metrics(cfg, world.feature_width), **stats.metrics()}
    share = slice(first, first + scored.latents.shape[0])
    for level in NOISE_LEVELS:
        latents = noised(scored.latents, first, level, rms, NOISE_SEED)
        mask = None if cfg.predict_length else attention_mask[share]
        predictions = world.gather(decode_batches(decode, latents, mask, batch_size, device))
        accuracy, bleu = world.on_main(
            lambda p=predictions: noise_scores(
                world.tokenizer, input_ids, attention_mask, p, cfg.pad_token_id, cfg.predict_length
            )
        )
        metrics[f"eval_token_accuracy_noise_{level}"] = accuracy
        metrics[f"eval_bleu_noise_{level}"] = bleu
    if cfg.predict_length:
        exact = world.sum(torch.tensor([float(scored.length_exact)], dtype=torch.float64)).item()
        metrics["eval_length_accuracy"] = exact / max(samples, 1)
    return metrics, stats


def reconstruction_bleu(records: list[dict]) -> float:
    """Corpus BLEU of reconstruction records (:func:`quality.reconstruction_records`) against their inputs."""
    return corpus_bleu([r["reconstruction"] for r in records], [r["input"] for r in records])


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
            lambda ids, mask: model(ids, mask, return_predictions=True, return_latents=True),
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
