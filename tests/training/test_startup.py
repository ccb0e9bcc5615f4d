"""A refused training job leaves its run directory byte for byte as it found it: the launcher's
checks (another model than the checkpoint's, a read-only or too small file system) and the ranks'
(a corpus found empty when it is prepared) refuse before the run's config, its progress records or
its lock's record change, with one line and status 2. Real ``train --nproc 2`` jobs (gloo), the
launcher in this process, on one trained run."""

from __future__ import annotations

import pytest

from parallel_latent.files import tree_bytes
from tests.helpers.corruption import rewrite_file_record
from tests.helpers.filesystems import directory_bytes, tmpfs
from tests.helpers.in_process_cli import run_main
from tests.helpers.trainer_runs import describe, train_args

pytestmark = pytest.mark.slow  # real jobs: a trained run, and a refusal inside the ranks

STEP = "checkpoints/step_00000002"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Two steps at TP=2 with a checkpoint at each: a run directory with everything a run leaves
    (config, progress records, the lock's record, metrics, checkpoints)."""
    run_dir = tmp_path_factory.mktemp("startup") / "run"
    result = run_main([*train_args(run_dir, "training.max_steps=2", "checkpoint.save_every=1"), "--nproc=2"])
    assert result.returncode == 0, describe(result)
    assert (run_dir / "progress").is_dir() and (run_dir / "train.lock").is_file()
    return run_dir


def refused(run_dir, *overrides, expected: str):
    """``train --nproc 2`` on ``run_dir`` with ``overrides``: refused in one line holding ``expected``."""
    result = run_main([*train_args(run_dir, "training.max_steps=4", *overrides), "--nproc=2"])
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, describe(result)
    assert lines[0].startswith("parallel-latent: error: ") and expected in lines[0], lines[0]


@pytest.mark.parametrize(
    "override, expected",
    [
        ("model.head=normal", "config mismatch: model.head is 'tied' in the checkpoint"),
        # Another decoder: DeepSpeed's state-dict load would end every rank with its traceback.
        ("feature_model.n_layer=4", "config mismatch: feature_model.n_layer is 3 in the checkpoint but 4"),
        ("feature_model.hidden_state=-2", "config mismatch: feature_model.hidden_state is -3 in the checkpoint"),
    ],
)
def test_another_model_than_the_checkpoints_is_refused_before_any_rank_starts(trained, override, expected):
    before = directory_bytes(trained)
    refused(trained, override, expected=expected)
    assert directory_bytes(trained) == before  # config.yaml too: it used to be rewritten first


def test_resuming_another_model_into_a_new_run_directory_creates_nothing(trained, tmp_path):
    before = directory_bytes(trained)
    new = tmp_path / "new"
    refused(new, "model.head=normal", f"checkpoint.resume={trained / STEP}", expected="config mismatch")
    assert not new.exists()
    assert directory_bytes(trained) == before


def test_a_corpus_the_ranks_find_empty_leaves_the_run_directory_as_it_was(trained, tmp_path):
    """Found inside the ranks, once the data is prepared: after the launcher took the lock and the
    ranks joined, before the progress records of the run before, or anything else, changed."""
    blank = tmp_path / "blank.txt"
    blank.write_text("\n   \n\n", encoding="utf-8")
    before = directory_bytes(trained)
    refused(trained, f"data.path={blank}", expected="corpus is empty")
    assert directory_bytes(trained) == before


def test_a_read_only_run_directory_is_one_line(trained, tmp_path):
    size = tree_bytes(trained) // 1024 + 256
    with tmpfs(tmp_path / "ro", f"{size}k", fill=trained.parent, read_only=True) as disk:
        before = directory_bytes(disk)
        refused(disk / "run", expected="read-only file system")
        assert directory_bytes(disk) == before


def test_no_room_for_one_more_checkpoint_is_one_line(trained, tmp_path):
    """A file system that holds the run but not one more of its checkpoints: refused before the
    first step, not at the first save."""
    size = tree_bytes(trained) + tree_bytes(trained / STEP) // 2
    with tmpfs(tmp_path / "small", f"{size // 1024 + 64}k", fill=trained.parent) as disk:
        before = directory_bytes(disk)
        refused(disk / "run", expected="MiB free, but a checkpoint of this run takes")
        assert directory_bytes(disk) == before


def _copy_of(trained, tmp_path):
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir, symlinks=True)
    return run_dir


OPTIMIZER_STATE = "zero_pp_rank_0_mp_rank_00_optim_states.pt"


def test_auto_passes_over_what_is_not_its_own_newest_checkpoint_in_one_line_each(trained, tmp_path):
    """``checkpoint.resume=auto`` (the default) with the newest entries of the checkpoints directory
    each not a checkpoint of this step: a link out of the run named as a newer step, and step 2
    holding step 1's optimizer states (its record rewritten to match). The launcher's plan, which
    read them whole, is what the ranks carry out: each passed over and moved aside in one line, the
    run resumed from step 1 (never from step 2, which the ranks would have taken from its record),
    and it trains on to step 3."""
    import os
    import shutil

    run_dir = _copy_of(trained, tmp_path)
    checkpoints = run_dir / "checkpoints"
    shutil.copy(checkpoints / "step_00000001" / OPTIMIZER_STATE, checkpoints / "step_00000002" / OPTIMIZER_STATE)
    rewrite_file_record(checkpoints / "step_00000002")
    outside = tmp_path / "outside"
    shutil.copytree(checkpoints / "step_00000002", outside)
    os.symlink(outside, checkpoints / "step_00000009")
    result = run_main([*train_args(run_dir, "training.max_steps=3"), "--nproc=2"])
    assert result.returncode == 0, describe(result)
    moved = [line for line in result.stdout.splitlines() if "is truncated or damaged; moved to" in line]
    assert len(moved) == 2, describe(result)
    assert "step_00000009: a link to" in moved[0] and moved[0].endswith("resuming from step_00000001"), moved
    assert f"{OPTIMIZER_STATE}: written at step 1, in the checkpoint of step 2" in moved[1], moved
    assert (checkpoints / ".damaged-step_00000009").is_symlink() and (outside / "checkpoint.json").is_file()
    assert (checkpoints / ".damaged-step_00000002").is_dir()
    assert (checkpoints / "step_00000003").is_dir() and (checkpoints / "latest").read_text().strip() == "step_00000003"


def test_a_checkpoint_named_explicitly_holding_another_steps_file_is_refused_before_anything_is_written(
    trained, tmp_path
):
    run_dir = _copy_of(trained, tmp_path)
    step_dir = run_dir / "checkpoints" / "step_00000002"
    (step_dir / "rng" / "rank_00001.json").write_bytes(
        (run_dir / STEP.replace("2", "1") / "rng" / "rank_00001.json").read_bytes()
    )
    rewrite_file_record(step_dir)
    before = directory_bytes(run_dir)
    refused(
        run_dir,
        f"checkpoint.resume={step_dir}",
        expected="rank_00001.json: the RNG state of step 1, in the checkpoint of step 2",
    )
    assert directory_bytes(run_dir) == before
