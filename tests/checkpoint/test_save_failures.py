"""A save that cannot be written, or is killed, never costs the last complete checkpoint.

* one rank's writes fail (a real OS limit: RLIMIT_FSIZE, so every write past it fails with EFBIG):
  every rank raises the same one-line error, the staging directory is gone, ``latest`` and the
  last checkpoint are as they were, and the engine saves again once the limit is lifted;
* a background save whose first write fails on one rank (ENOSPC, tests/helpers/save_faults.py)
  while the other rank's writer is held until that writer has stopped: no thread removes the
  staging directory, and once the ranks agree it is gone with every marker in it;
* the trainer on two ranks with that full disk at a background save of step 4 (on rank 0, or on
  rank 1 while rank 0 writes its files): the run stops at step 5 on every rank with the save's one
  line and exit status 4, and leaves no staging directory;
* a full disk (a real tmpfs of a few MB, mounted when the test may; skipped with the reason
  otherwise) under ``parallel-latent train --nproc 2``: one line from rank 0, a non-zero exit, no
  raw OSError, nothing else touched;
* kill -9 of every process while a save is being published, then a rerun: it removes the dead
  save's staging directory at start-up and resumes from the last complete checkpoint;
* a one-process writer (consolidate) on a full disk: one line, and no staging directory left.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from parallel_latent.checkpoint import (
    CheckpointSaveError,
    consolidate,
    find_latest_checkpoint,
    load_training_checkpoint,
    save_training_checkpoint,
)
from parallel_latent.checkpoint.saving import PAUSE_BEFORE_PUBLISH_ENV, PAUSE_MARKER
from parallel_latent.cli import main
from tests.helpers.checkpoint_engines import make_engine, train_step
from tests.helpers.make_fixture import FIXTURE
from tests.helpers.pool_training import shared_pool
from tests.helpers.save_faults import failure_known_at_next_vote, full_disk_at, staging_name
from tests.helpers.trainer_runs import (
    REPO,
    TINY,
    TINY_CONFIG,
    cli_command,
    rank_env,
    rank_pids,
    train_args,
    train_records,
)

RUN_RECIPE = ["parallel.tensor_parallel=2", "training.max_steps=4", "checkpoint.save_every=2"]


@pytest.fixture
def train_here(monkeypatch, capfd):
    """``parallel-latent train --nproc 2`` with this process as the launcher (no Python of its own to
    start): its exit status and what it and its ranks printed (stdout, stderr). The environment a
    launched job gets from tests/helpers/trainer_runs.rank_env."""
    for key, value in rank_env().items():
        if key in ("OMP_NUM_THREADS", "DS_ACCELERATOR", "PYTHONUNBUFFERED", "TOKENIZERS_PARALLELISM"):
            monkeypatch.setenv(key, value)

    def train_here(run_dir: Path, *overrides: str):
        capfd.readouterr()
        status = main([*train_args(run_dir, *overrides), "--nproc=2"])
        return status, *capfd.readouterr()

    return train_here


@contextlib.contextmanager
def small_filesystem(path: Path, size: str):
    """A tmpfs of ``size`` mounted at ``path``, or the test skipped with the reason."""
    path.mkdir(parents=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, text=True, check=False
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({mounted.stderr.strip() or 'mount failed'})")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def contents(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


# --------------------------------------------------------------------------- #
# One rank cannot write.
# --------------------------------------------------------------------------- #


def one_rank_fails_task(directory: str):
    engine, model = make_engine(1, 2)  # DP=2: each rank writes its own ZeRO shard
    train_step(engine, model, 0)
    save_training_checkpoint(engine, directory, 1, {"next_step": 1}, export_portable=True)
    train_step(engine, model, 1)
    rank = engine.global_rank
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a signal
    if rank == 1:
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, limits[1]))
    try:
        save_training_checkpoint(engine, directory, 2, {"next_step": 2}, export_portable=True)
        message = None
    except CheckpointSaveError as error:
        message = str(error)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, previous_handler)
    after_failure = contents(Path(directory))
    loaded = load_training_checkpoint(engine, directory)  # the last complete one is intact
    saved_again = save_training_checkpoint(engine, directory, 2, {"next_step": 2}, export_portable=True)
    return message, after_failure, loaded.step, saved_again.name


def test_a_rank_that_cannot_write_fails_the_save_on_every_rank(request, tmp_path):
    # Two ranks shared with the other checkpoint and data modules (tests/helpers/pool_training.py):
    # the task lifts its write limit again whatever happens.
    results = shared_pool(request, 2).run(one_rank_fails_task, str(tmp_path))
    messages = {message for message, *_ in results}
    assert messages == {
        f"checkpoint at step 2 not written: File too large ({tmp_path}); the last complete checkpoint is step 1"
    }
    for _, after_failure, loaded_step, saved_again in results:
        assert after_failure == ["CONVERTING.txt", "latest", "step_00000001"]
        assert loaded_step == 1 and saved_again == "step_00000002"
    assert (tmp_path / "latest").read_text().strip() == "step_00000002"


# --------------------------------------------------------------------------- #
# A background save that fails on one rank.
# --------------------------------------------------------------------------- #


def failure_first_task(directory: str, failing: int):
    """Rank ``failing``'s writer fails at its first write and stops; only then (a barrier of the
    training threads) does the other rank's writer write anything: the order in which a thread that
    removed the staging directory at its own failure would leave a slower rank's marker behind."""
    from parallel_latent.checkpoint.saving import finish_background_save, start_background_save
    from parallel_latent.coordination import barrier

    engine, model = make_engine(1, 2)  # DP=2: each rank writes its own ZeRO shard
    train_step(engine, model, 0)
    save_training_checkpoint(engine, directory, 1, {"next_step": 1})
    train_step(engine, model, 1)
    release = threading.Event()
    with full_disk_at(2, failing, before_write=release.wait):
        pending = start_background_save(engine, directory, 2, {"next_step": 2})
        if engine.global_rank == failing:
            pending.save.wait()  # failed, marked, stopped: all its thread will ever do
        barrier()
        release.set()
        pending.save.wait()
        barrier()  # every writer has stopped, none has been told anything yet
        markers = Path(directory) / staging_name(2) / ".written"
        left_by_the_writers = sorted(p.name for p in markers.iterdir()) if markers.is_dir() else "removed"
        try:
            finish_background_save(pending)
            message = None
        except CheckpointSaveError as error:
            message = str(error)
    return message, left_by_the_writers, contents(Path(directory))


@pytest.mark.parametrize("failing", [0, 1])
def test_the_staging_directory_goes_only_once_every_rank_has_stopped_writing(request, tmp_path, failing):
    results = shared_pool(request, 2).run(failure_first_task, str(tmp_path), failing)
    last = "the last complete checkpoint is step 1"
    want = f"checkpoint at step 2 not written: No space left on device ({tmp_path}); {last}"
    markers = ["rank_00000.failed", "rank_00001.ok"] if failing == 0 else ["rank_00000.ok", "rank_00001.failed"]
    for message, left_by_the_writers, after in results:
        assert message == want
        assert left_by_the_writers == markers  # no writer removed anything
        assert after == ["CONVERTING.txt", "latest", "step_00000001"]  # the staging directory went whole


def test_a_writer_given_up_stops_waiting_for_a_marker_that_never_comes(tmp_path):
    """Rank 0's writer waits for every rank's marker; a rank that could not even write its marker
    (a full disk) leaves none. Once the ranks know the save failed, the wait ends without publishing."""
    from parallel_latent.checkpoint.background import BackgroundSave

    published = []
    save = BackgroundSave(tmp_path, 1, 0, 2, [], lambda: published.append(1), timeout_s=3600.0)
    assert save.outcome() == "writing"  # rank 1's marker is not there, nor will it be
    save.give_up()
    assert save.wait() == (None, None)
    assert save.outcome() == "failed" and published == []
    assert (tmp_path / ".written" / "rank_00000.ok").exists()  # nothing removed: not the thread's to do


def full_disk_run_task(run_dir: str, failing: int):
    """The trainer on this rank with a full disk at rank ``failing``'s writes of the step-4 save:
    what the command would say and its exit status."""
    from parallel_latent.errors import error_line, exit_status, one_line
    from tests.helpers.pool_training import train_task

    overrides = [*TINY, f"logging.run_dir={run_dir}", "parallel.tensor_parallel=1", "parallel.zero_stage=1",
                 "training.max_steps=8", "checkpoint.save_every=2"]  # fmt: skip
    with full_disk_at(4, failing), failure_known_at_next_vote(4, failing):
        try:
            train_task(str(TINY_CONFIG), overrides)
        except CheckpointSaveError as error:
            return int(exit_status(error)), error_line(one_line(error))
    return 0, "trained to the end"


@pytest.mark.parametrize("failing", [0, 1], ids=["rank0-fails", "rank1-fails-rank0-writes"])
def test_a_failed_background_write_stops_the_run_at_the_next_step(request, tmp_path, failing):
    """A full disk at the step-4 save: every rank stops after step 5 (not at the step-6 save) with
    the save's line and exit status 4; the last complete checkpoint is step 2 and nothing else is left."""
    run_dir = tmp_path / "run"
    checkpoints = run_dir / "checkpoints"
    results = shared_pool(request, 2).run(full_disk_run_task, str(run_dir), failing)
    want = (
        f"parallel-latent: error: checkpoint at step 4 not written: No space left on device ({checkpoints}); "
        "the last complete checkpoint is step 2"
    )
    assert results == [(4, want), (4, want)]
    assert [r["step"] for r in train_records(run_dir)] == [1, 2, 3, 4, 5]
    assert contents(checkpoints) == ["CONVERTING.txt", "latest", "step_00000002"]
    assert (checkpoints / "latest").read_text().strip() == "step_00000002"


# --------------------------------------------------------------------------- #
# The trainer on a full disk, and killed while saving.
# --------------------------------------------------------------------------- #


@pytest.mark.slow
def test_full_disk_under_the_trainer_is_one_line_and_keeps_the_last_checkpoint(tmp_path, train_here):
    """One TP=2 checkpoint of the tiny model is 14 MB: 22 MB hold the step-2 save, not step 4's."""
    with small_filesystem(tmp_path / "disk", "22m") as disk:
        run_dir = disk / "run"
        status, stdout, stderr = train_here(run_dir, *RUN_RECIPE)
        said = f"exit {status}\n--- stdout\n{stdout[-4000:]}\n--- stderr\n{stderr[-6000:]}"
        assert status != 0, said
        checkpoints = run_dir / "checkpoints"
        want = (
            f"checkpoint at step 4 not written: No space left on device ({checkpoints}); "
            "the last complete checkpoint is step 2"
        )
        lines = stderr.splitlines()
        assert [line for line in lines if "not written" in line] == [f"parallel-latent: error: {want}"], said
        assert not [line for line in lines if "OSError" in line or "Errno 28" in line], said
        assert contents(checkpoints) == ["CONVERTING.txt", "latest", "step_00000002"], said
        assert (checkpoints / "latest").read_text().strip() == "step_00000002"
        assert find_latest_checkpoint(checkpoints).name == "step_00000002"


@pytest.mark.slow
def test_killed_save_then_rerun_resumes_from_the_last_complete_checkpoint(tmp_path, train_here):
    run_dir = tmp_path / "run"
    checkpoints = run_dir / "checkpoints"
    marker = checkpoints / ".tmp-step_00000004" / PAUSE_MARKER
    job = subprocess.Popen(
        cli_command(run_dir, *RUN_RECIPE, nproc=2),
        cwd=REPO,
        env=rank_env({PAUSE_BEFORE_PUBLISH_ENV: "600@4"}),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 300
        while not marker.exists():
            assert job.poll() is None and time.monotonic() < deadline, "the step-4 save never reached its publish"
            time.sleep(0.2)
        # Everything of step 4 is written; kill -9 every process, ranks first (a node going down).
        for pid in rank_pids(job.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)
        job.wait(timeout=60)
    assert (checkpoints / "latest").read_text().strip() == "step_00000002"
    assert (checkpoints / ".tmp-step_00000004").is_dir()

    # The rerun with this process as its launcher: the killed job was a process of its own.
    status, stdout, stderr = train_here(run_dir, *RUN_RECIPE)
    assert status == 0, f"exit {status}\n--- stdout\n{stdout[-4000:]}\n--- stderr\n{stderr[-6000:]}"
    assert f"removed {checkpoints / '.tmp-step_00000004'}: a checkpoint save that never finished" in stdout
    assert f"resumed from {checkpoints / 'step_00000002'} at step 2" in stdout
    assert (checkpoints / "latest").read_text().strip() == "step_00000004"
    assert not [n for n in contents(checkpoints) if n.startswith(".")]


def test_one_process_writer_on_a_full_disk(tmp_path):
    with small_filesystem(tmp_path / "disk", "64k") as disk:
        with pytest.raises(CheckpointSaveError) as error:
            consolidate(FIXTURE / "portable", disk / "single")
        assert str(error.value) == f"{disk / 'single'}: not written: No space left on device"
        assert contents(disk) == []
