"""The latent evaluations: sizes, per-feature statistics from summed moments, noise that depends only
on (seed, level, sample index), and the whole evaluation identical at TP=1 and TP=2 (real gloo
ranks, float64 models so that the TP=2 argmax is the TP=1 argmax)."""

from __future__ import annotations

import math

import torch

from parallel_latent.config import ModelConfig
from parallel_latent.evaluation.latent_space import (
    NOISE_LEVELS,
    LatentMoments,
    LatentStats,
    latent_size_metrics,
    latent_space_metrics,
    noise_for,
    noised,
)
from parallel_latent.evaluation.scoring import EvaluationWorld, score_samples
from parallel_latent.model import LatentAutoencoder, eval_mode
from parallel_latent.parallel import initialize_model_parallel
from tests.helpers.autoencoder_tp import COMPRESSED
from tests.helpers.tiny_model import tiny_batch, tiny_configs

EPS64 = torch.finfo(torch.float64).eps


class IdsAsWords:
    """A tokenizer for the tests' 300-id vocabulary: each id is a word (BLEU needs text)."""

    def decode(self, ids, **_):
        return " ".join(f"w{i}" for i in ids)


def test_sizes_count_floats_against_the_positions_and_the_features():
    default = ModelConfig(d_model=64, max_length=16)
    assert latent_size_metrics(default, 64) == {"eval_floats_per_token": 64.0, "eval_compression": 1.0}
    compressed = ModelConfig(d_model=128, max_length=32, num_latents=16, latent_dim=64)
    assert latent_size_metrics(compressed, 128) == {"eval_floats_per_token": 32.0, "eval_compression": 4.0}
    # Against the feature model's width, not the blocks': GPT-2 small's 768 features per token.
    assert (
        latent_size_metrics(ModelConfig(d_model=768, max_length=64, num_latents=32, latent_dim=64), 768)[
            "eval_compression"
        ]
        == 24.0
    )


def test_statistics_from_moments_summed_in_parts_are_torch_s():
    latents = torch.randn(10, 3, 5, generator=torch.Generator().manual_seed(0)) * torch.arange(1, 6) + 2.0
    parts = [LatentMoments.of(latents[:4]), LatentMoments.of(latents[4:])]
    summed = LatentMoments.from_tensor(parts[0].as_tensor() + parts[1].as_tensor())
    stats = summed.stats(samples=10)
    flat = latents.reshape(-1, 5).double()
    # Float64 sums of 30 terms (error <= 30 eps64 times the largest square), then one rounding to
    # float32 (eps32 times the value); the std's variance E[x^2] - mean^2 carries the sums' error
    # divided by 2 std through the square root.
    eps32, n = torch.finfo(torch.float32).eps, flat.shape[0]
    sums_error = n * EPS64 * flat.square().max()
    want_mean, want_std = flat.mean(dim=0), flat.std(dim=0, unbiased=False)
    assert ((stats.mean.double() - want_mean).abs() <= eps32 * want_mean.abs() + sums_error).all()
    assert ((stats.std.double() - want_std).abs() <= eps32 * want_std + sums_error / want_std).all()
    assert math.isclose(summed.global_rms(), flat.square().mean().sqrt().item(), rel_tol=30 * EPS64)
    again = LatentStats.from_dict(stats.to_dict())
    assert torch.equal(again.mean, stats.mean) and torch.equal(again.std, stats.std) and again.samples == 10


def test_the_space_s_shape_metrics():
    std = torch.tensor([4.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0])  # 11 features: the top 2
    metrics = LatentStats(torch.tensor([-1.0, *[1.0] * 10]), std, samples=3).metrics()
    assert metrics["eval_latent_mean_abs"] == 1.0
    assert (metrics["eval_latent_std_min"], metrics["eval_latent_std_median"], metrics["eval_latent_std_max"]) == (
        1.0, 1.0, 4.0,
    )  # fmt: skip
    assert math.isclose(metrics["eval_latent_top10_variance_share"], 17.0 / 26.0, rel_tol=1e-12)


def test_noise_depends_only_on_the_sample_its_level_and_the_seed():
    latents = torch.zeros(6, 4, 3)
    whole = noised(latents, 0, 0.3, rms=2.0, seed=5)
    assert torch.equal(noised(latents[2:5], 2, 0.3, rms=2.0, seed=5), whole[2:5])  # any share, any batch
    assert torch.equal(whole[3], 0.3 * 2.0 * noise_for(3, (4, 3), 0.3, seed=5))
    assert not torch.equal(whole[3], noised(latents, 0, 0.1, rms=2.0, seed=5)[3] * 3)
    assert not torch.equal(whole, noised(latents, 0, 0.3, rms=2.0, seed=6))
    assert abs(noise_for(0, (200, 50), 0.5, seed=1).std().item() - 1.0) < 0.05  # standard Gaussian
    assert noised(latents[:0], 0, 0.5, 1.0, 0).shape == (0, 4, 3)


def _evaluation(tp_group, model_overrides: dict):
    """The latent evaluation of a 16-sample set, by the model of ``tp_group`` (float64, after 3
    SGD steps), in this process alone: this rank evaluates the samples 5.. of the set."""
    cfg = tiny_configs(dropout=0.0, **model_overrides)
    model = LatentAutoencoder(*cfg, tp_group=tp_group, seed=3).double()
    optimizer = torch.optim.SGD(model.trainable_parameters(), lr=0.5)
    for step in range(3):
        model(*tiny_batch(seed=step)).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    ids = torch.cat([tiny_batch(seed=10)[0], tiny_batch(seed=11)[0]])
    mask = torch.cat([tiny_batch(seed=10)[1], tiny_batch(seed=11)[1]])
    with eval_mode(model):
        scored = score_samples(
            lambda i, m, f: model(i, m, return_predictions=True, return_latents=True, features=f), ids, mask, 3, "cpu"
        )
        world = EvaluationWorld(model.model_cfg, model.feature_model.width, IdsAsWords())
        metrics, stats = latent_space_metrics(scored, model.decode, world, ids, mask, 3, "cpu")
    return metrics, stats.mean, stats.std


def _at_tp1_and_tp2(model_overrides: dict):
    state = initialize_model_parallel(2)
    return _evaluation(None, model_overrides), _evaluation(state.tp_group, model_overrides)


def test_the_noise_evaluation_is_the_same_at_tp1_and_tp2(pool2):
    for overrides in ({}, COMPRESSED):
        for single, parallel in pool2.run(_at_tp1_and_tp2, overrides):
            metrics, mean, std = parallel
            assert set(metrics) == set(single[0])
            for level in NOISE_LEVELS:
                for name in (f"eval_token_accuracy_noise_{level}", f"eval_bleu_noise_{level}"):
                    assert metrics[name] == single[0][name], (overrides, name, metrics[name], single[0][name])
            # float64 moments (their TP=2 difference ~1e-15) stored as float32: at most an ulp apart.
            for got, want in ((mean, single[1]), (std, single[2])):
                assert (got - want).abs().max() <= 2 * torch.finfo(torch.float32).eps * want.abs().max()
            assert ("eval_length_accuracy" in metrics) == bool(overrides.get("predict_length"))
