"""``model.feature_window`` (parallel_latent/model/feature_window.py): a learned convolution over each
position's neighbours that starts as the identity, never reads padding, trains, is refused when even,
and at TP 2 (sequence parallel) and 4 is the TP=1 model (tests/model/test_autoencoder_tp.py's helper:
loss, gradients and five Adam steps)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from parallel_latent.config import ConfigError, config_from_dict
from parallel_latent.model import LatentAutoencoder
from parallel_latent.model.feature_window import FeatureWindow
from parallel_latent.parallel import TensorParallelOptions
from tests.helpers.autoencoder_tp import assert_equals_tp1, compare_with_tp1
from tests.helpers.tiny_model import D, reduction_length_of_model, tiny_batch, tiny_configs
from tests.helpers.tp_compare import order_bound, terms_scale


def test_it_starts_as_the_identity_and_never_reads_padding():
    window = FeatureWindow(D, 3)
    ids, mask = tiny_batch()
    features = torch.randn(*ids.shape, D)
    out = window(features, mask)
    real = mask.bool()
    bound = order_bound(3 * D, terms_scale(features.abs().max().item(), 3 * D))
    assert (out[real] - features[real]).abs().max().item() <= bound
    garbage = features.masked_fill(~real.unsqueeze(-1), 1e6)
    with torch.no_grad():
        window.weight.normal_()
    assert torch.equal(window(garbage, mask)[real], window(features, mask)[real])


def test_a_model_with_it_starts_where_the_model_without_it_does_and_trains_it():
    model_cfg, feature_cfg = tiny_configs(dropout=0.0)
    plain = LatentAutoencoder(model_cfg, feature_cfg, seed=3)
    windowed = LatentAutoencoder(dataclasses.replace(model_cfg, feature_window=5), feature_cfg, seed=3)
    ids, mask = tiny_batch()
    loss, windowed_loss = plain(ids, mask).loss, windowed(ids, mask).loss
    k = reduction_length_of_model() + 5 * D  # the model's reductions after the window's
    assert abs(loss.item() - windowed_loss.item()) <= order_bound(k, terms_scale(abs(loss.item()), k))
    windowed_loss.backward()
    assert windowed.feature_window.weight.grad.abs().sum() > 0
    assert windowed.feature_window.weight in windowed.trainable_parameters()


def test_an_even_window_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"model.feature_window=4 must be odd"):
        config_from_dict({"model": {"feature_window": 4}})


@pytest.mark.parametrize(("tp", "sequence_parallel"), [(2, True), (4, False)])
def test_it_at_tp_equals_tp1(pool4, tp, sequence_parallel):
    options = {"tp_options": TensorParallelOptions(sequence_parallel=True)} if sequence_parallel else {}
    results = pool4.run(compare_with_tp1, tp, 0.1, model_overrides={"feature_window": 3}, **options)
    assert_equals_tp1(results, f"feature window tp={tp} sp={sequence_parallel}")
