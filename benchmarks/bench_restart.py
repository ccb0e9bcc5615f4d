"""A job that heals itself: ``train --config configs/tiny.yaml --nproc 2 --max-restarts 1``, one rank
SIGKILLed mid-run, the time from the kill to the first step after it, against the cold start.

    python -m benchmarks.bench_restart [--quick]      # --quick: tiny.yaml at width 32
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness import REPO, TINY, Report, command
from benchmarks.processes import child_environment
from parallel_latent.files import read_jsonl

KILL_AT, EVERY = 30, 20  # the kill comes after the step-20 checkpoint (or a later one), at step 30 or after
# --quick: the same path in fewer steps (the kill after the step-5 checkpoint or a later one).
QUICK_KILL_AT, QUICK_EVERY = 6, 5
# The job trains until it is told to stop (SIGTERM: the step finishes, a checkpoint, exit 0), so no
# poll of it can come too late: the kill waits for a state that lasts (a checkpoint published and a
# step past it), never for a window between two checkpoints.
UNTIL_STOPPED = 100_000


def records(run_dir: Path, kind: str = "train") -> list[int]:
    """The steps of ``run_dir``'s metrics records of ``kind`` (``first_step``: one per attempt, at its first step)."""
    metrics = run_dir / "metrics.jsonl"
    return [r["step"] for r in read_jsonl(metrics) if r.get("kind") == kind] if metrics.exists() else []


def rank_of(run_dir: Path, rank: int) -> int:
    """The pid of the rank ``rank`` of the job training into ``run_dir``."""
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        ours = f"RANK={rank}".encode() in environ and f"logging.run_dir={run_dir}".encode() in cmdline
        if ours and b"parallel_latent" in cmdline and b"parallel_latent.launching.agent" not in cmdline:
            return int(entry.name)
    raise RuntimeError(f"rank {rank} not found")


def wait(condition, job: subprocess.Popen, timeout: float, what: str) -> float:
    """When ``condition()`` first holds; an error if ``job`` ends before, or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while not condition():
        if job.poll() is not None:
            raise RuntimeError(f"the job ended (status {job.returncode}) before the {what}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {what} within {timeout:g} s")
        time.sleep(0.05)
    return time.monotonic()


def body(args, report: Report) -> None:
    kill_at, every = (QUICK_KILL_AT, QUICK_EVERY) if args.quick else (KILL_AT, EVERY)
    overrides = [f"training.max_steps={UNTIL_STOPPED}", f"checkpoint.save_every={every}", "training.eval_every=0",
                 "logging.progress_bar=false", "logging.tensorboard=false", "training.log_every=1"]  # fmt: skip
    if args.quick:
        overrides += ["model.d_model=32", "feature_model.n_embd=32", "feature_model.n_layer=3"]
    scratch = Path(tempfile.mkdtemp(prefix="bench-restart-"))
    run_dir, log = scratch / "run", scratch / "job.log"
    command = [sys.executable, "-m", "parallel_latent", "train", "--config", str(TINY), *overrides,
               f"logging.run_dir={run_dir}", "--nproc=2", "--max-restarts=1"]  # fmt: skip
    launched = time.monotonic()
    with log.open("w") as out:  # a file: a pipe nobody reads while the job trains would fill and stop it
        job = subprocess.Popen(command, cwd=REPO, env=child_environment(1, cpu=True, TOKENIZERS_PARALLELISM="false"),
                               stdout=out, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        first_step = wait(lambda: records(run_dir), job, 600, "first step") - launched

        def past_a_checkpoint() -> bool:
            step, latest = max(records(run_dir), default=0), run_dir / "checkpoints" / "latest"
            saved = int(latest.read_text().strip().split("_")[1]) if latest.is_file() else 0  # the newest published
            return saved >= every and step >= kill_at and step > saved

        wait(past_a_checkpoint, job, 600, f"step {kill_at} after a checkpoint")
        killed_at_step = max(records(run_dir))
        os.kill(rank_of(run_dir, 1), signal.SIGKILL)
        killed = time.monotonic()

        # The restarted attempt's first step: its own first_step record. (The dead attempt's records
        # past the checkpoint move aside at the resume, but not at once: a step past the checkpoint
        # may still be the dead attempt's when the set-aside file already exists.)
        wait(lambda: len(records(run_dir, "first_step")) >= 2, job, 600, "step after the restart")
        restart = time.monotonic() - killed
        job.send_signal(signal.SIGTERM)  # the launcher's clean stop: the ranks checkpoint and exit 0
        job.wait(timeout=600)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
        output = log.read_text()
        shutil.rmtree(scratch, ignore_errors=True)  # its run directory, checkpoints and all
    if job.returncode != 0:
        raise RuntimeError(f"the restarted job ended with status {job.returncode}: {output[-2000:]}")
    [line] = [line for line in output.splitlines() if line.startswith("restart 1 of 1")]
    print(line)
    print(f"cold start to the first step: {first_step:.1f} s; kill at step {killed_at_step} to the first step "
          f"after it: {restart:.1f} s")  # fmt: skip
    report.figure("restart: kill to the first step after it, tiny.yaml, 2 ranks", restart, "s", at_most=60)
    report.figure("restart / cold start (launch to the first step)", restart / first_step, "x")


main = command("bench_restart", __doc__, body, None, __name__)
