"""The launch scripts and configs in launch/ and benchmarks/gpu.sh: syntax, and real runs where
one machine can stand in (SLURM through stand-in srun/scontrol, gpu.sh on CPU)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers.trainer_runs import REPO, TINY, describe, rank_env, train_records

LAUNCH = REPO / "launch"
SCRIPTS = [
    "torchrun_single_node.sh",
    "torchrun_multi_node.sh",
    "deepspeed_hostfile.sh",
    "deepspeed_no_ssh.sh",
    "slurm.sbatch",
]


@pytest.mark.parametrize("script", [*SCRIPTS, "../benchmarks/gpu.sh"])
def test_shell_scripts_parse_and_are_executable(script):
    path = LAUNCH / script
    assert os.access(path, os.X_OK), f"{path} is not executable"
    result = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr


def test_every_launcher_runs_the_same_entry_point():
    for script in SCRIPTS:
        assert "-m parallel_latent train" in (LAUNCH / script).read_text().replace(
            "--module parallel_latent", "-m parallel_latent"
        ), script


def test_accelerate_config_is_a_plain_process_launcher():
    config = yaml.safe_load((LAUNCH / "accelerate_config.yaml").read_text())
    assert config["distributed_type"] == "MULTI_GPU"  # not DEEPSPEED: the trainer configures DeepSpeed
    assert config["mixed_precision"] == "no"
    from accelerate.commands.config.config_args import load_config_from_file

    loaded = load_config_from_file(str(LAUNCH / "accelerate_config.yaml"))
    assert loaded.num_processes == 8


def test_hostfile_example_format():
    lines = [
        line
        for line in (LAUNCH / "hostfile.example").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert lines and all(len(line.split()) == 2 and line.split()[1].startswith("slots=") for line in lines)


def test_readme_documents_every_launcher():
    text = (LAUNCH / "README.md").read_text()
    for needle in (
        "torchrun --standalone",
        "--rdzv_backend c10d",
        "deepspeed --hostfile",
        "--no_ssh --node_rank",
        "sbatch launch/slurm.sbatch",
        "accelerate launch --config_file launch/accelerate_config.yaml",
        "parallel-latent train --config configs/tiny.yaml --nproc 2",
    ):
        assert needle in text, needle


@pytest.mark.slow
def test_slurm_script_with_stand_in_srun(tmp_path):
    """sbatch's script body under a fake SLURM (one node, 2 "GPUs"): scontrol names the host, srun
    runs its command; the job trains TP=2 for 3 steps through torchrun's c10d rendezvous."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/usr/bin/env bash\necho 127.0.0.1\n")
    # srun: drop its own options, run the command once (one task on our one node).
    (bin_dir / "srun").write_text('#!/usr/bin/env bash\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$@"\n')
    for tool in ("scontrol", "srun"):
        (bin_dir / tool).chmod(0o755)
    run_dir = tmp_path / "run"
    env = rank_env(
        {
            "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
            "SLURM_JOB_NODELIST": "localhost",
            "SLURM_JOB_ID": str(4242 + os.getpid() % 1000),
            "SLURM_NNODES": "1",
            "SLURM_GPUS_ON_NODE": "2",
            "SLURM_CPUS_PER_TASK": "2",
        }
    )
    overrides = [*TINY, f"logging.run_dir={run_dir}", "training.max_steps=3", "checkpoint.save_every=0"]
    result = subprocess.run(
        ["bash", str(LAUNCH / "slurm.sbatch"), "configs/tiny.yaml", *overrides],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, describe(result)
    assert [r["step"] for r in train_records(run_dir)] == [1, 2, 3]
    assert "2 rank(s) = TP 2 x DP 1" in result.stdout
