"""Training checkpoints through DeepSpeed on real gloo ranks: exact resume, atomic publish, keep-last-K,
weights-only unpickling, and resharded resume at another TP x DP x ZeRO with Adam's moments."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from parallel_latent.checkpoint import (
    CheckpointError,
    convert_to_universal,
    find_latest_checkpoint,
    inspect,
    load_training_checkpoint,
    read_newest,
    safe_torch_load,
    save_training_checkpoint,
)
from parallel_latent.checkpoint.saving import PAUSE_MARKER
from parallel_latent.checkpoint.shards import PortableCheckpoint
from tests.helpers.checkpoint_engines import (
    ADAM_EPS,
    BETAS,
    WEIGHT_DECAY,
    full_state,
    get_step,
    make_engine,
    train_step,
)
from tests.helpers.tp_compare import max_abs, order_bound, terms_scale, unit_roundoff

REPO = Path(__file__).resolve().parents[2]
# The Stack's longest reduction to a weight gradient: q/k/v (D), scores (D/HEADS), softmax and
# weighted sum over T, the output projection (D), the MLP (D + 4D), the head (D), its softmax over
# the vocabulary, the all-reduces (<= 4 slices) and the GLOBAL_BATCH * T tokens of a gradient.
STACK_REDUCTION = 3 * 32 + 32 // 4 + 2 * 6 + 4 * 32 + 32 + 300 + 4 + 4 + 4 * 6
STEPS, SAVE_AT = 4, 2


def seed_all(seed: int) -> None:
    import random

    import numpy as np

    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def exact_resume_task(tp: int, stage: int, directory: str):
    """Straight run vs run, save, fresh engine (other init, scrambled RNGs), load, run on."""
    engine, model = make_engine(tp, stage)
    seed_all(0)
    straight = [train_step(engine, model, s, noise=True) for s in range(STEPS)]
    want = full_state(engine, model)

    engine, model = make_engine(tp, stage)
    seed_all(0)
    first = [train_step(engine, model, s, noise=True) for s in range(SAVE_AT)]
    save_training_checkpoint(engine, directory, SAVE_AT, {"next_step": SAVE_AT, "losses": first}, keep_last=2)
    del engine, model

    engine, model = make_engine(tp, stage, seed=123)
    seed_all(999)
    loaded = load_training_checkpoint(engine, directory)
    assert not loaded.resharded and loaded.client_state["losses"] == first
    rest = [train_step(engine, model, s, noise=True) for s in range(loaded.client_state["next_step"], STEPS)]
    got = full_state(engine, model)
    unequal = [name for name in want if not torch.equal(want[name], got[name])]
    return straight, first + rest, unequal


@pytest.mark.parametrize("stage", [2, 3])
def test_exact_resume_tp2_dp2(pool4, tmp_path, stage):
    straight, resumed, unequal = pool4.run(exact_resume_task, 2, stage, str(tmp_path))[0]
    assert resumed == straight  # every loss bit-identical, also the steps after the resume
    assert unequal == []  # weights, fp32 masters and Adam moments bit-identical


def weights_only_task(directory: str):
    """Resume, recording every torch.load call DeepSpeed makes."""
    engine, _ = make_engine(2, 2)
    calls = []
    original = torch.load

    def recording_load(*args, **kwargs):
        calls.append(kwargs.get("weights_only"))
        return original(*args, **kwargs)

    torch.load = recording_load
    try:
        load_training_checkpoint(engine, directory)
    finally:
        torch.load = original
    return calls


def save_task(tp: int, stage: int, directory: str, step: int, keep_last: int = 0):
    engine, model = make_engine(tp, stage)
    for s in range(step):
        train_step(engine, model, s)
    save_training_checkpoint(engine, directory, step, {"next_step": step}, keep_last=keep_last, export_portable=True)
    before = full_state(engine, model)
    train_step(engine, model, step)
    return before, full_state(engine, model)


def test_deepspeed_files_load_weights_only(pool4, tmp_path):
    pool4.run(save_task, 2, 2, str(tmp_path), 1)
    calls = pool4.run(weights_only_task, str(tmp_path))
    assert all(calls) and all(c is True for rank_calls in calls for c in rank_calls)
    # Every DeepSpeed file of the checkpoint loads with weights_only=True and the allowlist.
    files = sorted((tmp_path / "step_00000001").glob("*.pt"))
    assert len(files) == 2 + 4  # model states per TP rank, ZeRO shards per rank
    for path in files:
        safe_torch_load(path)


class Payload:
    def __reduce__(self):
        return (os.system, ("touch /tmp/parallel-latent-pwned",))


def test_unsafe_pickle_is_reported_not_loaded(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"x": torch.ones(2), "payload": Payload()}, path)
    with pytest.raises(CheckpointError, match="weights_only=True") as error:
        safe_torch_load(path)
    assert "\n" not in str(error.value)
    assert not Path("/tmp/parallel-latent-pwned").exists()


def test_keep_last_and_latest(pool4, tmp_path):
    for step in (1, 2, 3):
        pool4.run(save_task, 2, 2, str(tmp_path), step, 2)
    names = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step_"))
    assert names == ["step_00000002", "step_00000003"]
    assert (tmp_path / "latest").read_text().strip() == "step_00000003"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    # A crash between publishing step 3 and moving latest (latest lags behind it): step 3 is resumed.
    (tmp_path / "latest").write_text("step_00000002\n")
    assert find_latest_checkpoint(tmp_path).name == "step_00000003"
    # A crash between the two renames of a re-save (latest names a missing dir): newest complete wins.
    (tmp_path / "latest").write_text("step_00000009\n")
    assert find_latest_checkpoint(tmp_path).name == "step_00000003"
    text = inspect(tmp_path)
    assert "step 3" in text and "TP=2 x DP=2" in text and "ZeRO stage 2" in text and "head.weight" in text


def save_with_a_failing_prune_task(directory: str) -> list[str]:
    """save_task at step 1, with pruning failing as a file system that refuses a deletion does; what
    this rank logged."""
    import logging

    from parallel_latent.checkpoint import layout

    def refuse(*args):
        raise PermissionError(13, "Permission denied", str(Path(directory) / "step_00000000"))

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("parallel_latent.checkpoint").addHandler(handler)
    original, layout.prune_checkpoints = layout.prune_checkpoints, refuse
    try:
        save_task(2, 2, directory, 1, 1)
    finally:
        layout.prune_checkpoints = original
        logging.getLogger("parallel_latent.checkpoint").removeHandler(handler)
    return records


def test_a_failed_prune_says_the_checkpoint_was_written(pool4, tmp_path):
    """Pruning runs after the publish: its failure is a warning that the checkpoint was written, not
    a "not written" error about a checkpoint that is complete and resumable."""
    logged = pool4.run(save_with_a_failing_prune_task, str(tmp_path))
    assert (tmp_path / "latest").read_text().strip() == "step_00000001"
    assert [line for line in logged[0] if "pruning" in line] == [
        f"checkpoint at step 1 written; pruning older checkpoints in {tmp_path} failed: Permission denied"
    ], logged[0]


@pytest.mark.slow  # a real job, killed
def test_kill_9_before_publish_keeps_previous_latest(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.helpers.save_and_die", str(tmp_path)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    marker = tmp_path / ".tmp-step_00000002" / PAUSE_MARKER
    deadline = time.time() + 240
    while not marker.exists():
        assert process.poll() is None, process.stdout.read().decode()[-3000:]
        assert time.time() < deadline, "the save never reached the publish step"
        time.sleep(0.2)
    # Everything of step 2 is written and fsynced; only the rename and `latest` are left.
    assert (tmp_path / ".tmp-step_00000002" / "checkpoint.json").is_file()
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    assert (tmp_path / "latest").read_text().strip() == "step_00000001"
    assert not (tmp_path / "step_00000002").exists()
    assert find_latest_checkpoint(tmp_path).name == "step_00000001"
    with pytest.raises(CheckpointError, match="unfinished save"):
        load_training_checkpoint(None, tmp_path / ".tmp-step_00000002")
    loaded = subprocess.run(
        [sys.executable, "-m", "tests.helpers.save_and_die", str(tmp_path), "--load"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert "loaded step 1 next 1" in loaded.stdout, loaded.stdout[-2000:] + loaded.stderr[-3000:]


def resume_task(tp: int, stage: int, directory: str):
    engine, model = make_engine(tp, stage, seed=77)
    loaded = load_training_checkpoint(engine, directory)
    before = full_state(engine, model)
    lr = engine.optimizer.param_groups[0]["lr"]
    train_step(engine, model, loaded.client_state["next_step"])
    return loaded.resharded, before, full_state(engine, model), lr, engine.global_steps, get_step(engine)


def assert_resharded_resume(pool4, directory: Path, source, tp: int, stage: int):
    """Everything is carried over bit for bit; the step after it uses it.

    The weights after that step are not compared with the straight run's: Adam divides each
    gradient by sqrt(v) + eps, which can turn the fp32 summation-order difference of a gradient
    that is ~0 into a visible update difference (tests/helpers/tp_compare.py). Two checks that cannot be
    fooled by that, and together say the step used the carried-over state:

    * the moments after the step equal the straight run's up to the gradient's summation-order
      bound (m and v are linear and quadratic in the gradient: nothing is amplified), which moments
      reset to zero would miss by (1 - beta) * m, orders of magnitude more;
    * the weights moved by exactly the Adam update that these moments, the carried-over step count
      and the restored learning rate give (same process, same tensors: only rounding differs).
    """
    want_before, want_after = source
    resharded, before, after, lr, global_steps, step = pool4.run(resume_task, tp, stage, str(directory))[0]
    assert resharded
    assert before.keys() == want_before.keys()
    for name in want_before:  # weights, fp32 masters, exp_avg, exp_avg_sq: carried over exactly
        assert torch.equal(before[name], want_before[name]), name
    assert lr == 1e-2 and global_steps == 4 and step == 4  # scheduler (past warmup) and counters
    beta1, beta2 = BETAS
    u = unit_roundoff(torch.float32)
    for name in [n.removeprefix("fp32/") for n in want_after if n.startswith("fp32/")]:
        m0, w0 = before[f"exp_avg/{name}"], before[f"fp32/{name}"]
        m1, v1, w1 = after[f"exp_avg/{name}"], after[f"exp_avg_sq/{name}"], after[f"fp32/{name}"]
        # The straight run's gradient, recovered from its moments, sets the scale of the bound.
        grad = (want_after[f"exp_avg/{name}"] - beta1 * m0) / (1 - beta1)
        delta = order_bound(STACK_REDUCTION, terms_scale(max_abs([grad]), STACK_REDUCTION))
        assert (m1 - want_after[f"exp_avg/{name}"]).abs().max().item() <= (1 - beta1) * delta + 4 * u * max_abs([m1])
        v_bound = (1 - beta2) * (2 * max_abs([grad]) + delta) * delta + 4 * u * max_abs([v1])
        assert (v1 - want_after[f"exp_avg_sq/{name}"]).abs().max().item() <= v_bound, name
        # AdamW as torch computes it, in float64 from this run's own fp32 tensors.
        m1, v1, w0 = m1.double(), v1.double(), w0.double()
        update = (m1 / (1 - beta1**step)) / ((v1 / (1 - beta2**step)).sqrt() + ADAM_EPS)
        expected = w0 * (1 - lr * WEIGHT_DECAY) - lr * update
        # About ten roundings of fp32 operations on w and on the update.
        bound = 10 * u * (w0.abs() + lr * update.abs())
        assert ((w1.double() - expected).abs() <= bound).all(), name
        assert torch.equal(after[f"model/{name}"], w1), name  # the model runs with the updated masters


@pytest.fixture(scope="module")
def source_tp2_zero2(pool4, tmp_path_factory):
    """A TP=2 x DP=2 ZeRO-2 checkpoint whose universal state is already there (converted offline)."""
    directory = tmp_path_factory.mktemp("reshard") / "z2"
    source = pool4.run(save_task, 2, 2, str(directory), 3)[0]
    convert_to_universal(directory / "step_00000003")
    return directory, source


@pytest.mark.parametrize("tp,stage", [(4, 3), (1, 1), (2, 0)])
def test_resharded_resume_from_saved_universal_state(pool4, source_tp2_zero2, tp, stage):
    directory, source = source_tp2_zero2
    assert_resharded_resume(pool4, directory, source, tp, stage)


@pytest.mark.parametrize("source_stage,tp,stage", [(3, 1, 1), (0, 4, 3)])
def test_resharded_resume_converting_deepspeed_files(pool4, tmp_path, source_stage, tp, stage):
    source = pool4.run(save_task, 2, source_stage, str(tmp_path), 3)[0]
    assert not (tmp_path / "step_00000003" / "universal").exists()
    assert_resharded_resume(pool4, tmp_path, source, tp, stage)
    assert (tmp_path / "step_00000003" / "universal" / "manifest.json").is_file()


def test_offline_conversion_equals_the_engine_state(source_tp2_zero2, tmp_path):
    """The one producer of the universal state against the engine the checkpoint came from: every
    fp32 master, Adam moment and frozen tensor bit for bit, and Adam's step count."""
    directory, (before, _) = source_tp2_zero2
    converted = PortableCheckpoint(convert_to_universal(directory / "step_00000003", tmp_path / "converted"))
    assert converted.manifest["optimizer"]["step"] == 3
    want = {}
    for key, value in before.items():
        kind, name = key.split("/", 1)
        if kind != "model":
            want[key] = value  # fp32/, exp_avg/, exp_avg_sq/ of a trained parameter
        elif f"fp32/{name}" not in before:
            want[f"state/{name}"] = value  # a frozen parameter or a buffer
    assert converted.tensors.keys() == want.keys()
    for name in want:
        assert torch.equal(converted.read_full(name), want[name]), name


def test_a_snapshot_keeps_a_tied_weight_one_tensor_and_is_not_changed_by_later_steps():
    """The state a background save takes off the training tensors: a weight under two names (a
    tied table; module.state_dict gives each name its own detached view) stays one tensor, so
    torch.save writes it once, as the synchronous save does; later in-place updates do not reach it;
    the next save copies into the same host buffers (a fresh buffer's page faults are most of a
    copy's time on a CPU)."""
    from parallel_latent.checkpoint.background import HostCopies, snapshot

    table, flat = torch.randn(8, 4), torch.zeros(10)
    state = {"module": {"encoder.table": table.detach(), "head.weight": table.detach(), "part": flat[2:6]},
             "groups": [{"lr": 0.1}]}  # fmt: skip
    copies = HostCopies()
    copies.begin()
    copied, before = snapshot(state, copies, ("file",)), table.clone()
    assert copied["module"]["encoder.table"] is copied["module"]["head.weight"]
    assert copied["module"]["part"].untyped_storage().nbytes() == 4 * 4  # the view's elements, not the flat's
    table.add_(1.0)
    flat.add_(1.0)
    assert torch.equal(copied["module"]["head.weight"], before) and not copied["module"]["part"].any()
    assert copied["groups"] == [{"lr": 0.1}] and copied["groups"] is not state["groups"]
    copies.begin()
    again = snapshot(state, copies, ("file",))
    assert again["module"]["head.weight"] is copied["module"]["head.weight"]  # the same buffer, refilled
    assert torch.equal(again["module"]["head.weight"], table) and again["module"]["part"].eq(1.0).all()


def _published(checkpoints, step: int) -> Path:
    step_dir = checkpoints / f"step_{step:08d}"
    (step_dir / "model").mkdir(parents=True)
    (step_dir / "model" / "manifest.json").write_text("{}")
    (step_dir / "checkpoint.json").write_text("{}")
    (checkpoints / "latest").write_text(step_dir.name + "\n")
    return step_dir


def test_a_reader_of_a_run_that_prunes_meanwhile_reads_the_newest_checkpoint(tmp_path):
    """A read-only command on a run that trains: the checkpoint ``latest`` named is pruned (a newer
    one published) before the reader opens it; the reader resolves the newest again. A checkpoint
    named explicitly, or one still there when reading fails, is not retried."""
    checkpoints = tmp_path / "checkpoints"
    _published(checkpoints, 1)
    seen = []

    def read(directory: Path) -> str:
        seen.append(directory.parent.name)
        if len(seen) == 1:  # the job publishes step 2 and prunes step 1 under the reader
            _published(checkpoints, 2)
            shutil.rmtree(directory.parent)
            raise CheckpointError(f"{directory}: not a portable checkpoint (manifest.json missing)")
        return directory.parent.name

    assert read_newest(tmp_path, read) == "step_00000002"
    assert seen == ["step_00000001", "step_00000002"]

    def damaged(directory: Path) -> str:
        seen.append(directory.parent.name)
        raise CheckpointError(f"{directory}: damaged")

    seen.clear()
    with pytest.raises(CheckpointError, match="damaged"):
        read_newest(tmp_path, damaged)
    assert seen == ["step_00000002"]


def test_a_lagging_latest_is_a_notice_of_the_plan_not_said_while_planning(tmp_path, caplog):
    """The plan reads the checkpoints once, for every rank (training/preflight.py): the notice that
    ``latest`` lags behind a newer complete one is kept in the plan, which rank 0 says once, instead
    of being said by the process that plans (a launcher whose ranks say it)."""
    from parallel_latent.training.preflight import _notices_kept

    for step in (2, 3):
        (tmp_path / f"step_{step:08d}").mkdir()
        (tmp_path / f"step_{step:08d}" / "checkpoint.json").write_text(f'{{"step": {step}}}')
    (tmp_path / "latest").write_text("step_00000002\n")
    notices: list[str] = []
    with caplog.at_level("WARNING", logger="parallel_latent"), _notices_kept(notices):
        assert find_latest_checkpoint(tmp_path).name == "step_00000003"
    assert not caplog.records
    assert notices == [f"{tmp_path / 'latest'} names step_00000002; step_00000003 is newer and complete: using it"]
