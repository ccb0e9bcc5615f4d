"""Held-out evaluation: the one loop that scores samples (:func:`score_samples`, used by the
trainer's :class:`Evaluator` and by ``parallel-latent evaluate`` / ``save-pretrained`` through
:mod:`parallel_latent.inference`), and the trainer's periodic evaluation: when it is due, its
numbers (loss, token accuracy, exact match, BLEU and the per-position accuracy, the same on every
rank), the reconstructions it keeps and their file. The trainer asks :meth:`Evaluator.due` at every
step; the evaluator decides.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist

from parallel_latent.checkpoint.zero_access import gathered
from parallel_latent.data import get_batch
from parallel_latent.data.prefetch import to_device
from parallel_latent.model import eval_mode
from parallel_latent.quality import (
    NUM_STATS,
    SAMPLES,
    corpus_bleu,
    output_totals,
    position_accuracy,
    reconstruction_metrics,
    reconstruction_records,
    truncation_note,
)

__all__ = ["Evaluator", "reconstruction_bleu", "score_samples"]


def score_samples(forward, input_ids: torch.Tensor, attention_mask: torch.Tensor, batch_size: int, device):
    """The statistics vector (:mod:`parallel_latent.quality`'s layout, float64 on the host) and the
    predicted ids of the samples [N, T], run through ``forward(ids, mask)`` (an AutoencoderOutput
    with predictions) in batches of ``batch_size``, without autograd."""
    stats = torch.zeros(NUM_STATS, dtype=torch.float64)
    predictions = []
    with torch.no_grad():
        for start in range(0, input_ids.shape[0], batch_size):
            rows = slice(start, start + batch_size)
            ids, mask = to_device({"input_ids": input_ids[rows], "attention_mask": attention_mask[rows]}, device)
            out = forward(ids, mask)
            stats[:SAMPLES] += output_totals(out).cpu()
            stats[SAMPLES] += ids.shape[0]
            predictions.append(out.predictions)
    predicted = torch.cat(predictions) if predictions else input_ids.new_empty((0, input_ids.shape[1]))
    return stats, predicted


def reconstruction_bleu(records: list[dict]) -> float:
    """Corpus BLEU of reconstruction records (:func:`quality.reconstruction_records`) against their inputs."""
    return corpus_bleu([r["reconstruction"] for r in records], [r["input"] for r in records])


class Evaluator:
    """The periodic evaluation of one run (``run``: :class:`parallel_latent.startup.Run`). Its subset
    is the first ``eval_batches * micro_batch * dp_size`` held-out samples, rounded down to a
    multiple of dp_size: DP rank r takes the r-th contiguous share, so every rank runs the same
    number of forwards (ZeRO-3 gathers parameters over DP)."""

    def __init__(self, run: Any):
        self.run, self.cfg, self.state = run, run.cfg, run.state
        self.micro_batch = run.cfg.training.micro_batch_size
        # The first ``training.eval_reconstructions`` samples of the last evaluation, with their
        # reconstructions (rank 0), and its step.
        self.examples: list[dict] = []
        self.examples_step: int | None = None

    def due(self, step: int) -> bool:
        every = self.cfg.training.eval_every
        return bool(every and step % every == 0)

    def evaluate(self, step: int) -> dict[str, float] | None:
        """The held-out numbers (collective), None when the subset is empty. BLEU scores each
        reconstruction against its input as the model saw it (its first ``max_length`` tokens): the
        predicted ids are gathered over DP, rank 0 scores them with sacrebleu and broadcasts the score."""
        run, state = self.run, self.state
        limit = self.cfg.training.eval_batches * self.micro_batch * state.dp_size
        total = min(len(run.eval_set), limit) // state.dp_size * state.dp_size
        if total == 0:
            return None
        share = total // state.dp_size
        mine = get_batch(run.eval_set, list(range(state.dp_rank * share, (state.dp_rank + 1) * share)))
        run.engine.eval()
        try:
            stats, predictions = score_samples(
                lambda ids, mask: run.engine(ids, mask, return_predictions=True),
                mine["input_ids"], mine["attention_mask"], self.micro_batch, run.engine.device,
            )  # fmt: skip
        finally:
            run.engine.train()
        totals = reduce_stats(stats, run.engine.device, state.tp_size)
        predicted = self._gather_over_dp(predictions)
        bleu = self._score_reconstructions(total, predicted, step)
        held_out = get_batch(run.eval_set, list(range(total)))
        metrics = reconstruction_metrics(*totals.tolist())
        return {
            **{f"eval_{name}": value for name, value in metrics.items()},
            "eval_bleu": bleu,
            "eval_samples": int(totals[SAMPLES].item()),
            "eval_position_accuracy": position_accuracy(held_out["input_ids"], held_out["attention_mask"], predicted),
        }

    def _gather_over_dp(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every DP rank's equally sized ``tensor``, concatenated in DP-rank order (every rank)."""
        if self.state.dp_size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.state.dp_size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.state.dp_group)
        return torch.cat(parts)

    def _truncated(self, count: int) -> torch.Tensor | None:
        """Which of the first ``count`` held-out samples were cut to ``max_length`` tokens."""
        eval_set = self.run.eval_set
        if hasattr(eval_set, "truncated_at"):
            return torch.as_tensor(eval_set.truncated_at(list(range(count))))
        truncated = getattr(eval_set, "truncated", None)
        return None if truncated is None else torch.as_tensor(truncated[:count])

    def _score_reconstructions(self, total: int, predicted: torch.Tensor, step: int) -> float:
        """Corpus BLEU of the first ``total`` held-out samples' reconstructions (collective); keeps
        the examples of this evaluation on rank 0."""
        run = self.run
        score = torch.zeros(1, dtype=torch.float64, device=run.engine.device)
        self.examples, self.examples_step = [], step
        if run.is_main:
            batch, cut = get_batch(run.eval_set, list(range(total))), self._truncated(total)
            records = reconstruction_records(
                run.tokenizer, batch["input_ids"], batch["attention_mask"], predicted.cpu(), cut
            )
            score[0] = reconstruction_bleu(records)
            self.examples = records[: self.cfg.training.eval_reconstructions]
        dist.broadcast(score, src=0)
        return score.item()

    def reconstructions(self, count: int, step: int) -> list[tuple[str, str]]:
        """A few held-out samples as the model saw them (a cut one marked) and their reconstructions:
        those of this step's evaluation if there was one, else computed now (collective: all ranks)."""
        run = self.run
        if self.examples_step == step:
            records = self.examples[:count]
        else:
            count = min(count, len(run.eval_set))
            batch = get_batch(run.eval_set, list(range(count)))
            input_ids, attention_mask = to_device(batch, run.engine.device)
            with gathered(run.model.parameters()), eval_mode(run.model), torch.no_grad():
                predicted = run.model(input_ids, attention_mask, return_predictions=True).predictions
            records = reconstruction_records(
                run.tokenizer, batch["input_ids"], batch["attention_mask"], predicted.cpu(), self._truncated(count)
            )
        note = truncation_note(self.cfg.model.max_length)
        return [(r["input"] + (f" {note}" if r["truncated"] else ""), r["reconstruction"]) for r in records]

    def write_reconstructions(self, step: int, tensorboard=None) -> None:
        """``run_dir/reconstructions/step_<step>.jsonl`` and TensorBoard text (rank 0): the same
        held-out samples at every evaluation, so their lines show how the reconstructions evolve."""
        records = self.examples
        if not (self.run.is_main and records):
            return
        directory = self.run.run_dir / "reconstructions"
        directory.mkdir(parents=True, exist_ok=True)
        lines = [json.dumps({"step": step, "index": i, **r}) + "\n" for i, r in enumerate(records)]
        (directory / f"step_{step:08d}.jsonl").write_text("".join(lines), encoding="utf-8")
        if tensorboard is not None:

            def cell(text: str) -> str:
                return text.replace("|", "\\|").replace("\n", " ")

            table = ["| input (as the model saw it) | reconstruction | exact |", "| --- | --- | --- |"]
            table += [
                f"| {cell(r['input'])}{' *(cut)*' if r['truncated'] else ''} | {cell(r['reconstruction'])} | "
                f"{'yes' if r['exact'] else 'no'} |"
                for r in records
            ]
            tensorboard.add_text("eval/reconstructions", "\n".join(table), step)


def reduce_stats(stats: torch.Tensor, device: torch.device, tp_size: int) -> torch.Tensor:
    """Sum over the world, divided by TP: the ranks of a TP group hold identical statistics (same
    samples, the loss is reduced over the vocabulary slices), so this is the sum over the
    data-parallel group (on the host: the one read of these numbers)."""
    reduced = stats.to(device, copy=True)
    dist.all_reduce(reduced)
    return reduced.cpu() / tp_size
