"""The hang watchdog: its rule, its thread, and real 2-rank jobs with a stopped rank (SIGSTOP).

The end-to-end cases stop rank 1 under ``train --nproc 2`` (the torchrun agent hosts the store), and
rank 0 of a job started as srun or the deepspeed launcher start it (every rank from the environment,
``env://``: rank 0's process hosts the rendezvous store). Either way the job ends soon after
``hang_timeout_s`` (the test allows 200 s more: a bound only a hang breaks) with one line naming the
stalled rank, the other rank's stack is written, and the rerun resumes.
"""

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

from parallel_latent.errors import ExitStatus
from parallel_latent.training.watchdog import PROGRESS_DIR, Progress, Watchdog, find_stall, previous_job_failure
from tests.helpers.in_process_cli import run_main
from tests.helpers.trainer_runs import REPO, TINY, TINY_CONFIG, cli_command, rank_env, rank_pids, train_args

# ------------------------------------------------------------------------------------------- #
# The rule.
# ------------------------------------------------------------------------------------------- #

NOW = 10_000.0
TIMEOUT, LONG = 60.0, 600.0


def record(idle: float, written: float = 1.0, long: bool = False, state: str = "running") -> dict:
    """A rank whose main thread moved ``idle`` s ago and whose watchdog wrote ``written`` s ago."""
    return {"at": NOW - idle, "written_at": NOW - written, "long": long, "state": state}


def stall(*records: dict):
    return find_stall(dict(enumerate(records)), NOW, TIMEOUT, LONG)


def test_a_moving_job_is_not_stalled():
    assert stall(record(1), record(2)) is None
    # One rank waits in a collective for a long time while the other works and moves.
    assert stall(record(TIMEOUT * 5), record(1)) is None


def test_a_rank_whose_process_does_not_run_is_stalled_in_any_phase():
    assert stall(record(1), record(TIMEOUT + 1, written=TIMEOUT + 1, long=True)) == (1, TIMEOUT, False)
    assert stall(record(TIMEOUT + 5, written=TIMEOUT + 5), record(3)) == (0, TIMEOUT, False)


def test_no_progress_anywhere_names_the_rank_that_moved_longest_ago():
    # Rank 1 stopped first; rank 0 then blocked in a collective it waits in for rank 1.
    assert stall(record(TIMEOUT + 1), record(TIMEOUT + 9)) == (1, TIMEOUT, True)
    assert stall(record(TIMEOUT - 1), record(TIMEOUT + 9)) is None  # rank 0 moved within the allowance


def test_a_long_phase_has_its_own_allowance():
    assert stall(record(TIMEOUT + 9, long=True), record(TIMEOUT + 1)) is None
    assert stall(record(LONG + 9, long=True), record(LONG + 1)) == (0, LONG, True)


def test_ranks_that_have_exited_are_left_out():
    done = record(LONG * 10, written=LONG * 10, state="exited")
    assert stall(done, record(1)) is None
    assert stall(done, done) is None


# ------------------------------------------------------------------------------------------- #
# How the job before ended, read from its records when a restarted one starts.
# ------------------------------------------------------------------------------------------- #


def write_records(tmp_path: Path, *records: dict, marker: dict | None = None) -> Path:
    directory = tmp_path / PROGRESS_DIR
    directory.mkdir(parents=True)
    for rank, fields in enumerate(records):
        base = {"rank": rank, "host": f"node{rank}", "pid": 100 + rank, "step": 37, "phase": "backward"}
        (directory / f"rank_{rank:05d}.json").write_text(json.dumps({**base, **fields}))
    if marker is not None:
        (directory / "hang.json").write_text(json.dumps(marker))
    return tmp_path


def test_the_job_before_ended_by_a_rank_that_died_without_a_word(tmp_path):
    run_dir = write_records(
        tmp_path,
        {"state": "exited", "failure": "RuntimeError: Connection reset by peer", "written_at": 5.0},
        {"state": "running", "written_at": 4.0},
    )
    assert previous_job_failure(run_dir) == (
        "rank 1 (host node1, pid 101; last seen at step 37 in backward) stopped without a word"
    )


def test_the_job_before_ended_by_the_first_rank_that_failed(tmp_path):
    run_dir = write_records(
        tmp_path,
        {"state": "exited", "failure": "RuntimeError: Connection reset by peer", "written_at": 6.0},
        {"state": "exited", "failure": "CheckpointSaveError: disk full", "written_at": 5.0},
    )
    assert previous_job_failure(run_dir) == (
        "rank 1 (host node1, pid 101; last seen at step 37 in backward) failed: CheckpointSaveError: disk full"
    )


def test_the_job_before_ended_by_a_stall_or_cleanly(tmp_path):
    hang = {"rank": 1, "host": "node1", "pid": 101, "step": 9, "phase": "optimizer", "idle_s": 61.4}
    run_dir = write_records(tmp_path / "a", {"state": "running"}, {"state": "running"}, marker=hang)
    assert previous_job_failure(run_dir) == (
        "rank 1 (host node1, pid 101; last seen at step 9 in optimizer) stalled (no progress for 61 s)"
    )
    clean = write_records(tmp_path / "b", {"state": "exited"}, {"state": "exited"})
    assert previous_job_failure(clean) is None
    assert previous_job_failure(tmp_path / "nothing") is None


def test_the_job_befores_records_of_another_shape_are_no_traceback(tmp_path):
    """The progress records a resume reads are only a notice's source: records that are not
    objects, or hold values of other types, say what they can and never end start-up."""
    run_dir = write_records(
        tmp_path / "a",
        {"state": "exited", "failure": "OSError: EIO", "written_at": "late", "rank": None},
        {"state": "exited", "failure": "ValueError: x", "written_at": 1.0},
    )
    assert previous_job_failure(run_dir).endswith("failed: OSError: EIO")
    hang = {"rank": 1, "idle_s": "long"}
    assert previous_job_failure(write_records(tmp_path / "b", {}, {}, marker=hang)).endswith("(no progress for 0 s)")
    progress = write_records(tmp_path / "c", {"state": "exited"}, {"state": "exited"}) / PROGRESS_DIR
    (progress / "hang.json").write_text("[1, 2]")
    (progress / "rank_00000.json").write_text('"running"')
    assert previous_job_failure(progress.parent) is None


# ------------------------------------------------------------------------------------------- #
# The thread, in this process (a main thread "stuck" is one that sleeps: nothing else moves it).
# ------------------------------------------------------------------------------------------- #


# Short: the tests that see no alarm wait four times this. Never raced: with one rank, the watcher
# never finds its own record silent (it is running the watch), and only the main thread's idleness is
# measured, against an allowance (30 s for the long phases) far beyond the wait.
UNIT_TIMEOUT_S = 0.5


def watch(tmp_path: Path, phase: str, idle_s: float, timeout_s: float = UNIT_TIMEOUT_S, first_step: bool = False):
    """A one-rank watchdog over a main thread that enters ``phase`` and then does not move for
    ``idle_s``: what it said and how it would have ended the process."""
    said, ended = [], []
    progress = Progress()
    progress.first_step = first_step
    progress.enter(phase, step=7)
    dog = Watchdog(
        progress, tmp_path, 0, 1, timeout_s, 30.0, tmp_path / "stacks",
        report=lambda line, here: said.append((line, here)), exit=ended.append,
    )  # fmt: skip
    dog.start()
    try:
        deadline = time.monotonic() + idle_s
        while time.monotonic() < deadline and not ended:
            time.sleep(0.05)
    finally:
        dog.stop()
    return said, ended


def test_a_main_thread_that_does_not_move_ends_the_process_with_its_stack(tmp_path):
    said, ended = watch(tmp_path, "forward", idle_s=15)
    assert ended == [ExitStatus.HANG]
    [(line, detected_here)] = said
    assert detected_here
    assert line.startswith(f"rank 0 (host {socket.gethostname()}, pid {os.getpid()}) stalled at step 7 in forward")
    assert "its main thread has not moved" in line and str(tmp_path / "stacks") in line
    # faulthandler's dump of every thread, this test's main thread among them.
    assert "test_watchdog.py" in (tmp_path / "stacks" / "stack_rank0.txt").read_text()
    marker = json.loads((tmp_path / PROGRESS_DIR / "hang.json").read_text())
    assert (marker["rank"], marker["step"], marker["phase"], marker["runs"]) == (0, 7, "forward", True)


@pytest.mark.parametrize("phase", ["save", "evaluation", "start-up"])
def test_a_long_phase_longer_than_the_timeout_does_not_fire(tmp_path, phase):
    said, ended = watch(tmp_path, phase, idle_s=4 * UNIT_TIMEOUT_S)
    assert (said, ended) == ([], [])
    assert not (tmp_path / PROGRESS_DIR / "hang.json").exists()
    assert json.loads((tmp_path / PROGRESS_DIR / "rank_00000.json").read_text())["state"] == "exited"


def test_the_watcher_never_finds_its_own_process_silent(tmp_path):
    """A watcher thread that a loaded machine schedules long after it wrote its own record (here: a
    record a minute old) is running, so its rank is not a silent one: no stall, no marker."""
    ended = []
    progress = Progress()
    progress.enter("save", step=3)
    dog = Watchdog(
        progress, tmp_path, 0, 1, UNIT_TIMEOUT_S, 30.0, tmp_path / "stacks", report=lambda *_: None, exit=ended.append
    )  # fmt: skip
    (tmp_path / PROGRESS_DIR).mkdir()
    dog._write("running")
    [record_file] = (tmp_path / PROGRESS_DIR).glob("rank_*.json")
    record = json.loads(record_file.read_text())
    record_file.write_text(json.dumps({**record, "written_at": record["written_at"] - 60}))
    assert dog._watch() is None and ended == []
    assert not (tmp_path / PROGRESS_DIR / "hang.json").exists()


def test_the_first_step_has_the_long_allowance(tmp_path):
    assert watch(tmp_path, "forward", idle_s=4 * UNIT_TIMEOUT_S, first_step=True) == ([], [])


# ------------------------------------------------------------------------------------------- #
# Real jobs: 2 ranks, gloo, one of them stopped.
# ------------------------------------------------------------------------------------------- #

# Over 10x the longest phase of a healthy step here under load; the rank is stopped only once it
# has recorded a step past the first checkpoint, and the timeout counts from its last record.
HANG_TIMEOUT_S = 8
SAVE_EVERY = 2
OVERRIDES = [
    f"training.hang_timeout_s={HANG_TIMEOUT_S}",
    "training.max_steps=100000",  # the job only ends by the watchdog
    f"checkpoint.save_every={SAVE_EVERY}",
    "parallel.tensor_parallel=2",
]


def _progress_record(run_dir: Path, rank: int) -> dict | None:
    with contextlib.suppress(OSError, ValueError):
        return json.loads((run_dir / PROGRESS_DIR / f"rank_{rank:05d}.json").read_text())
    return None


def _stop_rank_after_a_checkpoint(run_dir: Path, rank: int, *jobs: subprocess.Popen, log: Path | None = None) -> int:
    """SIGSTOP ``rank`` once a checkpoint exists and the rank is training; its pid. Every process of
    ``jobs`` must live until then (``log``: where one of them writes, shown if it does not)."""
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        for job in jobs:
            if job.poll() is not None:
                raise AssertionError(f"process {job.pid} ended (exit {job.returncode}) before the stop{_tail(log)}")
        found = _progress_record(run_dir, rank)
        if found and found["step"] > SAVE_EVERY and (run_dir / "checkpoints" / "latest").exists():
            os.kill(found["pid"], signal.SIGSTOP)
            return found["pid"]
        time.sleep(0.2)
    raise AssertionError(f"no checkpoint within 240 s{_tail(log)}")


def _tail(log: Path | None) -> str:
    return "" if log is None else "\n" + log.read_text()[-3000:]


def _end_of(job: subprocess.Popen, stopped_pid: int) -> tuple[float, str]:
    started = time.monotonic()
    try:
        output = job.communicate(timeout=HANG_TIMEOUT_S + 300)[0]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(stopped_pid, signal.SIGKILL)
        if job.poll() is None:
            job.kill()
    return time.monotonic() - started, output


def _rerun_resumes(run_dir: Path, *overrides: str) -> None:
    step = int((run_dir / "checkpoints" / "latest").read_text().strip().split("_")[1])
    # The launcher in this process (its ranks are real processes): one Python start-up fewer.
    result = run_main([*train_args(run_dir, *overrides, f"training.max_steps={step + 3}"), "--nproc=2"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"at step {step}" in result.stdout and "resumed from" in result.stdout


def _assert_names(line: str, rank: int, stopped_pid: int) -> None:
    assert line.startswith(
        f"parallel-latent: error: rank {rank} (host {socket.gethostname()}, pid {stopped_pid}) stalled at step"
    )
    assert "its process does not run" in line and "it wrote no stack" in line


def _kill_after_rank_0_reports(run_dir: Path, stopped_pid: int, job: subprocess.Popen) -> threading.Thread:
    """What torchrun's teardown does to the stopped rank 30 s after its SIGTERM (which stays pending
    in a stopped process), done 3 s after rank 0's failure record is written: SIGKILL. The root
    cause is still rank 0: its record is dated, and a rank that dies without one counts from a
    second before torchrun saw it dead."""

    def kill_later() -> None:
        deadline = time.monotonic() + HANG_TIMEOUT_S + 300
        while job.poll() is None and time.monotonic() < deadline:
            if list((run_dir / "logs").glob("*/torchrun/*/attempt_*/0/error.json")):
                time.sleep(3)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(stopped_pid, signal.SIGKILL)
                return
            time.sleep(0.2)

    thread = threading.Thread(target=kill_later, daemon=True)
    thread.start()
    return thread


@pytest.mark.slow
def test_a_stopped_rank_1_ends_the_job_under_train_nproc(tmp_path):
    run_dir = tmp_path / "run"
    job = subprocess.Popen(
        cli_command(run_dir, *OVERRIDES, nproc=2), cwd=REPO, env=rank_env(), text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        stopped = _stop_rank_after_a_checkpoint(run_dir, 1, job)
    except BaseException:
        for pid in rank_pids(job.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        raise
    _kill_after_rank_0_reports(run_dir, stopped, job)
    took, output = _end_of(job, stopped)
    assert job.returncode == ExitStatus.HANG, output[-4000:]
    assert took <= HANG_TIMEOUT_S + 200, took  # only a job the watchdog left hanging fails
    last = output.strip().splitlines()[-1]
    _assert_names(last, 1, stopped)
    stacks = Path(last.rsplit("Python stacks: ", 1)[1].split(";")[0])
    assert stacks.parent == run_dir / "logs"
    assert "parallel_latent" in (stacks / "stack_rank0.txt").read_text()  # the healthy rank's main thread
    assert not (stacks / "stack_rank1.txt").exists()
    _rerun_resumes(run_dir, *OVERRIDES)


@pytest.mark.slow
def test_a_stopped_rank_0_that_hosts_the_store_ends_the_job(tmp_path):
    """As srun or the deepspeed launcher start a job: each rank from its environment, the
    rendezvous store in rank 0's process, which is the one stopped."""
    from tests.helpers.distributed import free_port

    run_dir = tmp_path / "run"
    port = str(free_port())

    def rank_process(rank: int, stdout) -> subprocess.Popen:
        env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
        return subprocess.Popen(
            [sys.executable, "-m", "parallel_latent", *train_args(run_dir, *OVERRIDES)],
            cwd=REPO, text=True, stdout=stdout, stderr=subprocess.STDOUT,
            env=rank_env({**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}),
        )  # fmt: skip

    # Rank 0 prints every step: a file, never a pipe nobody reads while it trains.
    rank0_log = (tmp_path / "rank0.log").open("w")
    ranks = [rank_process(0, rank0_log), rank_process(1, subprocess.PIPE)]
    try:
        stopped = _stop_rank_after_a_checkpoint(run_dir, 0, *ranks, log=tmp_path / "rank0.log")
        took, output = _end_of(ranks[1], stopped)
    finally:
        for rank in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(rank.pid, signal.SIGKILL)
            rank.wait(timeout=30)
        rank0_log.close()
    assert ranks[1].returncode == ExitStatus.HANG, output[-4000:]
    assert took <= HANG_TIMEOUT_S + 200, took  # only a job the watchdog left hanging fails
    last = output.strip().splitlines()[-1]
    _assert_names(last, 0, stopped)
    stacks = Path(last.rsplit("Python stacks: ", 1)[1].split(";")[0])
    assert "parallel_latent" in (stacks / "stack_rank1.txt").read_text()
    # That a run ended by the watchdog resumes is the rank-1 test's rerun: which rank stalled does
    # not change the checkpoints it left.


def test_the_suite_runs_with_a_short_watchdog():
    """Every end-to-end run of the suite (tests/trainer_runs.TINY) has the watchdog on, with a
    timeout short enough that a false alarm in a healthy run would fail that test."""
    assert any(item.startswith("training.hang_timeout_s=") for item in TINY)
    assert TINY_CONFIG.exists()


STUCK_ACCEPTANCE = """
import sys, time
import parallel_latent.training.preflight as preflight
preflight.preflight = lambda *args, **kwargs: time.sleep(120)  # a read that never returns
from parallel_latent import cli
sys.exit(cli.main(sys.argv[1:]))
"""


def test_a_stuck_acceptance_ends_in_one_line_with_the_run_directory_as_it_was(tmp_path):
    """The launcher's acceptance (before any rank, so before any rank's watchdog) is bounded by
    training.hang_long_phase_s: past it, one line naming where it was stuck, exit status 5, the
    lock given back and the run directory it made removed."""
    run_dir = tmp_path / "run"
    argv = [*train_args(run_dir, "training.hang_long_phase_s=2", "training.hang_timeout_s=2"), "--nproc=2"]
    command = [sys.executable, "-c", STUCK_ACCEPTANCE, *argv]
    result = subprocess.run(command, env=rank_env(), capture_output=True, text=True, timeout=300, check=False)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == ExitStatus.HANG, result.stderr
    assert len(lines) == 1 and lines[0].startswith(
        "parallel-latent: error: acceptance: not done within 2 s (training.hang_long_phase_s); its main thread was at"
    ), lines
    assert "<lambda>" in lines[0] and not run_dir.exists()
