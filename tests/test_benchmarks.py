"""Every benchmark script runs, in its quick mode, and produces its figures; and the page of figures
(docs/benchmarks.md) is what benchmarks/run_all.py renders from the committed JSON files.

A benchmark that no test runs rots silently (its setup drifts from the code it measures); these
runs check exit codes and figure lines only, never a timing."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS = REPO / "benchmarks"

# script -> the figures its quick mode must produce (by name prefix; each once or more)
QUICK_FIGURES = {
    "bench_model.py": ["model fwd+bwd ours / plain PyTorch, dropout 0.0", "features truncated / full GPT-2"],
    "bench_parallel.py": [
        "TP=1 MLP ours / nn.Sequential",
        "TP=2 MLP ours / torch.distributed.tensor.parallel",
        "gpt2.yaml replicated frozen pass, share of a rank's model FLOPs, TP=8",
        "frozen pass FLOPs per rank split / replicated, TP=4",
        "saved activations sequence parallel / not, TP=4",
        "TP=2 step split feature pass / replicated",
    ],
    "bench_train.py": ["trainer / plain step time", "fp32 memory per rank TP2xDP2 / TP1xDP1"],
    "bench_checkpoint.py": ["portable load (checksums verified) / torch.load", "portable bytes / torch.save bytes"],
    "bench_data.py": ["prepare / plain tokenizer call", "time to first step", "peak RSS"],
    "bench_quality.py": [
        "tiny.yaml seed 1: token accuracy",
        "tiny.yaml worst seed bleu",
        "tiny.yaml slowest seed",
        "tiny.yaml held-out tokens never in the training split",
    ],
}


def run_in_repo(command: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False)


def run_quick(script: str, json_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false"}
    return run_in_repo([sys.executable, str(BENCHMARKS / script), "--quick", "--json", str(json_path)], env)


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(QUICK_FIGURES))
def test_benchmark_quick_mode_produces_its_figures(script, tmp_path):
    result = run_quick(script, tmp_path / "figures.json")
    assert result.returncode == 0, f"{script} --quick failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    printed = [line for line in result.stdout.splitlines() if line.startswith("figure: ")]
    record = json.loads((tmp_path / "figures.json").read_text())
    assert record["quick"] is True and "--json" not in record["command"]
    names = [figure["name"] for figure in record["figures"]]
    for wanted in QUICK_FIGURES[script]:
        assert any(name.startswith(wanted) for name in names), (wanted, names)
    # One printed line per recorded figure, with its value.
    assert len(printed) == len(names)
    for line, name in zip(printed, names, strict=True):
        assert line.startswith(f"figure: {name} = ")


def test_benchmark_fails_without_figures(tmp_path):
    """A script that produced nothing exits non-zero and says so in its last line."""
    script = tmp_path / "bench_nothing.py"
    script.write_text(
        "import argparse, sys\n"
        f"sys.path.insert(0, {str(BENCHMARKS)!r})\n"
        "from common import add_common_arguments, run\n"
        "parser = argparse.ArgumentParser(); add_common_arguments(parser)\n"
        "sys.exit(run('bench_nothing', parser, lambda args, report: None))\n"
    )
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=False)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == "bench_nothing: FAILED: no figures produced"


def _run_all():
    sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location("run_all", BENCHMARKS / "run_all.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_page_of_figures_is_rendered_from_the_committed_results():
    """docs/benchmarks.md must be exactly what run_all.py renders from docs/benchmarks/*.json: a figure
    edited by hand on the page, or a JSON file updated without re-rendering, fails here."""
    run_all = _run_all()
    assert (REPO / "docs" / "benchmarks.md").read_text() == run_all.render_page(run_all.RESULTS)


def test_page_marks_goals_missing_runs_and_failures(tmp_path):
    run_all = _run_all()
    figures = [
        {"name": "a / b", "value": 0.9, "unit": "x", "goal": "<= 1", "met": True},
        {"name": "c / d", "value": 1.3, "unit": "x", "goal": "<= 1.1", "met": False},
        {"name": "e", "value": 12.5, "unit": "ms", "goal": "", "met": None},
    ]
    record = {"benchmark": "bench_model", "quick": False, "command": "python benchmarks/bench_model.py",
              "date": "2026-01-01 00:00 UTC", "machine": {"cpu": "X", "cores": 2}, "figures": figures}  # fmt: skip
    (tmp_path / "bench_model.json").write_text(json.dumps(record))
    page = run_all.render_page(tmp_path, failed={"bench_train"})
    assert "| a / b | 0.9 x | <= 1 | yes |" in page
    assert "| c / d | 1.3 x | <= 1.1 | **no** |" in page
    assert "| e | 12.5 ms |  |  |" in page
    assert page.count("Not measured:") == len(run_all.BENCHMARKS)  # all but bench_model, and the GPU table
    assert "no GPU run has been recorded" in page


def run_gpu_script(tmp_path, env: dict, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "ALLOW_CPU": "1", "PYTHON": sys.executable, "TMPDIR": str(tmp_path), **env}
    command = ["bash", str(BENCHMARKS / "gpu.sh"), "--quick", "--json", str(tmp_path / "gpu.json"), *args]
    return run_in_repo(command, env)


@pytest.mark.slow
def test_gpu_script_runs_its_matrix_on_cpu_when_allowed(tmp_path):
    """benchmarks/gpu.sh end to end on the CPU (ALLOW_CPU=1, the shrunk model): the facts first, then
    each setting trains in bf16 through the real trainer, and a table of what finished."""
    result = run_gpu_script(
        tmp_path, {"STEPS": "4", "LOG_EVERY": "2", "DROPOUTS": "0.1 0.0", "MICRO_BATCHES": "4", "DEADLINE_S": "500"}
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[0].startswith("torch ") and "DeepSpeed" in lines[0] and "C compiler" in lines[0]
    header = next(i for i, line in enumerate(lines) if line.split()[:3] == ["dropout", "micro", "compile"])
    rows = [line.split() for line in lines[header + 1 :] if not line.startswith("figure:")]
    assert [row[:3] for row in rows] == [["0.1", "4", "false"], ["0.0", "4", "false"]]
    assert all(row[7] == "-" for row in rows)  # syncs are counted on CUDA only
    names = [f["name"] for f in json.loads((tmp_path / "gpu.json").read_text())["figures"]]
    assert "MFU, dropout=0.1, micro_batch_size=4" in names and "tokens/s, dropout=0.0, micro_batch_size=4" in names
    assert not list(tmp_path.glob("parallel-latent-gpu-bench.*"))  # cleaned up


@pytest.mark.slow
def test_gpu_script_stops_at_its_deadline_with_a_partial_table(tmp_path):
    """A deadline too short for the matrix: the unfinished runs are named, the table of the finished
    ones (none here) is printed, and the script exits 0 soon after the deadline."""
    # Long enough that the first run starts even on a loaded 2-core machine (the facts import torch
    # and DeepSpeed first, which took 15 s on CI), and far too short for its steps.
    deadline = 45
    started = time.monotonic()
    result = run_gpu_script(tmp_path, {"STEPS": "100000", "LOG_EVERY": "1000", "DEADLINE_S": str(deadline)})
    elapsed = time.monotonic() - started
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert any(line.split()[:3] == ["dropout", "micro", "compile"] for line in lines)
    unfinished = [line for line in lines if line.startswith("not in the table: ")]
    assert unfinished and "ran out of time (deadline" in unfinished[0]
    assert all("not started: deadline reached" in line for line in unfinished[1:])
    assert elapsed < deadline + 30, elapsed  # the deadline, plus start-up of Python and the table
