"""Reconstruction quality: BLEU is sacrebleu's corpus BLEU (checked against the definition), and the
trainer's evaluation reports it with token accuracy and exact match, the same numbers on every rank,
writing the held-out samples and their reconstructions at every evaluation. Real gloo ranks and
DeepSpeed: TP=2 x DP=2."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import pytest
import torch

from parallel_latent.evaluation.bleu import corpus_bleu
from parallel_latent.evaluation.records import position_accuracy
from tests.helpers.trainer_runs import TINY, TINY_CONFIG

PAIRS = [  # (reconstruction, input): lower case, no punctuation, so 13a tokenisation is str.split
    ("the cat sat on the mat", "the cat sat on the mat"),
    ("a quick brown fox jumps over the dog", "the quick brown fox jumps over the lazy dog"),
    ("she smiled at her sister and went out", "she smiled at her elder sister and went out"),
    ("mr darcy bowed to her and to her mother", "mr darcy bowed to her and then to her mother"),
]


def bleu_by_definition(pairs: list[tuple[str, str]]) -> float:
    """Corpus BLEU (Papineni et al., 2002): n-gram matches (clipped by the reference's counts) and
    n-gram totals summed over the corpus for n = 1..4, their geometric mean, times the brevity
    penalty exp(1 - r/c) when the hypotheses' length c is below the references' r."""
    matches, totals, c, r = [0] * 4, [0] * 4, 0, 0
    for hypothesis, reference in pairs:
        h, ref = hypothesis.split(), reference.split()
        c, r = c + len(h), r + len(ref)
        for n in range(1, 5):
            h_grams = Counter(tuple(h[i : i + n]) for i in range(len(h) - n + 1))
            r_grams = Counter(tuple(ref[i : i + n]) for i in range(len(ref) - n + 1))
            matches[n - 1] += sum(min(count, r_grams[g]) for g, count in h_grams.items())
            totals[n - 1] += max(len(h) - n + 1, 0)
    precision = math.exp(sum(math.log(m / t) for m, t in zip(matches, totals, strict=True)) / 4)
    return 100.0 * (1.0 if c >= r else math.exp(1 - r / c)) * precision


def test_bleu_is_corpus_bleu_as_defined():
    hypotheses, references = zip(*PAIRS, strict=True)
    got = corpus_bleu(list(hypotheses), list(references))
    assert got == pytest.approx(bleu_by_definition(PAIRS), rel=1e-12)
    # Corpus BLEU pools the counts; the mean of sentence BLEUs is another (larger) number here.
    assert got < sum(corpus_bleu([h], [r]) for h, r in PAIRS) / len(PAIRS)
    assert corpus_bleu(["It is a truth."], ["It is a truth."]) == pytest.approx(100.0)
    assert math.isnan(corpus_bleu([], []))
    with pytest.raises(ValueError, match="2 hypotheses but 1 references"):
        corpus_bleu(["a", "b"], ["a"])


def test_position_accuracy_counts_each_position_over_the_rows_that_reach_it():
    inputs = torch.tensor([[5, 6, 7, 8], [5, 9, 0, 0], [1, 6, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 0, 0]])
    predictions = torch.tensor([[5, 6, 3, 8], [5, 6, 2, 2], [5, 6, 2, 2]])  # pad positions hold anything
    assert position_accuracy(inputs, mask, predictions) == [2 / 3, 2 / 3, 0.0, 1.0]
    assert position_accuracy(inputs[1:], mask[1:], predictions[1:]) == [0.5, 0.5, None, None]


# --------------------------------------------------------------------------- #
# The trainer's evaluation, on every rank.
# --------------------------------------------------------------------------- #

EVAL_STEPS = (2, 4)


def train_and_report(run_dir: str, cache_dir: str):
    from parallel_latent.config import load_config
    from parallel_latent.training.trainer import train

    cfg = load_config(
        TINY_CONFIG,
        [
            *TINY,
            "parallel.tensor_parallel=2",
            "parallel.zero_stage=2",
            f"training.max_steps={EVAL_STEPS[-1]}",
            f"training.eval_every={EVAL_STEPS[0]}",
            "training.eval_batches=2",  # 2 x micro-batch 4 x DP 2 = 16 held-out samples
            "training.eval_reconstructions=16",
            f"logging.run_dir={run_dir}",
            f"data.cache_dir={cache_dir}",
        ],
    )
    result = train(cfg)
    return result.final_eval, result.reconstructions


@pytest.mark.slow
def test_evaluation_reports_bleu_on_every_rank_and_writes_reconstructions(pool4, tmp_path):
    run_dir = tmp_path / "run"
    results = pool4.run(train_and_report, str(run_dir), str(tmp_path / "cache"))
    evals = [final_eval for final_eval, _ in results]
    assert all(e == evals[0] for e in evals), f"ranks disagree: {evals}"
    final = evals[0]
    assert set(final) >= {"eval_loss", "eval_token_accuracy", "eval_exact_match", "eval_bleu"}
    by_position = [a for a in final["eval_position_accuracy"] if a is not None]
    assert len(final["eval_position_accuracy"]) == 16 and by_position[0] is not None  # every sample has a token 0
    assert min(by_position) <= final["eval_token_accuracy"] <= max(by_position)  # a weighted mean of them

    records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in logged] == list(EVAL_STEPS)
    for step in EVAL_STEPS:
        path = Path(run_dir) / "reconstructions" / f"step_{step:08d}.jsonl"
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        assert [line["index"] for line in lines] == list(range(16)) and all(line["step"] == step for line in lines)
        assert all(set(line) == {"step", "index", "input", "reconstruction", "exact", "truncated"} for line in lines)
    # The last file holds every evaluated sample: its BLEU is the reported one, and its exact flags
    # (from the predictions gathered over DP) agree with the exact-match count of the forward passes.
    assert final["eval_bleu"] == logged[-1]["eval_bleu"]
    assert final["eval_bleu"] == pytest.approx(
        corpus_bleu([line["reconstruction"] for line in lines], [line["input"] for line in lines]), abs=1e-9
    )
    assert sum(line["exact"] for line in lines) / len(lines) == final["eval_exact_match"]
    assert all((line["input"] == line["reconstruction"]) == line["exact"] for line in lines)

    examples = results[0][1]
    assert len(examples) == 3
    for (shown, reconstructed), line in zip(examples, lines, strict=False):
        assert shown.startswith(line["input"]) and reconstructed == line["reconstruction"]
        assert ("[... cut: the model sees the first 16 tokens]" in shown) == line["truncated"]
