"""benchmarks/bench_quality.py: its smoke mode runs real 2-process trainings and prints the seed table
and writes its JSON; bad input stops it with one line. The quality figures themselves come from its
full runs (docs/benchmarks/quality_*.json), never from the test suite."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.trainer_runs import REPO, rank_env

SCRIPT = REPO / "benchmarks" / "bench_quality.py"


def run_bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], cwd=REPO, env=rank_env(), capture_output=True, text=True, check=False
    )


def test_quick_run_prints_the_seed_table_and_writes_json(tmp_path):
    result = run_bench("--quick", "--json", str(tmp_path / "quality.json"))
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    table = lines[lines.index(next(line for line in lines if line.split()[:2] == ["seed", "token_acc"])) :]
    assert [line.split()[0] for line in table[1:6]] == ["1", "2", "min", "median", "max"]
    assert all(len(line.split()) == 5 for line in table[1:6])

    record = json.loads((tmp_path / "quality.json").read_text())
    assert [row["seed"] for row in record["rows"]] == [1, 2] and record["quick"] is True
    for row in record["rows"]:
        assert 0.0 <= row["token_accuracy"] <= 1.0 and 0.0 <= row["exact_match"] <= 1.0
        assert 0.0 <= row["bleu"] <= 100.0 and row["wall_s"] > 0 and row["step"] == 8
        assert len(row["position_accuracy"]) == 16
    assert set(record["summary"]) == {"min", "median", "max"}
    assert record["goals"] == [] and record["config"]["model"]["d_model"] == 32


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    result = run_bench("--quick", "model.n_heads=3")
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "model.n_heads" in result.stderr, result.stderr
    result = run_bench("--quick", "--goal", "bleu=98")
    assert result.returncode == 2 and "expected FIGURE>=NUMBER" in result.stderr
