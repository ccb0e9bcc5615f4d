"""What the terminal shows when training runs as several processes (parallel_latent/launching/: reports.py, agent.py),
counted in lines of stderr of real jobs: `parallel-latent train --nproc 2` and plain torchrun, with
faults injected into one rank by tests/helpers/worker_faults/sitecustomize.py."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from parallel_latent.errors import PROG
from tests.helpers.in_process_cli import run_main
from tests.helpers.trainer_runs import (
    REPO,
    cli_command,
    describe,
    interrupt,
    rank_env,
    rank_pids,
    run,
    torchrun_command,
    train_args,
)

DP2 = ["parallel.tensor_parallel=1", "parallel.zero_stage=2"]  # DeepSpeed's ZeRO collectives at DP > 1
FAULTS = str(REPO / "tests" / "helpers" / "worker_faults")


def train_nproc(run_dir: Path, *overrides: str, env: dict | None = None):
    """``parallel-latent train --nproc 2``, the launcher in this process (its ranks are real
    processes, whose output it captures with its own): a subprocess's exit status and output."""
    return run_main([*train_args(run_dir, *overrides), "--nproc=2"], env=env)


def fault_env(fault: str, rank: int = 1, step: int = 2) -> dict:
    return {"PYTHONPATH": FAULTS, "PL_FAULT": fault, "PL_FAULT_RANK": str(rank), "PL_FAULT_STEP": str(step)}


@pytest.mark.slow
def test_notices_once_and_bad_input_inside_the_ranks_is_one_line(tmp_path):
    """A run at DP=2 says its notices once (rank 1's go to its log file) and shows no deprecation
    warning from DeepSpeed's collectives; resuming it as another model (another vocabulary head:
    found inside the ranks, when they read the checkpoint) prints exactly one line and exits 2, with
    nothing left behind in the run directory and the checkpoint intact."""
    run_dir = tmp_path / "run"
    first = train_nproc(run_dir, *DP2, "training.max_steps=2")
    assert first.returncode == 0, describe(first)
    assert first.stderr == "", describe(first)  # before: the banner twice, DeepSpeed's FutureWarning twice
    assert first.stdout.count("the GPT-2 features are RANDOM") == 1
    before = sorted(p.relative_to(run_dir) for p in run_dir.rglob("*"))

    resumed = train_nproc(run_dir, *DP2, "training.max_steps=3", "model.head=normal")
    assert resumed.returncode == 2, describe(resumed)
    lines = resumed.stderr.splitlines()
    assert len(lines) == 1, describe(resumed)
    assert lines[0].startswith("parallel-latent: error: ")
    assert "config mismatch: model.head is 'tied' in the checkpoint but 'normal' in the model" in lines[0]
    assert sorted(p.relative_to(run_dir) for p in run_dir.rglob("*")) == before


@pytest.mark.slow
def test_unexpected_failure_in_a_rank_ends_with_its_line(tmp_path):
    """Rank 1 raises at step 2: the last line is its reason, after the path of its traceback;
    rank 0's consequence (its peer is gone) is not what the user is told."""
    run_dir = tmp_path / "run"
    result = train_nproc(run_dir, "training.max_steps=3", env=fault_env("raise"))
    assert result.returncode == 1, describe(result)
    lines = result.stderr.splitlines()
    assert len(lines) == 2, describe(result)
    assert lines[1] == "parallel-latent: error: rank 1: RuntimeError: injected fault at step 2"
    prefix = "parallel-latent: traceback of rank 1: "
    assert lines[0].startswith(prefix), lines
    traceback = Path(lines[0].removeprefix(prefix)).read_text()
    assert "Traceback (most recent call last)" in traceback
    assert traceback.endswith("RuntimeError: injected fault at step 2\n")
    assert Path(lines[0].removeprefix(prefix)).parent.parent == run_dir / "logs"


@pytest.mark.slow
def test_a_rank_killed_without_a_word_is_named(tmp_path):
    """Rank 1 is killed (as the out-of-memory killer does): the one line names it, not rank 0's
    "connection reset by peer" that follows."""
    result = train_nproc(tmp_path / "run", "training.max_steps=3", env=fault_env("kill"))
    assert result.returncode == 128 + signal.SIGKILL, describe(result)  # the shell's status of a killed command
    assert result.stderr.splitlines() == ["parallel-latent: error: rank 1 was killed by SIGKILL (out of memory?)"]


# One rank's entry in torchrun's ChildFailedError report: (its time, to the second; its rank; the rest).
TORCHRUN_FAILURE = re.compile(
    r"^\[\d+\]:\n  time      : (\S+)\n  host      : [^\n]*\n  rank      : (\d+) \(local_rank: \d+\)\n"
    r"(.*?)(?=^\[\d+\]:|^[-=]{3,}|\Z)",
    re.M | re.S,
)


@pytest.mark.slow
def test_under_plain_torchrun_the_failing_rank_still_says_why(tmp_path):
    """torchrun keeps its own report; the failing rank prints its one line after its traceback, and
    torchrun's report shows that rank's traceback (from the error file). torchrun's root cause is the
    failure with the earliest whole-second timestamp, a tie going to the lowest rank: rank 0's
    consequence (its peer is gone) may share rank 1's second, never precede it."""
    command = torchrun_command(tmp_path / "run", "training.max_steps=3", nproc=2)
    result = run(command, env=fault_env("raise"))
    assert result.returncode != 0, describe(result)
    assert "parallel-latent: error: rank 1: RuntimeError: injected fault at step 2" in result.stderr.splitlines()
    assert "Root Cause (first observed failure)" in result.stderr, describe(result)
    report = result.stderr[result.stderr.index("Failures:") :]
    entries = {int(rank): (when, rest) for when, rank, rest in TORCHRUN_FAILURE.findall(report)}
    assert 1 in entries and "RuntimeError: injected fault at step 2" in entries[1][1], describe(result)
    root_when, root_rank, _ = TORCHRUN_FAILURE.search(report, report.index("Root Cause")).groups()
    assert int(root_rank) == 1 or root_when == entries[1][0], describe(result)


@pytest.mark.slow
def test_a_failed_preparation_ends_every_rank_with_the_preparing_rank_s_line(tmp_path):
    """Under plain torchrun rank 0 prepares the corpus for both ranks and fails unexpectedly: rank 1,
    which learns of it and stops too, says rank 0's line (not a bad-input line of its own), so the
    job's line and status are rank 0's whichever rank's report torchrun reads first."""
    cache, logs = f"data.cache_dir={tmp_path / 'cache'}", tmp_path / "torchrun"
    command = torchrun_command(
        tmp_path / "run", cache, "training.max_steps=1", nproc=2, extra=["--standalone", f"--log-dir={logs}"]
    )
    result = run(command, env=fault_env("prepare", 0))
    assert result.returncode == 1, describe(result)
    said = {line for line in result.stderr.splitlines() if line.startswith("parallel-latent: error:")}
    assert said == {"parallel-latent: error: rank 0: RuntimeError: injected fault while preparing"}, describe(result)
    # What each rank told torchrun (rank 1 may be stopped before it writes): rank 0's failure, status 1.
    records = [json.loads(path.read_text())["parallel_latent"] for path in logs.rglob("error.json")]
    assert records, describe(result)
    for record in records:
        assert (record.get("rank", 0), record["reason"], record["exit_code"]) == (
            0,
            "RuntimeError: injected fault while preparing",
            1,
        ), records


@pytest.mark.slow
def test_ctrl_c_during_start_up_says_interrupted_and_exits_130(tmp_path):
    """Rank 1 never joins, so the job stays in its start-up, where a signal has its usual effect: the
    terminal's Ctrl-C, which the launcher forwards to the ranks as SIGTERM, ends the job as Ctrl-C ends
    any command (one line, 130), not as a stop by the cluster (143)."""
    job = subprocess.Popen(
        cli_command(tmp_path / "run", "training.hang_long_phase_s=300", nproc=2),
        cwd=REPO,
        env=rank_env(fault_env("hang", rank=1, step=0)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 300  # only a hang: the ranks start within seconds
        while len([pid for pid in rank_pids(job.pid) if b"launching.agent" not in _cmdline(pid)]) < 2:
            assert job.poll() is None and time.monotonic() < deadline, "the ranks did not start"
            time.sleep(0.2)
    except BaseException:
        job.kill()
        job.wait()
        raise
    stderr = interrupt(job, timeout_s=300)
    assert job.returncode == 130, stderr
    assert stderr.strip().splitlines() == [f"{PROG}: error: interrupted"], stderr


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def test_a_rank_that_stops_for_another_rank_s_failure_reports_that_rank_and_reason(tmp_path, monkeypatch):
    """Rank 0 stops because rank 1 failed (a failure every rank learns of from a collective): its
    record carries rank 1 and rank 1's reason, so the job's line is the same whichever of the two
    records the launcher takes as the first, a race the records' times cannot settle."""
    from parallel_latent.errors import ExitStatus, PeerFailure
    from parallel_latent.launching.reports import failure_lines, report_failure

    error_file = tmp_path / "error.json"
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    monkeypatch.setenv("PARALLEL_LATENT_WORKER_LOGS", str(tmp_path))
    try:
        raise PeerFailure(1, "RuntimeError: injected fault in shard 1")
    except PeerFailure as error:
        assert report_failure(error, ExitStatus.FAILURE) == ExitStatus.FAILURE
    record = json.loads(error_file.read_text())["parallel_latent"]
    assert (record["rank"], record["reason"]) == (1, "RuntimeError: injected fault in shard 1")
    lines, status = failure_lines(0, None, record, tmp_path)
    assert status == ExitStatus.FAILURE
    assert lines[-1] == "parallel-latent: error: rank 1: RuntimeError: injected fault in shard 1"
    assert lines[0] == f"parallel-latent: traceback of rank 1: {tmp_path / 'rank1.log'}"


def test_a_job_whose_ranks_were_all_stopped_by_sigterm_says_it_stopped_in_its_start_up(tmp_path):
    """torchrun's teardown sends SIGTERM to the ranks beside one that failed; only a stop from
    outside (a Ctrl-C that `train --nproc` forwards, the cluster's SIGTERM) ends every rank with it,
    and only during start-up, when the signal has its usual effect: one line, and the shell's 143."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from parallel_latent.errors import PROG, ExitStatus
    from parallel_latent.launching.agent import _root_cause
    from parallel_latent.launching.reports import failure_lines
    from parallel_latent.launching.worker_logs import INTERRUPTED_MARKER

    stopped = {rank: ProcessFailure(rank, 1000 + rank, -signal.SIGTERM, str(tmp_path / "none")) for rank in (0, 1)}
    lines, status = failure_lines(*_root_cause(ChildFailedError("train", stopped)), tmp_path)
    assert lines == [f"{PROG}: error: stopped by SIGTERM during start-up, before the first step (nothing to save)"]
    assert status == 128 + signal.SIGTERM
    (tmp_path / INTERRUPTED_MARKER).touch()  # the SIGTERM was a terminal's Ctrl-C, forwarded by the launcher
    lines, status = failure_lines(*_root_cause(ChildFailedError("train", stopped)), tmp_path)
    assert lines == [f"{PROG}: error: interrupted"] and status == ExitStatus.INTERRUPTED
    (tmp_path / INTERRUPTED_MARKER).unlink()
    killed = {**stopped, 1: ProcessFailure(1, 1001, -signal.SIGKILL, str(tmp_path / "none"))}
    lines, status = failure_lines(*_root_cause(ChildFailedError("train", killed)), tmp_path)
    assert lines == [f"{PROG}: error: rank 1 was killed by SIGKILL (out of memory?)"] and status == 128 + signal.SIGKILL
    silent = {**stopped, 1: ProcessFailure(1, 1001, 3, str(tmp_path / "none"))}
    lines, status = failure_lines(*_root_cause(ChildFailedError("train", silent)), tmp_path)
    assert lines == [f"{PROG}: error: rank 1 exited with status 3 without saying why"] and status == 1


def test_a_stop_the_launcher_forwarded_is_the_cause_of_what_the_other_ranks_meet_after_it(tmp_path):
    """The launcher forwards a SIGTERM (or a Ctrl-C) to ranks one of which has begun training and one
    of which has not: the one in start-up dies of it; the one training only notes it, meets the dead
    rank in its next collective and records that ("connection closed by peer"). The stop is the
    cause: its time, which the launcher writes before it forwards it, precedes that record. A
    failure recorded before the stop stays the cause; without a forwarded stop, a SIGTERM is
    torchrun's teardown and the record is the cause."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from parallel_latent.errors import PROG, ExitStatus
    from parallel_latent.launching.agent import _root_cause
    from parallel_latent.launching.reports import RECORD_KEY, failure_lines
    from parallel_latent.launching.worker_logs import mark_stop, stop_time

    def job(recorded_at: float) -> ChildFailedError:
        error_file = tmp_path / f"error-{recorded_at}.json"
        reason = "RuntimeError: Connection closed by peer [127.0.0.1]:9616"
        record = {"reason": reason, "exit_code": ExitStatus.FAILURE, "time": recorded_at}
        message = {"message": reason, "extraInfo": {"py_callstack": reason, "timestamp": str(int(recorded_at))}}
        error_file.write_text(json.dumps({"message": message, RECORD_KEY: record}))  # as reports.py writes it
        return ChildFailedError("train", {
            0: ProcessFailure(0, 1000, -signal.SIGTERM, str(tmp_path / "none")),
            1: ProcessFailure(1, 1001, 1, str(error_file)),
        })  # fmt: skip

    def line(failed: ChildFailedError) -> tuple[str, int]:
        lines, status = failure_lines(*_root_cause(failed, stop_time(tmp_path)), tmp_path)
        return lines[-1], status

    assert stop_time(tmp_path) is None
    assert line(job(time.time())) == (f"{PROG}: error: rank 1: RuntimeError: Connection closed by peer "
                                      "[127.0.0.1]:9616", ExitStatus.FAILURE)  # fmt: skip
    mark_stop(tmp_path, interrupted=False)
    stopped = stop_time(tmp_path)
    assert line(job(stopped + 0.01)) == (
        f"{PROG}: error: stopped by SIGTERM during start-up, before the first step (nothing to save)",
        128 + signal.SIGTERM,
    )
    assert line(job(stopped - 5))[0].endswith("rank 1: RuntimeError: Connection closed by peer [127.0.0.1]:9616")
    (tmp_path / "stopped").unlink()
    mark_stop(tmp_path, interrupted=True)
    assert line(job(stop_time(tmp_path) + 0.01)) == (f"{PROG}: error: interrupted", ExitStatus.INTERRUPTED)


ELASTIC = {"TORCHELASTIC_RESTART_COUNT": "1", "TORCHELASTIC_MAX_RESTARTS": "3"}


@pytest.mark.parametrize(
    ("env", "before", "step", "line"),
    [
        ({}, "rank 1 ... stopped without a word", 30, None),  # a first attempt says nothing
        (
            ELASTIC,
            "rank 1 (host h, pid 7; last seen at step 37 in backward) stopped without a word",
            30,
            "restart 1 of 3 (attempt 2): rank 1 (host h, pid 7; last seen at step 37 in backward) stopped without "
            "a word; resuming from step 30",
        ),
        (
            ELASTIC,
            None,
            None,
            "restart 1 of 3 (attempt 2): the attempt before left no record of how it ended; no checkpoint yet: "
            "starting afresh",
        ),
        (
            {"SLURM_RESTART_COUNT": "2"},
            "rank 0 (...) failed: RuntimeError: x",
            10,
            "requeued job, start 3 (SLURM_RESTART_COUNT=2): rank 0 (...) failed: RuntimeError: x; "
            "resuming from step 10",
        ),
    ],
)
def test_a_restarted_job_says_which_restart_how_the_last_attempt_ended_and_where_it_resumes(env, before, step, line):
    from parallel_latent.launching.reports import restart_line

    assert restart_line(before, step, env) == line


def test_a_stop_after_training_began_is_named_as_the_user_gave_it(tmp_path, monkeypatch):
    """The line a stopped run ends with: every rank of ``train --nproc`` hears the launcher's SIGTERM,
    and the launcher's marker says whether the user pressed Ctrl-C (not "SIGTERM")."""
    from parallel_latent.launching.worker_logs import WORKER_LOGS_ENV, mark_stop, stop_cause

    monkeypatch.setenv(WORKER_LOGS_ENV, str(tmp_path))
    assert stop_cause("SIGTERM") == "stopped by SIGTERM"
    assert stop_cause(None) == "stopped by a signal to another rank"
    assert stop_cause("SIGINT") == "interrupted (Ctrl-C)"  # one process from a terminal
    mark_stop(tmp_path, interrupted=True)
    assert stop_cause("SIGTERM") == stop_cause(None) == "interrupted (Ctrl-C)"
    monkeypatch.delenv(WORKER_LOGS_ENV)  # not launched by train --nproc: the signal as received
    assert stop_cause("SIGTERM") == "stopped by SIGTERM"
