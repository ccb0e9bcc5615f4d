"""Helpers for the trainer tests: tiny configs and real subprocess runs (torchrun, the
deepspeed launcher, accelerate launch, the CLI).

Every run is a real multi-process gloo job on CPU, so they are few and tiny: d=32, T=16, a
3-layer GPT-2, one Perceiver block each side, 600 corpus lines, micro-batch 4.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from parallel_latent.files import read_jsonl

REPO = Path(__file__).resolve().parents[2]
TINY_CONFIG = REPO / "configs" / "tiny.yaml"

# The smallest model shape that still has every part (heads, both stacks, a 3-layer GPT-2).
TINY_MODEL = [
    "model.d_model=32",
    "model.n_heads=4",
    "model.n_encoder_layers=1",
    "model.n_decoder_layers=1",
    "model.max_length=16",
    "feature_model.n_embd=32",
    "feature_model.n_head=4",
    "feature_model.n_layer=3",
]

TINY = [
    *TINY_MODEL,
    "data.max_samples=600",
    "training.micro_batch_size=4",
    "training.log_every=1",
    "training.eval_every=0",
    "training.eval_batches=2",
    "optimizer.lr=0.003",
    "schedule.warmup_steps=2",
    "logging.progress_bar=false",
    "logging.tensorboard=false",
    "checkpoint.export_portable=false",
    # The hang watchdog on, short: a false alarm in any healthy end-to-end run fails its test.
    "training.hang_timeout_s=30",
]


# What every rank a test starts (as a process or in the test's own) runs with, and the variables
# of a launcher's identity it never inherits.
RANK_SETTINGS = {
    "OMP_NUM_THREADS": "1",
    "DS_ACCELERATOR": "cpu",
    "PYTHONUNBUFFERED": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
LAUNCHER_IDENTITY = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE")


def rank_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env.update(RANK_SETTINGS)
    for key in LAUNCHER_IDENTITY:
        env.pop(key, None)
    env.update(extra or {})
    return env


def train_args(run_dir: Path, *overrides: str) -> list[str]:
    return ["train", "--config", str(TINY_CONFIG), *TINY, f"logging.run_dir={run_dir}", *overrides]


def cli_command(run_dir: Path, *overrides: str, nproc: int | None = None) -> list[str]:
    command = [sys.executable, "-m", "parallel_latent", *train_args(run_dir, *overrides)]
    return command + ([f"--nproc={nproc}"] if nproc else [])


def torchrun_command(run_dir: Path, *overrides: str, nproc: int, extra: list[str] | None = None) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *(extra or ["--standalone"]),
        f"--nproc_per_node={nproc}",
        "-m",
        "parallel_latent",
        *train_args(run_dir, *overrides),
    ]


def run(command: list[str], timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    result = subprocess.run(
        command, cwd=REPO, env=rank_env(env), capture_output=True, text=True, timeout=timeout, check=False
    )
    return result


def describe(result: subprocess.CompletedProcess) -> str:
    return f"exit {result.returncode}\n--- stdout\n{result.stdout[-4000:]}\n--- stderr\n{result.stderr[-6000:]}"


def train_records(run_dir: Path) -> list[dict]:
    return [r for r in read_jsonl(Path(run_dir) / "metrics.jsonl") if r["kind"] == "train"]


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in train_records(run_dir)]


def wait_for_step(run_dir: Path, step: int, process: subprocess.Popen, timeout: float = 240) -> None:
    """Block until metrics.jsonl records ``step`` (or the process ends / time runs out)."""
    deadline = time.monotonic() + timeout
    metrics = Path(run_dir) / "metrics.jsonl"
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"run ended (exit {process.returncode}) before step {step}")
        if metrics.exists() and any(r.get("step", 0) >= step for r in read_jsonl(metrics)):
            return
        time.sleep(0.2)
    raise AssertionError(f"no step {step} within {timeout}s")


def interrupt(job: subprocess.Popen, timeout_s: float) -> str:
    """A terminal's Ctrl-C (SIGINT) to the command ``job`` runs, then its stderr once it has ended;
    a job still running after ``timeout_s`` (a hang) is killed."""
    try:
        job.send_signal(signal.SIGINT)
        _, stderr = job.communicate(timeout=timeout_s)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    return stderr


def rank_pids(parent_pid: int) -> list[int]:
    """Descendant processes of ``parent_pid`` that run a rank (``-m parallel_latent``)."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if b"parallel_latent" in cmdline and b"torch.distributed.run" not in cmdline and _descends(ppid, parent_pid):
            found.append(int(entry.name))
    return sorted(found)


def _descends(pid: int, ancestor: int) -> bool:
    for _ in range(8):
        if pid == ancestor:
            return True
        if pid <= 1:
            return False
        try:
            pid = int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            return False
    return False


def kill_tree(process: subprocess.Popen) -> None:
    """Best-effort cleanup of a launched job (its own process group)."""
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            process.kill()
    process.wait(timeout=30)


def run_two_nodes(overrides: list[str], workdirs: tuple[Path, Path] = (REPO, REPO), timeout: float = 360):
    """launch/torchrun_multi_node.sh twice, NODE_RANK 0 and 1, 2 ranks each, c10d rendezvous on
    127.0.0.1: one 4-rank job whose "nodes" may run in different working directories. Returns the
    agents (finished) and their outputs."""
    from tests.helpers.distributed import free_port

    env = rank_env(
        {
            "NNODES": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()),
            "NPROC_PER_NODE": "2",
            "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
        }
    )
    agents = [
        subprocess.Popen(
            ["bash", str(REPO / "launch" / "torchrun_multi_node.sh"), str(TINY_CONFIG), *overrides],
            cwd=workdir,
            env={**env, "NODE_RANK": str(node)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for node, workdir in enumerate(workdirs)
    ]
    try:
        outputs = [agent.communicate(timeout=timeout)[0] for agent in agents]
    finally:
        for agent in agents:
            kill_tree(agent)
    return agents, outputs


def copy_checkpoint(source_run: Path, step: int, run_dir: Path) -> None:
    """A run directory that holds only ``source_run``'s checkpoint of ``step`` (and no metrics)."""
    tag = f"step_{step:08d}"
    shutil.copytree(source_run / "checkpoints" / tag, run_dir / "checkpoints" / tag)
    (run_dir / "checkpoints" / "latest").write_text(tag + "\n")


def by_step(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in train_records(run_dir)}


def trained_weights(trainer, steps: int) -> tuple[dict, list[float]]:
    """After ``steps`` more steps of a real trainer: its trainable weights and ZeRO's fp32 masters (by
    name, copied), and the gradient norm of each step."""
    norms = []
    for _ in range(steps):
        trainer.train_step()
        norms.append(float(trainer.engine.get_global_grad_norm()))
    masters = trainer.bundle.optimizer.single_partition_of_fp32_groups
    weights = {name: p.detach().clone() for name, p in trainer.model.named_parameters() if p.requires_grad}
    return {**weights, **{f"fp32 master {i}": m.detach().clone() for i, m in enumerate(masters)}}, norms
