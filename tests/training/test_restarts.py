"""A job that heals itself: a rank killed mid-run under ``torchrun --max-restarts`` (and under
``parallel-latent train --nproc 2 --max-restarts``) restarts by itself, says so in one line, and goes
on from its newest complete checkpoint exactly as an uninterrupted run went on (one metrics record
per step, the same losses); with the restarts used up (a rank killed again, in the second attempt's
start-up) the job ends with the failing rank's one line; a rank that never joins ends the start-up
within its bound, naming the ranks missing. Real processes, gloo, faults injected into one rank by
tests/helpers/worker_faults/sitecustomize.py."""

from __future__ import annotations

import re
import signal

import pytest

from tests.helpers.in_process_cli import run_main
from tests.helpers.trainer_runs import REPO, describe, run, torchrun_command, train_args, train_records

pytestmark = pytest.mark.slow

FAULTS = str(REPO / "tests" / "helpers" / "worker_faults")
# The fewest steps the faults need: a checkpoint to resume from (EVERY), a step recorded past it
# before the kill (KILLED_AT), and a step the second attempt trains past the kill.
STEPS, EVERY, KILLED_AT = 6, 3, 5
RECIPE = [
    f"training.max_steps={STEPS}",
    f"checkpoint.save_every={EVERY}",
    "parallel.tensor_parallel=2",
    "model.dropout=0.1",
]
KEYS = ("loss", "grad_norm", "token_accuracy", "lr")


def train_nproc(run_dir, *overrides: str, max_restarts: int = 0, env: dict | None = None):
    """``parallel-latent train --nproc 2`` with the launcher in this process (its ranks are real
    processes under torchrun); a subprocess's exit status and output."""
    restarts = [f"--max-restarts={max_restarts}"] if max_restarts else []
    return run_main([*train_args(run_dir, *overrides), "--nproc=2", *restarts], env=env)


def kill(rank: int, step: int | str, attempt: int | None = 0, fault: str = "kill") -> dict:
    env = {"PYTHONPATH": FAULTS, "PL_FAULT": fault, "PL_FAULT_RANK": str(rank), "PL_FAULT_STEP": str(step)}
    return env | ({"PL_FAULT_ATTEMPT": str(attempt)} if attempt is not None else {})


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted run every restarted one must reproduce."""
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    result = train_nproc(run_dir, *RECIPE)
    assert result.returncode == 0, describe(result)
    return {r["step"]: r for r in train_records(run_dir)}


def assert_goes_on_as_before(run_dir, straight) -> None:
    got = train_records(run_dir)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))  # one record per step, across attempts
    for record in got:
        for key in KEYS:
            assert record[key] == straight[record["step"]][key], (record["step"], key)
    # The first attempt's records past its last checkpoint are kept aside, not lost.
    assert (run_dir / f"metrics.after-step_{EVERY:08d}.jsonl").is_file()


# The step its record last showed: records are rewritten every few seconds, not at every step.
RESTART_LINE = re.compile(
    rf"restart 1 of 1 \(attempt 2\): rank 1 \(host \S+, pid \d+; last seen at step (\d+) in [a-z -]+\) stopped "
    rf"without a word; resuming from step {EVERY}"
)


def test_a_killed_rank_restarts_by_itself_under_torchrun(straight, tmp_path):
    run_dir = tmp_path / "run"
    command = torchrun_command(run_dir, *RECIPE, nproc=2, extra=["--standalone", "--max-restarts=1"])
    result = run(command, timeout=500, env=kill(rank=1, step=KILLED_AT))
    assert result.returncode == 0, describe(result)
    [seen] = RESTART_LINE.findall(result.stdout)
    assert 0 <= int(seen) <= KILLED_AT, describe(result)
    assert_goes_on_as_before(run_dir, straight)


def test_a_killed_rank_restarts_by_itself_under_train_nproc(straight, tmp_path):
    run_dir = tmp_path / "run"
    result = train_nproc(run_dir, *RECIPE, max_restarts=1, env=kill(rank=1, step=KILLED_AT))
    assert result.returncode == 0, describe(result)
    [seen] = RESTART_LINE.findall(result.stdout)
    assert 0 <= int(seen) <= KILLED_AT, describe(result)
    assert result.stderr == "", describe(result)  # the first attempt's failure is not the job's
    assert_goes_on_as_before(run_dir, straight)


def test_restarts_used_up_end_with_the_failing_ranks_line(tmp_path):
    """Killed mid-run, restarted, killed again in the second attempt's start-up: no restart left."""
    run_dir = tmp_path / "run"
    env = {"PYTHONPATH": FAULTS, "PL_FAULT": "kill", "PL_FAULT_RANK": "1", "PL_FAULT_STEP": f"{KILLED_AT},0"}
    result = train_nproc(run_dir, *RECIPE, max_restarts=1, env=env)
    assert result.returncode == 128 + signal.SIGKILL, describe(result)
    assert result.stderr.splitlines()[-1] == "parallel-latent: error: rank 1 was killed by SIGKILL (out of memory?)"
    assert len(result.stderr.splitlines()) == 1, describe(result)


def test_a_rank_that_never_joins_ends_the_start_up_within_its_bound(tmp_path):
    run_dir = tmp_path / "run"
    result = train_nproc(
        run_dir, *RECIPE, "training.hang_long_phase_s=5", env=kill(rank=1, step=0, attempt=None, fault="hang")
    )
    assert result.returncode == 5, describe(result)
    assert result.stderr.splitlines() == [
        "parallel-latent: error: start-up: rank 1 of 2 did not join the job within 5 s (training.hang_long_phase_s)"
    ], describe(result)
