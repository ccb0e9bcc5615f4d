"""What the terminal shows when training runs as several processes (parallel_latent/console.py),
counted in lines of stderr of real jobs: `parallel-latent train --nproc 2` and plain torchrun, with
faults injected into one rank by tests/helpers/worker_faults/sitecustomize.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.trainer_runs import REPO, cli_command, describe, run, torchrun_command

DP2 = ["parallel.tensor_parallel=1", "parallel.zero_stage=2"]  # DeepSpeed's ZeRO collectives at DP > 1
FAULTS = str(REPO / "tests" / "helpers" / "worker_faults")


def fault_env(fault: str, rank: int = 1, step: int = 2) -> dict:
    return {"PYTHONPATH": FAULTS, "PL_FAULT": fault, "PL_FAULT_RANK": str(rank), "PL_FAULT_STEP": str(step)}


@pytest.mark.slow
def test_notices_once_and_bad_input_inside_the_ranks_is_one_line(tmp_path):
    """A run at DP=2 says its notices once (rank 1's go to its log file) and shows no deprecation
    warning from DeepSpeed's collectives; resuming it as another model (another vocabulary head:
    found inside the ranks, when they read the checkpoint) prints exactly one line and exits 2, with
    nothing left behind in the run directory and the checkpoint intact."""
    run_dir = tmp_path / "run"
    first = run(cli_command(run_dir, *DP2, "training.max_steps=2", nproc=2))
    assert first.returncode == 0, describe(first)
    assert first.stderr == "", describe(first)  # before: the banner twice, DeepSpeed's FutureWarning twice
    assert first.stdout.count("the GPT-2 features are RANDOM") == 1
    before = sorted(p.relative_to(run_dir) for p in run_dir.rglob("*"))

    resumed = run(cli_command(run_dir, *DP2, "training.max_steps=3", "model.head=normal", nproc=2))
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
    result = run(cli_command(run_dir, "training.max_steps=3", nproc=2), env=fault_env("raise"))
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
    result = run(cli_command(tmp_path / "run", "training.max_steps=3", nproc=2), env=fault_env("kill"))
    assert result.returncode == 1, describe(result)
    assert result.stderr.splitlines() == ["parallel-latent: error: rank 1 was killed by SIGKILL (out of memory?)"]


@pytest.mark.slow
def test_under_plain_torchrun_the_failing_rank_still_says_why(tmp_path):
    """torchrun keeps its own report; the failing rank prints its one line after its traceback, and
    torchrun's report shows that rank's traceback as the root cause (from the error file)."""
    command = torchrun_command(tmp_path / "run", "training.max_steps=3", nproc=2)
    result = run(command, env=fault_env("raise"))
    assert result.returncode != 0, describe(result)
    assert "parallel-latent: error: rank 1: RuntimeError: injected fault at step 2" in result.stderr.splitlines()
    report = result.stderr[result.stderr.index("Root Cause (first observed failure)") :]
    assert "rank      : 1 (local_rank: 1)" in report and "RuntimeError: injected fault at step 2" in report


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
    from parallel_latent.console import restart_line

    assert restart_line(before, step, env) == line
