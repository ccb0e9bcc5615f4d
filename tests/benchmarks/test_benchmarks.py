"""Every benchmark script runs, in its quick mode, and produces its figures; and the page of figures
(docs/benchmarks.md) is what benchmarks/run_all.py renders from the committed JSON files.

A benchmark that no test runs rots silently (its setup drifts from the code it measures); these
runs check exit codes and figure lines only, never a timing."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks import run_all
from tests.helpers.benchmarks import REPO, run_quick

# benchmark -> the figures its quick mode must produce (by name prefix; each once or more)
QUICK_FIGURES = {
    "bench_model": ["model fwd+bwd ours / plain PyTorch, dropout 0.0", "features truncated / full GPT-2"],
    "bench_parallel": [
        "TP=1 MLP ours / nn.Sequential",
        "TP=2 MLP ours / torch.distributed.tensor.parallel",
        "gpt2.yaml replicated frozen pass, share of a rank's model FLOPs, TP=8",
        "frozen pass FLOPs per rank split / replicated, TP=4",
        "saved activations sequence parallel / not, TP=4",
        "TP=2 step split feature pass / replicated",
    ],
    "bench_train": ["trainer / plain step time", "fp32 memory per rank TP2xDP2 / TP1xDP1"],
    "bench_checkpoint": [
        "portable load (checksums verified) / torch.load",
        "portable bytes / torch.save bytes",
        "training loop stall per save, background / synchronous",
    ],
    "bench_restart": ["restart: kill to the first step after it", "restart / cold start"],
    "bench_data": ["prepare / plain tokenizer call", "time to first step", "peak RSS"],
    "bench_feature_cache": [
        "step time, frozen decoder run / feature cache read",
        "build of the cache, every sample once",
        "private memory added by the 10x corpus's cache",
    ],
    "bench_export": ["export / bare encode loop", "peak RSS", "rerun after a kill at 50% / uninterrupted run"],
    "bench_frontier": [
        "4 x 16 (8 floats per token) worst seed bleu",
        "4 x 16 (8 floats per token) median bleu noise 0.5",
        "4 x 16 (8 floats per token) worst seed out of domain bleu",
        "4 x 16 (8 floats per token) held-out - out-of-domain BLEU",
        "4 x 16 (8 floats per token) slowest seed wall time",
    ],
    "bench_readout": [
        "random code, k=16: tokens read back by inner product",
        "random code, k=16: tokens read back by nearest normalised code",
        "features explained linearly by the token and its position",
        "linear code of the features, k=8, the least mixed subspace",
    ],
    "bench_feature_models": [
        "llama-3.2-1b: frozen bytes per rank, shard / replicate at TP=8",
        "pythia-1.4b: frozen pass time per rank, shard / replicate at TP=8",
    ],
    "bench_quality": [
        "tiny.yaml seed 1: token accuracy",
        "tiny.yaml worst seed bleu",
        "tiny.yaml slowest seed",
        "tiny.yaml worst position over the seeds",
        "tiny.yaml held-out tokens never in the training split",
    ],
}


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
    script = (
        "import sys\n"
        "from benchmarks.harness import command\n"
        "sys.exit(command('bench_nothing', 'nothing', lambda args, report: None)())\n"
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, check=False)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == "bench_nothing: FAILED: no figures produced"


def test_page_of_figures_is_rendered_from_the_committed_results():
    """docs/benchmarks.md must be exactly what run_all.py renders from docs/benchmarks/*.json: a figure
    edited by hand on the page, or a JSON file updated without re-rendering, fails here."""
    assert (REPO / "docs" / "benchmarks.md").read_text() == run_all.render_page(run_all.RESULTS)


def test_page_marks_goals_missing_runs_and_failures(tmp_path):
    figures = [
        {"name": "a / b", "value": 0.9, "unit": "x", "goal": "<= 1", "met": True},
        {"name": "c / d", "value": 1.3, "unit": "x", "goal": "<= 1.1", "met": False},
        {"name": "e", "value": 12.5, "unit": "ms", "goal": "", "met": None},
    ]
    record = {"benchmark": "bench_model", "quick": False, "command": "python -m benchmarks.bench_model",
              "date": "2026-01-01 00:00 UTC", "machine": {"cpu": "X", "cores": 2}, "figures": figures}  # fmt: skip
    (tmp_path / "bench_model.json").write_text(json.dumps(record))
    page = run_all.render_page(tmp_path, failed={"bench_train"})
    assert "| a / b | 0.9 x | <= 1 | yes |" in page
    assert "| c / d | 1.3 x | <= 1.1 | **no** |" in page
    assert "| e | 12.5 ms |  |  |" in page
    assert page.count("Not measured:") == len(run_all.BENCHMARKS)  # all but bench_model, and the GPU table
    assert "no GPU run has been recorded" in page
