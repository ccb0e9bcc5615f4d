"""The trainer's periodic held-out evaluation: when it is due, its numbers (loss, token accuracy, exact
match, BLEU, the per-position accuracy and the latent evaluations, the same on every rank), the
reconstructions it keeps and their file, and the latents' statistics that a checkpoint records. It
scores with :func:`.scoring.score_samples`, the loop ``parallel-latent evaluate`` runs too. The
trainer asks :meth:`Evaluator.due` at every step; the evaluator decides.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from parallel_latent.config import TrainingConfig
from parallel_latent.data import get_batch
from parallel_latent.data.prefetch import to_device
from parallel_latent.model import LatentAutoencoder, eval_mode
from parallel_latent.parallel import ParallelState
from parallel_latent.zero.params import gathered

from .bleu import reconstruction_bleu
from .latent_space import LatentMoments, LatentStats, latent_space_metrics
from .records import position_accuracy, reconstruction_records, truncation_note
from .scoring import EvaluationWorld, Scored, score_samples
from .totals import SAMPLES, reconstruction_metrics, reduce_stats

__all__ = ["EvaluatedRun", "Evaluator"]


@dataclass
class EvaluatedRun:
    """What the periodic evaluation reads of a training run (the trainer builds it from its
    :class:`parallel_latent.training.startup.Run`): the same on every rank but for each rank's
    slices of the model and its DP rank."""

    engine: torch.nn.Module  # the DeepSpeed engine: its forward (ZeRO-3 gathers), train/eval mode, device
    model: LatentAutoencoder  # the engine's module: decode, its configs, its parameters
    tokenizer: Any
    eval_set: Any  # the held-out split
    state: ParallelState  # the DP rank and size, the DP group, the TP size
    training: TrainingConfig  # micro_batch_size and the eval_* settings
    max_length: int  # model.max_length: how far a held-out sample is read
    run_dir: Path
    is_main: bool


class Evaluator:
    """The periodic evaluation of one run. Its subset is the first ``eval_batches * micro_batch *
    dp_size`` held-out samples, rounded down to a multiple of dp_size: DP rank r takes the r-th
    contiguous share, so every rank runs the same number of forwards (ZeRO-3 gathers parameters
    over DP)."""

    def __init__(self, run: EvaluatedRun):
        self.run, self.training, self.state = run, run.training, run.state
        self.micro_batch = run.training.micro_batch_size
        # The first ``training.eval_reconstructions`` samples of the last evaluation, with their
        # reconstructions (rank 0), and its step.
        self.examples: list[dict] = []
        self.examples_step: int | None = None
        # The latents' statistics last measured (by an evaluation, or for a checkpoint), with their step.
        self.latent_stats: LatentStats | None = None

    def due(self, step: int) -> bool:
        every = self.training.eval_every
        return bool(every and step % every == 0)

    def evaluate(self, step: int) -> dict[str, float] | None:
        """The held-out numbers (collective), None when the subset is empty. BLEU scores each
        reconstruction against its input as the model saw it (its first ``max_length`` tokens): the
        predicted ids are gathered over DP, rank 0 scores them with sacrebleu and broadcasts the score."""
        run, state = self.run, self.state
        total, first = self._subset()
        if total == 0:
            return None
        held_out = get_batch(run.eval_set, list(range(total)))
        run.engine.eval()
        try:
            scored = self._score_my_share(total, first)
            with gathered(run.model.parameters()):
                latent_metrics, self.latent_stats = latent_space_metrics(
                    scored, run.model.decode, self._world(), held_out["input_ids"], held_out["attention_mask"],
                    self.micro_batch, run.engine.device, first,
                )  # fmt: skip
        finally:
            run.engine.train()
        self.latent_stats.step = step
        totals = reduce_stats(scored.stats, run.engine.device, state.tp_size)
        predicted = self._gather_over_dp(scored.predictions)
        bleu = self._score_reconstructions(total, predicted, step)
        metrics = reconstruction_metrics(*totals.tolist())
        return {
            **{f"eval_{name}": value for name, value in metrics.items()},
            "eval_bleu": bleu,
            "eval_samples": int(totals[SAMPLES].item()),
            "eval_position_accuracy": position_accuracy(held_out["input_ids"], held_out["attention_mask"], predicted),
            **latent_metrics,
        }

    def _subset(self) -> tuple[int, int]:
        """(samples evaluated, the first of this DP rank's equal share of them)."""
        dp_size = self.state.dp_size
        limit = self.training.eval_batches * self.micro_batch * dp_size
        total = min(len(self.run.eval_set), limit) // dp_size * dp_size
        return total, self.state.dp_rank * (total // dp_size)

    def _score_my_share(self, total: int, first: int) -> Scored:
        engine = self.run.engine
        mine = get_batch(self.run.eval_set, list(range(first, first + total // self.state.dp_size)))
        return score_samples(
            lambda ids, mask, features: engine(
                ids, mask, return_predictions=True, return_latents=True, features=features
            ),
            mine["input_ids"], mine["attention_mask"], self.micro_batch, engine.device, mine.get("features"),
        )  # fmt: skip

    def latent_stats_at(self, step: int) -> LatentStats | None:
        """The latents' statistics of the weights at ``step`` (collective), which a checkpoint of
        ``step`` records: this step's evaluation's, else measured now on the evaluation's samples."""
        if self.latent_stats is not None and self.latent_stats.step == step:
            return self.latent_stats
        total, first = self._subset()
        if total == 0:
            return None
        self.run.engine.eval()
        try:
            latents = self._score_my_share(total, first).latents
        finally:
            self.run.engine.train()
        moments = self._world().sum(LatentMoments.of(latents).as_tensor())
        self.latent_stats = LatentMoments.from_tensor(moments).stats(total, step)
        return self.latent_stats

    def _world(self) -> EvaluationWorld:
        """This run's data-parallel ranks, each holding its share of the evaluated samples."""
        run, device = self.run, self.run.engine.device

        def on_main(compute: Callable[[], tuple]) -> tuple:
            values = torch.tensor(compute() if run.is_main else (0.0, 0.0), dtype=torch.float64, device=device)
            dist.broadcast(values, src=0)
            return tuple(values.tolist())

        return EvaluationWorld(
            run.model.model_cfg, run.model.feature_model.width, run.tokenizer,
            sum=lambda values: reduce_stats(values, device, self.state.tp_size),
            gather=lambda values: self._gather_over_dp(values.to(device)).cpu(),
            on_main=on_main,
        )  # fmt: skip

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
            self.examples = records[: self.training.eval_reconstructions]
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
            input_ids, attention_mask, features = to_device(batch, run.engine.device)
            with gathered(run.model.parameters()), eval_mode(run.model), torch.no_grad():
                predicted = run.model(input_ids, attention_mask, return_predictions=True, features=features).predictions
            records = reconstruction_records(
                run.tokenizer, batch["input_ids"], batch["attention_mask"], predicted.cpu(), self._truncated(count)
            )
        note = truncation_note(self.run.max_length)
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
