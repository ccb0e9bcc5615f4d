"""What a model trained on the latents needs to know of them: their size against the text, their
per-feature statistics (saved with every checkpoint, to standardise with), and how well they survive
noise (a diffusion model's samples are never exact); and the evaluation that measures the three
(:func:`latent_space_metrics`).

A latent sample is [N, k]: N latents (``model.num_latents``) of k features (``model.latent_dim``). A
*feature* is one of the k: its statistics pool the N latents of every sample evaluated (every
latent, also those of padding positions: a downstream model generates all N). Noise is Gaussian, of
``level`` times the latents' global root-mean-square over the evaluated samples, drawn per sample
from a generator keyed on (seed, level, the sample's index in the evaluated set): the same noise on
every rank, at every TP x DP layout and batch size.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

from parallel_latent.model.autoencoder import length_mask, predicted_lengths

from .bleu import corpus_bleu
from .records import detokenize
from .scoring import EvaluationWorld, Scored

__all__ = [
    "NOISE_LEVELS",
    "NOISE_SEED",
    "LatentMoments",
    "LatentStats",
    "latent_size_metrics",
    "latent_space_metrics",
    "noise_for",
    "noised",
]

# The noise levels of the evaluation, in units of the latents' global root-mean-square.
NOISE_LEVELS = (0.1, 0.3, 0.5)
# One seed for every model and run: two models are scored on the same draws.
NOISE_SEED = 20260101
# The share of the features whose variance eval_latent_top10_variance_share adds up.
TOP_SHARE = 0.1


def latent_size_metrics(model_cfg, feature_width: int) -> dict[str, float]:
    """``eval_floats_per_token`` (N x k / T) and ``eval_compression`` (the T x f floats of the
    features the encoder reads, f the feature model's width, over the N x k of the latents)."""
    floats = model_cfg.latent_count * model_cfg.latent_width
    return {
        "eval_floats_per_token": floats / model_cfg.max_length,
        "eval_compression": model_cfg.max_length * feature_width / floats,
    }


@dataclass
class LatentMoments:
    """Sums over latents [S, N, k] in float64: per feature the sum and the sum of squares, and the
    number of latents (S x N). Sums add over batches and ranks (:meth:`as_tensor`, all-reduce)."""

    total: torch.Tensor  # [k]
    squares: torch.Tensor  # [k]
    count: float

    @classmethod
    def of(cls, latents: torch.Tensor) -> LatentMoments:
        flat = latents.detach().reshape(-1, latents.shape[-1]).double().cpu()
        return cls(flat.sum(dim=0), flat.square().sum(dim=0), float(flat.shape[0]))

    def as_tensor(self) -> torch.Tensor:
        return torch.cat([self.total, self.squares, torch.tensor([self.count], dtype=torch.float64)])

    @classmethod
    def from_tensor(cls, values: torch.Tensor) -> LatentMoments:
        values = values.double().cpu()
        k = (values.numel() - 1) // 2
        return cls(values[:k], values[k : 2 * k], float(values[-1]))

    def global_rms(self) -> float:
        return math.sqrt(self.squares.sum().item() / max(self.count * self.total.numel(), 1.0))

    def stats(self, samples: int, step: int | None = None) -> LatentStats:
        count = max(self.count, 1.0)
        mean = self.total / count
        variance = (self.squares / count - mean.square()).clamp(min=0.0)
        return LatentStats(mean.float(), variance.sqrt().float(), samples, step)


@dataclass
class LatentStats:
    """Per-feature mean and standard deviation [k] of the latents of ``samples`` evaluated samples
    (at training step ``step``): ``(latents - mean) / std`` standardises them."""

    mean: torch.Tensor
    std: torch.Tensor
    samples: int
    step: int | None = None

    def metrics(self) -> dict[str, float]:
        """The evaluation's statistics of the latent space (``eval_latent_*``)."""
        std = self.std.double()
        variance = std.square().sort(descending=True).values
        top = max(1, math.ceil(TOP_SHARE * variance.numel()))
        total = variance.sum().item()
        return {
            "eval_latent_mean_abs": self.mean.double().abs().mean().item(),
            "eval_latent_std_min": std.min().item(),
            "eval_latent_std_median": std.median().item(),
            "eval_latent_std_max": std.max().item(),
            "eval_latent_top10_variance_share": variance[:top].sum().item() / total if total > 0 else math.nan,
        }

    def to_dict(self) -> dict:
        return {"step": self.step, "samples": self.samples, "mean": self.mean.tolist(), "std": self.std.tolist()}

    @classmethod
    def from_dict(cls, record: dict | None, source: str = "latent_stats") -> LatentStats | None:
        """The statistics a manifest records, or None; ValueError (one line naming ``source``) for a
        record that is not one: what a manifest holds is checked before it is used."""
        if not record:
            return None

        def numbers(key: str) -> bool:
            value = record.get(key) if isinstance(record, dict) else None
            return isinstance(value, list) and bool(value) and all(_finite(x) for x in value)

        if not (numbers("mean") and numbers("std") and len(record["mean"]) == len(record["std"])):
            raise ValueError(f"{source}: 'mean' and 'std' must be lists of as many finite numbers")
        if not (isinstance(record.get("samples"), int) and record["samples"] >= 0):
            raise ValueError(f"{source}: 'samples' must be an integer >= 0")
        mean = torch.tensor(record["mean"], dtype=torch.float32)
        return cls(mean, torch.tensor(record["std"], dtype=torch.float32), record["samples"], record.get("step"))


def _finite(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def noise_for(index: int, shape: tuple[int, ...], level: float, seed: int) -> torch.Tensor:
    """Standard Gaussian noise [shape] of the sample ``index`` at ``level``: on the CPU, from a
    generator keyed on (seed, level, index) alone."""
    key = hashlib.blake2b(repr((int(seed), float(level), int(index))).encode(), digest_size=8).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(key, "little") >> 1)
    return torch.randn(shape, generator=generator)


def noised(latents: torch.Tensor, first_index: int, level: float, rms: float, seed: int) -> torch.Tensor:
    """``latents`` [S, N, k] (samples ``first_index`` .. of the evaluated set) plus Gaussian noise of
    ``level * rms``, in the latents' dtype and device."""
    if len(latents) == 0:
        return latents
    noise = torch.stack(
        [noise_for(first_index + i, tuple(latents.shape[1:]), level, seed) for i in range(len(latents))]
    )
    return latents + (level * rms * noise).to(latents.device, latents.dtype)


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


def latent_space_metrics(
    scored: Scored, decode, world: EvaluationWorld, input_ids, attention_mask, batch_size: int, device, first: int = 0
) -> tuple[dict[str, float], LatentStats]:
    """The latent evaluations: size, per-feature statistics and reconstruction from noised latents,
    with the model's ``decode(latents, mask)``. ``scored``: this rank's share, samples ``first`` ..
    of the evaluated ``input_ids`` [S, T] / ``attention_mask`` (all of them, on the host)."""
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
