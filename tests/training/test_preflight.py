"""The checks ``train --nproc N`` runs in its own process before it launches a rank."""

from __future__ import annotations

import sys

from tests.helpers.trainer_runs import TINY, TINY_CONFIG, run

CHECK = """
import sys
from parallel_latent.config import load_config
from parallel_latent.training.preflight import preflight
preflight(load_config(sys.argv[1], sys.argv[3:]), 2, sys.argv[1], processes_per_node=2)
print(sorted(name for name in ("transformers", "deepspeed") if name in sys.modules))
"""


def test_the_launchers_checks_load_neither_transformers_nor_deepspeed(tmp_path):
    """The launching process waits for its checks before any rank starts: they import torch only,
    not the seconds of transformers (the frozen GPT-2) and DeepSpeed that every rank imports anyway."""
    run_dir = tmp_path / "run"
    command = [sys.executable, "-c", CHECK, str(TINY_CONFIG), "-", *TINY, f"logging.run_dir={run_dir}"]
    result = run(command, timeout=600)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"
    assert not run_dir.exists()  # the checks write nothing
