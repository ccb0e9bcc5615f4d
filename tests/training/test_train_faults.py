"""Trainer behaviour under faults and other launchers: non-finite losses (one process, run in this
test's process), SIGTERM preemption, the deepspeed launcher and accelerate launch (real ranks, gloo
on CPU)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

import pytest

from tests.helpers.distributed import free_port
from tests.helpers.in_process_cli import run_main
from tests.helpers.trainer_runs import (
    REPO,
    cli_command,
    describe,
    rank_env,
    rank_pids,
    run,
    train_args,
    train_records,
    wait_for_step,
)

pytestmark = pytest.mark.slow


def train_with_nan_losses(nan_steps: str, *overrides: str, run_dir):
    """``parallel-latent train`` in this process with a model whose loss is NaN at ``nan_steps``
    (1-based training steps), so the non-finite path runs through the real DeepSpeed optimizer
    wrappers (or our stage-0 guard)."""
    from tests.helpers.trainer_faults import nan_losses_at, parse_steps

    with nan_losses_at(parse_steps(nan_steps)):
        return run_main(train_args(run_dir, *overrides))


@pytest.mark.parametrize("zero_stage", [0, 2], ids=["stage0-own-guard", "stage2-deepspeed"])
def test_nonfinite_steps_are_skipped_then_stop_the_run(tmp_path, zero_stage):
    """NaN loss at steps 3-4 (a streak below the limit) and from step 7 on: the bad steps are
    skipped (no update, schedule not advanced), training goes on after the short streak, the
    long one stops the run (exit 3, one line) and `latest` stays at the last good checkpoint."""
    run_dir = tmp_path / "run"
    result = train_with_nan_losses(
        "3,4,7-99",
        "parallel.tensor_parallel=1",
        f"parallel.zero_stage={zero_stage}",
        "training.max_steps=20",
        "checkpoint.save_every=2",
        "training.max_nonfinite_steps=3",
        "model.dropout=0.0",
        run_dir=run_dir,
    )
    assert result.returncode == 3, describe(result)
    errors = [line for line in result.stderr.splitlines() if line.startswith("parallel-latent: error:")]
    assert len(errors) == 1 and "stopped at step 9: 3 consecutive steps with a non-finite" in errors[0]
    assert "Traceback" not in result.stderr

    records = {r["step"]: r for r in train_records(run_dir)}
    assert sorted(records) == list(range(1, 10))
    for step in (3, 4, 7, 8, 9):
        assert records[step]["loss"] is None and records[step]["skipped_steps"] >= 1
    for step in (1, 2, 5, 6):
        assert records[step]["loss"] is not None and records[step]["grad_norm"] is not None
    # Skipped steps do not advance the schedule: step 5 runs at the lr step 3 would have had.
    assert records[5]["lr"] == records[3]["lr"] == records[4]["lr"]
    assert records[6]["lr"] != records[5]["lr"]  # the schedule moves on after an applied step
    assert records[9]["skipped_steps"] == 5
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000006"
    assert not (run_dir / "checkpoints" / "step_00000008").exists()  # none written mid-streak


def test_a_nonfinite_bf16_step_stops_the_run_before_its_weights_are_published(tmp_path):
    """bf16 runs without DeepSpeed's per-tensor overflow scan (it costs a kernel per gradient and a
    device read every step), so a NaN step is applied; the trainer catches it at the next log line
    or checkpoint, whichever comes first, exits 3 with one line, and `latest` stays before it."""
    run_dir = tmp_path / "run"
    result = train_with_nan_losses(
        "5-99", "parallel.tensor_parallel=1", "training.precision=bf16", "training.max_steps=20",
        "training.log_every=3", "checkpoint.save_every=2", "model.dropout=0.0", run_dir=run_dir,
    )  # fmt: skip
    assert result.returncode == 3, describe(result)
    errors = [line for line in result.stderr.splitlines() if line.startswith("parallel-latent: error:")]
    assert len(errors) == 1 and "stopped at step 6: a non-finite loss in the last" in errors[0], errors
    assert "under bf16" in errors[0] and "step_00000004" in errors[0]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000004"
    assert not (run_dir / "checkpoints" / "step_00000006").exists()
    assert [r["step"] for r in train_records(run_dir)] == [3]  # step 6's line was not written


def test_sigterm_finishes_the_step_checkpoints_and_exits_zero(tmp_path):
    """SIGTERM to `parallel-latent train --nproc 2` (what SLURM sends before preemption): the
    ranks agree on a step, write a checkpoint there and everything exits 0; resuming goes on
    from that step."""
    run_dir = tmp_path / "run"
    overrides = [
        "parallel.tensor_parallel=2",
        "parallel.zero_stage=1",
        "training.max_steps=400",
        "checkpoint.save_every=0",
    ]
    job = subprocess.Popen(
        cli_command(run_dir, *overrides, nproc=2),
        cwd=REPO,
        env=rank_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_for_step(run_dir, 3, job, timeout=240)
        job.send_signal(signal.SIGTERM)
        output = job.communicate(timeout=120)[0]
    finally:
        for pid in rank_pids(job.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, output[-5000:]
    assert "stopped by SIGTERM: checkpoint" in output and "interrupted" not in output
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    stopped_at = int(latest.split("_")[1])
    assert 3 <= stopped_at < 400
    assert train_records(run_dir)[-1]["step"] == stopped_at


def test_deepspeed_launcher_on_cpu(tmp_path):
    """`deepspeed --num_gpus 2 --module parallel_latent ...` with DS_ACCELERATOR=cpu: the launcher
    inserts --local_rank, sets RANK/WORLD_SIZE; TP=2 at ZeRO stage 0 (our AdamW guard)."""
    run_dir = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "deepspeed.launcher.runner",
        "--num_nodes",
        "1",
        "--num_gpus",
        "2",
        "--master_port",
        str(free_port()),
        "--module",
        "parallel_latent",
        *train_args(
            run_dir,
            "parallel.tensor_parallel=2",
            "parallel.zero_stage=0",
            "training.max_steps=4",
            "checkpoint.save_every=0",
        ),
    ]
    result = run(command, timeout=300)
    assert result.returncode == 0, describe(result)
    assert "TP 2 x DP 1, ZeRO stage 0" in result.stdout
    records = train_records(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(r["grad_norm"] is not None for r in records)
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000004"


def test_accelerate_launch_runs_the_same_entry_point_in_bf16(tmp_path):
    """accelerate launch with launch/accelerate_config.yaml (2 processes); bf16 through DeepSpeed's
    bf16 optimizer on CPU, buffers cast along with the parameters."""
    run_dir = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(REPO / "launch" / "accelerate_config.yaml"),
        "--num_processes",
        "2",
        "--main_process_port",
        str(free_port()),
        "-m",
        "parallel_latent",
        *train_args(
            run_dir,
            "parallel.tensor_parallel=1",
            "parallel.zero_stage=1",
            "training.max_steps=4",
            "checkpoint.save_every=0",
            "training.precision=bf16",
        ),
    ]
    result = run(command, timeout=300)
    assert result.returncode == 0, describe(result)
    assert "TP 1 x DP 2, ZeRO stage 1, bf16" in result.stdout
    assert [r["step"] for r in train_records(run_dir)] == [1, 2, 3, 4]
