"""Training from a raw corpus path through the real trainer: ``parallel-latent train`` under
torchrun, 4 ranks = TP=2 x DP=2, dropout on, a fresh cache. The ranks start together on a missing
prepared copy: exactly one of them prepares it. A second job resumes from the step-3 checkpoint of
the first, on the same prepared copy (no new preparation): steps 4-6 are bit-identical."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from parallel_latent.data.prepare import LOG_NAME
from tests.helpers.trainer_runs import REPO, describe, run, torchrun_command, train_records

pytestmark = pytest.mark.slow

STEPS, HALF = 6, 3
RECIPE = [
    "model.dropout=0.1",
    f"training.max_steps={STEPS}",
    f"checkpoint.save_every={HALF}",
    "checkpoint.keep_last=0",
    "parallel.tensor_parallel=2",
    "parallel.zero_stage=2",
    "training.micro_batch_size=4",
]


def preparations(cache: Path) -> list[dict]:
    return [json.loads(line) for line in (cache / LOG_NAME).read_text().splitlines()]


def test_four_ranks_prepare_once_and_resume_bit_exactly(tmp_path):
    lines = (REPO / "parallel_latent" / "corpus" / "austen_pride_and_prejudice.txt").read_text().splitlines()
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps({"id": i, "text": line}) for i, line in enumerate(lines[:800])) + "\n")
    cache = tmp_path / "cache"
    data = [f"data.path={corpus}", f"data.cache_dir={cache}", "data.max_samples=0"]

    straight = tmp_path / "straight"
    result = run(torchrun_command(straight, *RECIPE, *data, nproc=4), timeout=400)
    assert result.returncode == 0, describe(result)
    assert "4 rank(s) = TP 2 x DP 2" in result.stdout
    entries = preparations(cache)
    assert len(entries) == 1 and entries[0]["rank"] == "0", entries
    assert entries[0]["num_samples"] == 800 and entries[0]["source"] == str(corpus)
    assert result.stdout.count("preparing ") == 1

    resumed = tmp_path / "resumed"
    tag = f"step_{HALF:08d}"
    shutil.copytree(straight / "checkpoints" / tag, resumed / "checkpoints" / tag)
    (resumed / "checkpoints" / "latest").write_text(tag + "\n")
    result = run(torchrun_command(resumed, *RECIPE, *data, nproc=4), timeout=400)
    assert result.returncode == 0, describe(result)
    assert f"at step {HALF}" in result.stdout and "preparing " not in result.stdout
    assert len(preparations(cache)) == 1
    want = {r["step"]: r for r in train_records(straight)}
    got = {r["step"]: r for r in train_records(resumed)}
    assert sorted(got) == list(range(HALF + 1, STEPS + 1))
    for step, record in got.items():
        for key in ("loss", "grad_norm", "token_accuracy", "tokens", "samples"):
            assert record[key] == want[step][key], (step, key, record[key], want[step][key])
