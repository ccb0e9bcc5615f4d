"""Training from a raw corpus path through the real trainer: what ``parallel-latent train`` runs on
each rank (``parallel_latent.training.trainer.train``), on 4 real gloo ranks = TP=2 x DP=2
(tests/helpers/pool_training.py), dropout on, a fresh cache. The ranks start together on a missing
prepared copy: exactly one of them prepares it. A second job resumes from the step-2 checkpoint of
the first, on the same prepared copy (no new preparation): steps 3-4 are bit-identical."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from parallel_latent.data.prepare import LOG_NAME
from tests.helpers.pool_training import shared_pool, train_in_pool
from tests.helpers.trainer_runs import REPO, train_records

pytestmark = pytest.mark.slow

# The fewest steps that cross a save and a resume; the fewest lines that still hold a held-out split
# and the 4 global batches of 8 samples.
STEPS, HALF = 4, 2
LINES = 200
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


@pytest.fixture(scope="module")
def pool(request):
    """Four ranks shared with the other checkpoint and data modules (tests/helpers/pool_training.py)."""
    return shared_pool(request, 4)


def test_four_ranks_prepare_once_and_resume_bit_exactly(pool, tmp_path):
    lines = (REPO / "parallel_latent" / "corpus" / "austen_pride_and_prejudice.txt").read_text().splitlines()
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps({"id": i, "text": line}) for i, line in enumerate(lines[:LINES])) + "\n")
    cache = tmp_path / "cache"
    data = [f"data.path={corpus}", f"data.cache_dir={cache}", "data.max_samples=0"]

    straight = tmp_path / "straight"
    stdout, _ = train_in_pool(pool, straight, *RECIPE, *data)
    assert "4 rank(s) = TP 2 x DP 2" in stdout
    entries = preparations(cache)
    assert len(entries) == 1 and entries[0]["rank"] == "0", entries
    assert entries[0]["num_samples"] == LINES and entries[0]["source"] == str(corpus)
    assert stdout.count("preparing ") == 1

    resumed = tmp_path / "resumed"
    tag = f"step_{HALF:08d}"
    shutil.copytree(straight / "checkpoints" / tag, resumed / "checkpoints" / tag)
    (resumed / "checkpoints" / "latest").write_text(tag + "\n")
    stdout, _ = train_in_pool(pool, resumed, *RECIPE, *data)
    assert f"at step {HALF}" in stdout and "preparing " not in stdout
    assert len(preparations(cache)) == 1
    want = {r["step"]: r for r in train_records(straight)}
    got = {r["step"]: r for r in train_records(resumed)}
    assert sorted(got) == list(range(HALF + 1, STEPS + 1))
    for step, record in got.items():
        for key in ("loss", "grad_norm", "token_accuracy", "tokens", "samples"):
            assert record[key] == want[step][key], (step, key, record[key], want[step][key])
