"""Exact resume through the real trainer: what ``parallel-latent train`` runs on each rank
(``parallel_latent.training.trainer.train``), on 4 real gloo ranks of a pool that lives for this module
(tests/helpers/pool_training.py), TP=2 x DP=2, dropout on. A straight 4-step run saves at step 2 and 4;
a fresh job given only the step-2 checkpoint resumes and trains steps 3-4: every loss and the final
weights are bit-identical. Then the same checkpoint resumes at another layout (TP=4 x DP=1, ZeRO-3)
with Adam's moments. A run on the feature cache is the straight run, and resumes at TP=4 on the same cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from parallel_latent.checkpoint import PortableCheckpoint
from parallel_latent.config import load_config
from tests.helpers.pool_training import shared_pool, train_in_pool
from tests.helpers.tp_compare import autoencoder_reduction_length, order_bound, terms_scale
from tests.helpers.trainer_runs import TINY, TINY_CONFIG, by_step, copy_checkpoint

pytestmark = pytest.mark.slow

# The fewest steps that cross a save and a resume with the schedule still moving (warm-up: 2 steps)
# and Adam's moments in use after it.
STEPS, HALF = 4, 2
RECIPE = [
    "model.dropout=0.1",
    f"training.max_steps={STEPS}",
    f"checkpoint.save_every={HALF}",
    "checkpoint.keep_last=2",
    "checkpoint.export_portable=true",
    "training.eval_every=0",
    "parallel.tensor_parallel=2",
    "training.micro_batch_size=4",
]


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    checkpoint = PortableCheckpoint(run_dir / "checkpoints" / f"step_{STEPS:08d}" / "model")
    return {name: checkpoint.read_full(name) for name in checkpoint.tensors}


@pytest.fixture(scope="module")
def pool(request):
    """Four ranks, each one process for every run of this module (and of the other checkpoint and data
    modules: tests/helpers/pool_training.py)."""
    return shared_pool(request, 4)


@pytest.fixture(scope="module", params=[2, 3], ids=["zero2", "zero3"])
def straight_run(request, pool, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp(f"straight-z{request.param}") / "run"
    train_in_pool(pool, run_dir, *RECIPE, f"parallel.zero_stage={request.param}")
    return request.param, run_dir


def test_resume_is_bit_identical(pool, straight_run, tmp_path):
    stage, straight = straight_run
    resumed = tmp_path / "resumed"
    copy_checkpoint(straight, HALF, resumed)
    stdout, _ = train_in_pool(pool, resumed, *RECIPE, f"parallel.zero_stage={stage}")
    assert f"at step {HALF}" in stdout and "resharded" not in stdout
    want, got = by_step(straight), by_step(resumed)
    assert sorted(got) == list(range(HALF + 1, STEPS + 1))
    for step in got:
        for key in ("loss", "grad_norm", "token_accuracy", "lr"):
            assert got[step][key] == want[step][key], (step, key, got[step][key], want[step][key])
    want_weights, got_weights = final_weights(straight), final_weights(resumed)
    assert want_weights.keys() == got_weights.keys()
    for name in want_weights:
        assert torch.equal(got_weights[name], want_weights[name]), name


@pytest.mark.parametrize("straight_run", [2], indirect=True, ids=["zero2"])
def test_resume_at_another_layout_keeps_adam_state(pool, straight_run, tmp_path):
    """ZeRO-2 TP=2 x DP=2 -> ZeRO-3 TP=4 x DP=1 (one resharded trainer run is enough here; the
    layout matrix is covered on engines in test_training.py)."""
    _, straight = straight_run
    resumed = tmp_path / "resharded"
    copy_checkpoint(straight, HALF, resumed)
    stdout, _ = train_in_pool(
        pool, resumed, *RECIPE, "parallel.zero_stage=3", "parallel.tensor_parallel=4", "training.micro_batch_size=8"
    )
    assert "resharded from another layout" in stdout
    want, got = by_step(straight), by_step(resumed)
    assert sorted(got) == list(range(HALF + 1, STEPS + 1))
    # The same data and schedule at every step, exactly.
    for step in got:
        assert (got[step]["tokens"], got[step]["samples"]) == (want[step]["tokens"], want[step]["samples"]), step
        assert got[step]["lr"] == want[step]["lr"], step
    # Step 3 runs the carried-over weights on the same batch with the same dropout masks (keyed on
    # global coordinates): its loss is the straight run's up to the fp32 summation order of another
    # TP split. Later steps are not compared: Adam magnifies that order's noise (tests/helpers/tp_compare.py);
    # that the moments are carried over and used is checked in tests/checkpoint/test_training.py.
    model_cfg = load_config(TINY_CONFIG, [*TINY, "model.vocab_size=50259"]).model
    n = autoencoder_reduction_length(model_cfg, tokens=8 * model_cfg.max_length, tp=4)
    loss = want[HALF + 1]["loss"]
    assert abs(got[HALF + 1]["loss"] - loss) <= order_bound(n, terms_scale(loss, n))
    info = json.loads((resumed / "checkpoints" / f"step_{STEPS:08d}" / "checkpoint.json").read_text())
    assert info["layout"]["tensor_parallel"] == 4 and info["layout"]["zero_stage"] == 3
    # The universal state the resume converted carries the model's own record, as model/ does (an
    # export from it rebuilds the GPT-2 from its recorded shape, without the hub).
    converted = resumed / "checkpoints" / f"step_{HALF:08d}"
    universal, portable = (
        json.loads((converted / sub / "manifest.json").read_text()) for sub in ("universal", "model")
    )
    for key in ("model_class", "model_config", "feature_model_config", "feature_model_architecture"):
        assert universal[key] == portable[key], key


@pytest.mark.parametrize("straight_run", [2], indirect=True, ids=["zero2"])
def test_a_run_on_the_feature_cache_is_the_same_run_and_a_resume_at_tp4_reads_the_same_cache(
    pool, straight_run, tmp_path
):
    """``feature_model.cache=on``: the four ranks build the cache (one shard each), the steps read it
    instead of running the decoder, and the run is the straight run: the same batches and schedule,
    step 1's loss within the derived bound (identical here: a row's features do not depend on the
    batch it was encoded in on these kernels; tests/feature_model/test_cache.py bounds them). Its
    step-2 checkpoint resumed at TP=4 x DP=1 reads the same cache, building nothing."""
    _, straight = straight_run
    cached = tmp_path / "cached"
    stdout, _ = train_in_pool(pool, cached, *RECIPE, "feature_model.cache=on")
    assert "building the feature cache (4 of 4 shards" in stdout and "read from the feature cache" in stdout
    assert any(line.startswith("feature cache built in") for line in stdout.splitlines())
    directory = next(line.split(" into ")[1].removesuffix(" ...") for line in stdout.splitlines() if "cache (4" in line)
    want, got = by_step(straight), by_step(cached)
    assert sorted(got) == sorted(want)
    for step in got:
        assert (got[step]["tokens"], got[step]["samples"], got[step]["lr"]) == (
            want[step]["tokens"], want[step]["samples"], want[step]["lr"]
        ), step  # fmt: skip
    model_cfg = load_config(TINY_CONFIG, [*TINY, "model.vocab_size=50259"]).model
    n = autoencoder_reduction_length(model_cfg, tokens=8 * model_cfg.max_length, tp=2)
    assert abs(got[1]["loss"] - want[1]["loss"]) <= order_bound(n, terms_scale(want[1]["loss"], n))

    resumed = tmp_path / "resumed"
    copy_checkpoint(cached, HALF, resumed)
    stdout, _ = train_in_pool(
        pool, resumed, *RECIPE, "feature_model.cache=on", "parallel.tensor_parallel=4", "training.micro_batch_size=8"
    )
    assert f"feature cache: {directory} (" in stdout and "building" not in stdout
    assert "resharded from another layout" in stdout
    n4 = autoencoder_reduction_length(model_cfg, tokens=8 * model_cfg.max_length, tp=4)
    loss = by_step(cached)[HALF + 1]["loss"]
    assert abs(by_step(resumed)[HALF + 1]["loss"] - loss) <= order_bound(n4, terms_scale(loss, n4))
