"""The one loop that scores samples (:func:`score_samples`: the trainer's periodic evaluation and
the evaluation of a loaded model run it alike), and whom the scored samples are shared by
(:class:`EvaluationWorld`: one process, or the data-parallel ranks of a run).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from parallel_latent.data.prefetch import to_device

from .totals import NUM_STATS, SAMPLES, output_totals

__all__ = ["EvaluationWorld", "Scored", "score_samples"]


@dataclass
class Scored:
    """What :func:`score_samples` returns for N samples."""

    stats: torch.Tensor  # the statistics vector (.totals), float64 on the host
    predictions: torch.Tensor  # [N, T] predicted ids (the pad id at pad positions)
    latents: torch.Tensor  # [N, num_latents, latent_dim] on the host
    length_exact: int  # samples whose predicted length is exact (model.predict_length; else 0)


def score_samples(
    forward, input_ids: torch.Tensor, attention_mask: torch.Tensor, batch_size: int, device,
    features: torch.Tensor | None = None,
) -> Scored:  # fmt: skip
    """The statistics, predicted ids and latents of the samples [N, T], run through ``forward(ids,
    mask, features)`` (an AutoencoderOutput with predictions and latents) in batches of ``batch_size``,
    without autograd. ``features``: the samples' [N, T, f] from the feature cache, or None."""
    stats = torch.zeros(NUM_STATS, dtype=torch.float64)
    predictions, latents, length_exact = [], [], 0
    with torch.no_grad():
        for start in range(0, input_ids.shape[0], batch_size):
            rows = slice(start, start + batch_size)
            batch = {"input_ids": input_ids[rows], "attention_mask": attention_mask[rows]}
            if features is not None:
                batch["features"] = features[rows]
            out = forward(*to_device(batch, device))
            stats[:SAMPLES] += output_totals(out).cpu()
            stats[SAMPLES] += batch["input_ids"].shape[0]
            predictions.append(out.predictions)
            latents.append(out.latents.cpu())
            if out.num_length_exact is not None:
                length_exact += int(out.num_length_exact)
    predicted = torch.cat(predictions) if predictions else input_ids.new_empty((0, input_ids.shape[1]))
    return Scored(stats, predicted, torch.cat(latents) if latents else torch.empty(0), length_exact)


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
