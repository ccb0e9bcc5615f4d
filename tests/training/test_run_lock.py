"""One training job per run directory: the lock itself (flock and lease), and real jobs (2 ranks,
gloo): a second ``train`` refused in seconds while the first goes on, ``evaluate`` alongside, a rerun
after kill -9 taking the stale lock over with a notice."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from parallel_latent.checkpoint.saving import PAUSE_BEFORE_PUBLISH_ENV, PAUSE_MARKER
from parallel_latent.training.run_lock import LEASE_EXPIRES_S, LOCK_FILE, RunDirLocked, acquire_run_lock
from tests.helpers.in_process_cli import run_main
from tests.helpers.trainer_runs import (
    REPO,
    TINY_CONFIG,
    cli_command,
    describe,
    rank_env,
    rank_pids,
    train_args,
    train_records,
)

# ------------------------------------------------------------------------------------------- #
# The lock, in this process (two acquisitions are two open files: flock sets them against each other).
# ------------------------------------------------------------------------------------------- #


@pytest.mark.parametrize("use_flock", [True, False], ids=["flock", "lease"])
def test_a_held_lock_refuses_a_second_holder_with_one_line_naming_it(tmp_path, use_flock):
    first = acquire_run_lock(tmp_path, use_flock=use_flock)
    with pytest.raises(RunDirLocked) as refused:
        acquire_run_lock(tmp_path, use_flock=use_flock)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"{tmp_path}: another training job holds this run directory (host {socket.gethostname()}")
    assert f"pid {os.getpid()}" in message and "--wait-for-lock SECONDS" in message
    first.release()
    said = []
    acquire_run_lock(tmp_path, use_flock=use_flock, notice=said.append).release()
    assert said == []  # a released lock is simply taken


@pytest.mark.parametrize("before", ["released", "killed"])
def test_a_holder_between_its_flock_and_its_record_is_named_not_the_job_before_it(tmp_path, before, monkeypatch):
    """A holder writes its record right after taking the flock; a second job refused in between
    reads the record of the job before (released, or killed: its pid gone) and waits for the
    holder's own instead of naming the wrong process."""
    import fcntl
    import json
    import subprocess
    import sys

    from parallel_latent import files

    command = [sys.executable, "-c", "import os; print(os.getpid())"]
    gone = subprocess.run(command, capture_output=True, text=True, check=True)
    state = "released" if before == "released" else "held"
    path = tmp_path / LOCK_FILE
    path.write_text(json.dumps({"host": socket.gethostname(), "pid": int(gone.stdout), "started": 1, "state": state}))
    fd = os.open(path, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the holder, before its record
    holder = {"host": socket.gethostname(), "pid": os.getpid(), "started": 2, "state": "held"}
    waits = []

    def holder_writes_its_record(seconds: float) -> None:  # while the second job waits, whatever the clock
        waits.append(seconds)
        path.write_text(json.dumps(holder))

    monkeypatch.setattr(files.time, "sleep", holder_writes_its_record)
    try:
        with pytest.raises(RunDirLocked) as refused:
            acquire_run_lock(tmp_path)
    finally:
        os.close(fd)
    assert f"pid {os.getpid()}," in str(refused.value), refused.value
    assert len(waits) == 1  # read once more, then named


@pytest.mark.parametrize("use_flock", [True, False], ids=["flock", "lease"])
def test_a_refused_job_leaves_the_lock_file_as_it_found_it(tmp_path, use_flock):
    """Undone (a job refused before it began): a lock file this lock made is gone, and one it found
    holds the bytes it held, the record of the job before."""
    acquire_run_lock(tmp_path, use_flock=use_flock).release(undo=True)
    assert not (tmp_path / LOCK_FILE).exists()
    acquire_run_lock(tmp_path, use_flock=use_flock).release()
    found = (tmp_path / LOCK_FILE).read_bytes()
    acquire_run_lock(tmp_path, use_flock=use_flock).release(undo=True)
    assert (tmp_path / LOCK_FILE).read_bytes() == found
    lock = acquire_run_lock(tmp_path, use_flock=use_flock)
    assert (tmp_path / LOCK_FILE).read_bytes() != found  # (held: its own record)
    lock.release(undo=True)
    assert (tmp_path / LOCK_FILE).read_bytes() == found


def test_waiting_for_the_lock_takes_it_when_the_holder_ends(tmp_path):
    first = acquire_run_lock(tmp_path)
    threading.Timer(1.0, first.release).start()
    started = time.monotonic()
    acquire_run_lock(tmp_path, wait_s=300).release()  # not taken within wait_s: RunDirLocked
    assert time.monotonic() - started > 0.5  # it waited for the release
    held = acquire_run_lock(tmp_path)
    with pytest.raises(RunDirLocked, match=r"after waiting 0\.3 s"):
        acquire_run_lock(tmp_path, wait_s=0.3)
    held.release()


def test_the_lock_of_a_killed_holder_is_taken_over_with_a_notice(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", "from parallel_latent.training.run_lock import acquire_run_lock as a; "
         f"a({str(tmp_path)!r}); print('held', flush=True); import time; time.sleep(600)"],
        cwd=REPO, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunDirLocked, match=f"pid {holder.pid}"):
            acquire_run_lock(tmp_path)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    said = []
    acquire_run_lock(tmp_path, notice=said.append).release()
    assert len(said) == 1 and said[0].startswith(f"{tmp_path}: took over the lock of a training job that is gone")
    assert f"pid {holder.pid}" in said[0]


def test_an_expired_lease_is_taken_over(tmp_path):
    stale = {"host": "gone-node", "pid": 1, "started": 0, "renewed": time.time() - LEASE_EXPIRES_S - 1, "state": "held"}
    (tmp_path / LOCK_FILE).write_text(json.dumps(stale))
    said = []
    lock = acquire_run_lock(tmp_path, use_flock=False, notice=said.append)
    assert len(said) == 1 and "host gone-node, pid 1" in said[0]
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()
    assert json.loads((tmp_path / LOCK_FILE).read_text())["state"] == "released"


def test_rank_0_of_a_job_without_the_nproc_launcher_takes_the_lock(tmp_path, monkeypatch):
    from parallel_latent.config import load_config
    from parallel_latent.parallel import destroy_distributed
    from parallel_latent.training.startup import start_run

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    run_dir = tmp_path / "run"
    held = acquire_run_lock(run_dir)
    try:
        with pytest.raises(RunDirLocked, match="another training job holds this run directory"):
            start_run(load_config(TINY_CONFIG, [f"logging.run_dir={run_dir}", "parallel.tensor_parallel=1"]))
    finally:
        held.release()
        destroy_distributed()


# ------------------------------------------------------------------------------------------- #
# Real jobs.
# ------------------------------------------------------------------------------------------- #

# Saves every 2 steps: the first checkpoint, the one the tests wait for, comes after 2 steps.
JOB = ["checkpoint.save_every=2", "parallel.tensor_parallel=2"]
# The first job's second save (step 4) is held before its publish until the test releases it: the job
# goes on to its last step (6), whose save waits for the held one, so it cannot end while the test
# checks what happens beside it (a condition, not a race against the job's pace).
HELD_AT, STEPS = 4, 6


def _start(run_dir: Path, *overrides: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        cli_command(run_dir, *JOB, *overrides, nproc=2), cwd=REPO, env=rank_env(env), text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip


def _wait_for(path: Path, job: subprocess.Popen) -> None:
    deadline = time.monotonic() + 240
    while not path.exists():
        assert job.poll() is None and time.monotonic() < deadline, f"no {path}"
        time.sleep(0.2)


def _kill(job: subprocess.Popen) -> None:
    for pid in rank_pids(job.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(job.pid, signal.SIGKILL)
    job.wait(timeout=30)


@pytest.mark.slow
def test_a_second_train_on_the_directory_is_refused_while_the_first_goes_on(tmp_path):
    run_dir = tmp_path / "run"
    held = run_dir / "checkpoints" / f".tmp-step_{HELD_AT:08d}" / PAUSE_MARKER
    first = _start(
        run_dir, f"training.max_steps={STEPS}", "checkpoint.export_portable=true",
        env={PAUSE_BEFORE_PUBLISH_ENV: f"600@{HELD_AT}"},
    )  # fmt: skip
    try:
        _wait_for(run_dir / "checkpoints" / "latest", first)
        # Refused, not queued behind the lock: a second job that waited would hold the test until the
        # first ended, which it does only once the test releases its held save.
        second = run_main([*train_args(run_dir, *JOB), "--nproc=2"])
        assert second.returncode == 2, describe(second)
        line = second.stderr.strip().splitlines()[-1]
        assert line.startswith(f"parallel-latent: error: {run_dir}: another training job holds this run directory")
        assert f"host {socket.gethostname()}, pid {first.pid}" in line
        # A read-only command neither takes nor respects it.
        evaluated = run_main(["evaluate", "--checkpoint", str(run_dir)])
        assert evaluated.returncode == 0, describe(evaluated)
        assert "token_accuracy" in evaluated.stdout
        _wait_for(held, first)
        held.unlink()  # the held save publishes, and the first job goes on to its end
        output = first.communicate(timeout=400)[0]
    finally:
        if first.poll() is None:
            _kill(first)
    assert first.returncode == 0, output[-4000:]
    assert [r["step"] for r in train_records(run_dir)] == list(range(1, STEPS + 1))  # no record lost or doubled


@pytest.mark.slow
def test_a_rerun_after_kill_9_takes_the_stale_lock_over(tmp_path):
    run_dir = tmp_path / "run"
    first = _start(run_dir, "training.max_steps=400")
    try:
        _wait_for(run_dir / "checkpoints" / "latest", first)
    finally:
        _kill(first)  # the launcher and its ranks, at once: nobody releases anything
    step = int((run_dir / "checkpoints" / "latest").read_text().strip().split("_")[1])
    result = run_main([*train_args(run_dir, *JOB, f"training.max_steps={step + 2}"), "--nproc=2"])
    assert result.returncode == 0, describe(result)
    assert (
        f"{run_dir}: took over the lock of a training job that is gone (host {socket.gethostname()}, pid {first.pid}"
        in (result.stdout)
    )
    assert "resumed from" in result.stdout
