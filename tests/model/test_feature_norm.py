"""``model.feature_norm=standardize``: per-feature statistics of the frozen decoder's features, measured
once and kept in the model. Against float64 statistics of the same tokens computed whole (the
batched, pairwise combination in another order, within a derived bound); the same numbers on every
rank of a DP=2 gloo group and equal to one process's; features with massive values (the case it
exists for) come out at unit scale; an unmeasured standardiser refuses to run; the statistics are
persistent buffers, so a portable checkpoint carries them bit for bit; a model without it has none."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from parallel_latent.checkpoint import load_portable, save_portable
from parallel_latent.feature_model.features import random_features_unannounced
from parallel_latent.model import LatentAutoencoder
from parallel_latent.model.feature_norm import FeatureStandardizer, measure_feature_statistics
from parallel_latent.parallel import initialize_model_parallel
from tests.helpers.tiny_model import D, tiny_batch, tiny_configs
from tests.helpers.tp_compare import order_bound

WIDTH = 16


def massive_batches(count: int = 6, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Right-padded batches whose 'features' are the ids' embedding: feature 3 is 10^4 at position 0
    (an attention sink), feature 5 sits at 500 plus noise, the rest ~N(0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        ids = torch.randint(0, 1000, (4, 8), generator=gen)
        lengths = torch.randint(1, 9, (4,), generator=gen)
        batches.append({"input_ids": ids, "attention_mask": (torch.arange(8) < lengths[:, None]).long()})
    return batches


def synthetic_features(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    gen = torch.Generator().manual_seed(int(ids.sum()))
    features = torch.randn(*ids.shape, WIDTH, generator=gen)
    features[:, 0, 3] += 1e4
    features[..., 5] += 500.0
    return features


def whole_statistics(batches) -> tuple[int, torch.Tensor, torch.Tensor]:
    tokens = torch.cat(
        [synthetic_features(b["input_ids"], b["attention_mask"])[b["attention_mask"].bool()] for b in batches]
    )
    tokens = tokens.double()
    return tokens.shape[0], tokens.mean(0), tokens.var(0, unbiased=False)


def test_statistics_equal_those_of_all_tokens_at_once():
    batches = massive_batches()
    count, mean, variance = measure_feature_statistics(synthetic_features, batches)
    want_count, want_mean, want_variance = whole_statistics(batches)
    assert count == want_count
    # float64 throughout: the bound of the summation order, on sums of |x| (means) and of x^2 (variances).
    n = count
    scale = torch.cat([synthetic_features(b["input_ids"], b["attention_mask"]) for b in batches]).abs().max().item()
    assert (mean - want_mean).abs().max().item() <= order_bound(n, scale, torch.float64)
    assert (variance - want_variance).abs().max().item() <= order_bound(n, scale * scale, torch.float64)


def test_massive_features_come_out_at_unit_scale():
    batches = massive_batches()
    norm = FeatureStandardizer(WIDTH)
    norm.set_statistics(*measure_feature_statistics(synthetic_features, batches))
    tokens = torch.cat([norm(synthetic_features(b["input_ids"], None))[b["attention_mask"].bool()] for b in batches])
    assert tokens.mean(0).abs().max().item() < 1e-4
    assert (tokens.std(0, unbiased=False) - 1).abs().max().item() < 1e-4
    raw = torch.cat([synthetic_features(b["input_ids"], None)[b["attention_mask"].bool()] for b in batches])
    assert raw.abs().max().item() > 5e3  # what it was given was massive


def test_a_constant_feature_is_centred_not_blown_up():
    def constant(ids, mask):
        features = synthetic_features(ids, mask)
        features[..., 7] = 42.0
        return features

    norm = FeatureStandardizer(WIDTH)
    norm.set_statistics(*measure_feature_statistics(constant, massive_batches()))
    out = norm(constant(*(massive_batches()[0].values())))
    assert torch.equal(out[..., 7], torch.zeros_like(out[..., 7]))


def test_an_unmeasured_standardizer_refuses_to_run():
    with pytest.raises(RuntimeError, match="never measured"):
        FeatureStandardizer(WIDTH)(torch.zeros(1, 2, WIDTH))
    with pytest.raises(ValueError, match="no tokens"):
        empty = [{"input_ids": torch.zeros(1, 4, dtype=torch.long), "attention_mask": torch.zeros(1, 4)}]
        measure_feature_statistics(synthetic_features, empty)


def dp_statistics_task() -> dict:
    """DP=2: each rank measures every other batch (rank 1 also an empty one); the combined numbers."""
    state = initialize_model_parallel(1)
    batches = massive_batches()[state.dp_rank :: 2]
    if state.dp_rank == 1:
        batches.append({"input_ids": torch.zeros(1, 8, dtype=torch.long), "attention_mask": torch.zeros(1, 8)})
    count, mean, variance = measure_feature_statistics(synthetic_features, batches, "cpu", state.dp_group)
    return {"rank": dist.get_rank(), "count": count, "mean": mean, "variance": variance}


def test_dp_ranks_agree_and_equal_one_process(pool2):
    results = pool2.run(dp_statistics_task)
    first, second = results
    assert first["count"] == second["count"]
    assert torch.equal(first["mean"], second["mean"]) and torch.equal(first["variance"], second["variance"])
    count, mean, variance = measure_feature_statistics(synthetic_features, massive_batches())
    assert first["count"] == count
    assert (first["mean"] - mean).abs().max().item() <= order_bound(count, 1e4, torch.float64)
    assert (first["variance"] - variance).abs().max().item() <= order_bound(count, 1e8, torch.float64)


def standardized_model(seed: int = 3) -> LatentAutoencoder:
    model_cfg, feature_cfg = tiny_configs(dropout=0.0, feature_norm="standardize")
    with random_features_unannounced():
        return LatentAutoencoder(model_cfg, feature_cfg, seed=seed)


def test_the_model_measures_once_and_portable_checkpoints_carry_the_statistics(tmp_path):
    model = standardized_model()
    ids, mask = tiny_batch()
    with pytest.raises(RuntimeError, match="never measured"):
        model.encode(ids, mask)
    model.measure_feature_norm([{"input_ids": ids, "attention_mask": mask}])
    assert int(model.feature_norm.tokens) == int(mask.sum())
    with torch.no_grad():
        features = model.features(ids, mask)
        standardized = model.encoder_input(ids, mask)[mask.bool()]
    assert (standardized.mean(0)).abs().max().item() < 1e-4
    assert not torch.equal(standardized, features[mask.bool()])
    save_portable(model, tmp_path / "portable")
    again = standardized_model(seed=4)  # other weights, no statistics
    load_portable(tmp_path / "portable", again)
    for name in ("mean", "std", "tokens"):
        assert torch.equal(getattr(again.feature_norm, name), getattr(model.feature_norm, name)), name
    with torch.no_grad():
        assert torch.equal(again.encode(ids, mask), model.encode(ids, mask))


def test_without_it_the_model_has_no_statistics_and_reads_the_features_as_they_are():
    model_cfg, feature_cfg = tiny_configs(dropout=0.0)
    assert model_cfg.feature_norm == "none"
    with random_features_unannounced():
        model = LatentAutoencoder(model_cfg, feature_cfg, seed=3)
    assert model.feature_norm is None
    assert not any("feature_norm" in name for name in model.state_dict())
    ids, mask = tiny_batch()
    with torch.no_grad():
        assert torch.equal(model.encoder_input(ids, mask), model.features(ids, mask))
    assert dataclasses.asdict(model_cfg)["feature_norm_samples"] == 512
    assert model.feature_model.width == D
