"""Running the repository's scripts (benchmarks/, tools/) from the tests, as a user would: from the
repository root, in a fresh process."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "benchmarks"
TOOLS = REPO / "tools"


def run_in_repo(command: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False)


def run_quick(script: str, json_path: Path) -> subprocess.CompletedProcess:
    """A benchmark script in its quick mode, one thread, DeepSpeed on the CPU."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false"}
    return run_in_repo([sys.executable, str(BENCHMARKS / script), "--quick", "--json", str(json_path)], env)


def load_benchmark(name: str):
    """benchmarks/<name>.py as a module (the scripts import `common` from beside them)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
