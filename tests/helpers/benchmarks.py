"""Running the repository's scripts (benchmarks/, tools/) from the tests, as a user would: from the
repository root, in a fresh process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from benchmarks.harness import REPO
from benchmarks.processes import child_environment

BENCHMARKS = REPO / "benchmarks"
TOOLS = REPO / "tools"


def run_in_repo(command: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False)


def run_quick(benchmark: str, json_path: Path) -> subprocess.CompletedProcess:
    """``python -m benchmarks.<benchmark>`` in its quick mode, one thread, DeepSpeed on the CPU."""
    env = child_environment(1, cpu=True, TOKENIZERS_PARALLELISM="false")
    return run_in_repo([sys.executable, "-m", f"benchmarks.{benchmark}", "--quick", "--json", str(json_path)], env)
