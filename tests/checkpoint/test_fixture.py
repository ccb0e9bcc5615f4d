"""Checkpoints in the format of manifest version 1 load, at TP=1 and TP=2, to the same
decoded ids. The files in fixtures/v1 were written once (see fixtures/README.md) and are never
rewritten; the ids below were printed by the code that wrote them, not by the code under test."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from parallel_latent.api import load_autoencoder
from parallel_latent.checkpoint import PortableCheckpoint, load_training_checkpoint
from parallel_latent.checkpoint.universal import export_portable
from tests.helpers.make_fixture import FIXTURE, fixture_batch, fixture_config

# The decoded ids of fixture_batch(), recorded from the writing code (both models were trained to
# reconstruct it: the smallest argmax margins were 0.97 and 1.69, far above any summation-order
# difference between TP degrees).
EXPECTED_IDS = [
    [165, 43, 198, 277, 237, 283, 27, 188],
    [25, 249, 294, 192, 75, 80, 128, 295],
    [12, 51, 276, 171, 140, 299, 299, 299],
    [202, 105, 75, 141, 88, 153, 221, 94],
]
TRAINING_CHECKPOINT = FIXTURE / "run" / "checkpoints" / "step_00000060"


def decode(model) -> list[list[int]]:
    ids, mask = fixture_batch()
    model.eval()
    return model.decode(model.encode(ids, mask), mask).tolist()


def portable_task(tp: int, path: str):
    from parallel_latent.parallel import initialize_model_parallel

    state = initialize_model_parallel(tp)
    return decode(load_autoencoder(path, state.tp_group))


def training_task(tp: int, checkpoints: str):
    from parallel_latent.model import build_model
    from parallel_latent.parallel import initialize_model_parallel
    from parallel_latent.training.engine_setup import initialize_engine

    cfg = fixture_config("normal")
    cfg.parallel.tensor_parallel = tp
    state = initialize_model_parallel(tp)
    model = build_model(cfg, state.tp_group)
    engine = initialize_engine(model, cfg, state.world_size).engine
    loaded = load_training_checkpoint(engine, checkpoints, model=model, tp_group=state.tp_group)
    return loaded.step, loaded.resharded, loaded.client_state, decode(model)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("saved", ["portable", "run"])
def test_portable_weights_load_at_tp(pool2, saved, tp):
    """The tied-head portable directory, and the training checkpoint's model/ (padded split head)."""
    for decoded in pool2.run(portable_task, tp, str(FIXTURE / saved)):
        assert decoded == EXPECTED_IDS


def test_single_process_load():
    assert decode(load_autoencoder(FIXTURE / "portable")) == EXPECTED_IDS
    assert decode(load_autoencoder(TRAINING_CHECKPOINT)) == EXPECTED_IDS


@pytest.mark.parametrize("tp", [1, 2])
def test_training_checkpoint_resumes_at_tp(pool2, tmp_path, tp):
    """TP=2 x DP=1 is the saved layout (DeepSpeed's files); TP=1 x DP=2 goes through the universal
    state converted from them (written next to them: into a copy, the fixture stays as it is)."""
    copy = tmp_path / "checkpoints"
    shutil.copytree(TRAINING_CHECKPOINT.parent, copy)
    for step, resharded, client, decoded in pool2.run(training_task, tp, str(copy)):
        assert step == 60 and resharded == (tp != 2)
        assert client == {"step": 60, "skipped_steps": 0}
        assert decoded == EXPECTED_IDS


def test_export_copies_model_or_rebuilds_it_from_deepspeeds_files(tmp_path):
    """`parallel-latent export`: a checkpoint's model/ is copied; a checkpoint saved without one
    gets its weights rebuilt from DeepSpeed's files through a scratch universal state, the
    checkpoint itself left as it was."""
    assert decode(load_autoencoder(export_portable(TRAINING_CHECKPOINT, tmp_path / "copied"))) == EXPECTED_IDS
    bare = tmp_path / "checkpoints" / TRAINING_CHECKPOINT.name
    shutil.copytree(TRAINING_CHECKPOINT, bare, ignore=shutil.ignore_patterns("model"))
    files_before = sorted(p.relative_to(bare) for p in bare.rglob("*"))
    rebuilt = export_portable(bare.parent, tmp_path / "rebuilt")
    assert decode(load_autoencoder(rebuilt)) == EXPECTED_IDS
    assert sorted(p.relative_to(bare) for p in bare.rglob("*")) == files_before
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no scratch left
    # Trained in fp32, the masters are the weights: the same tensors as the saved model/, bit for bit.
    saved, made = PortableCheckpoint(TRAINING_CHECKPOINT / "model"), PortableCheckpoint(rebuilt)
    assert made.manifest["tp_size"] == 2 and made.tensors.keys() == saved.tensors.keys()
    for name in saved.tensors:
        assert torch.equal(made.read_full(name), saved.read_full(name)), name


def test_reshard_prints_only_its_result(tmp_path):
    """`parallel-latent reshard` run as a user runs it (no DS_ACCELERATOR set) says where the
    universal state went and how to resume, on two lines: DeepSpeed's accelerator detection and
    its "converting" chatter stay out of stdout."""
    copy = tmp_path / "checkpoints" / TRAINING_CHECKPOINT.name
    shutil.copytree(TRAINING_CHECKPOINT, copy)
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    command = [sys.executable, "-m", "parallel_latent", "reshard", str(copy)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        f"universal optimizer state written to {copy / 'universal'}",
        "resume at any TP x DP x ZeRO layout: checkpoint.resume=<this checkpoint> (it is used automatically)",
    ]
    assert (copy / "universal").is_dir()


def test_fixture_is_untouched():
    assert not (TRAINING_CHECKPOINT / "universal").exists()
    assert sorted(p.name for p in Path(FIXTURE).iterdir()) == ["portable", "run"]
