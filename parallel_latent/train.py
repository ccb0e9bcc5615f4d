"""The trainer: DeepSpeed ZeRO over the tensor/data-parallel process groups.

One process per rank, started by a launcher (``torchrun``, ``deepspeed``, ``accelerate launch``,
``srun``) or by ``parallel-latent train --nproc N``; a single process with no launcher also works.

Per optimizer step, every rank:

1. takes the step's ``grad_accum_steps`` micro-batches from a background reader
   (:class:`BatchPrefetcher`, one step ahead) that walks a copy of the :class:`ShardedBatchSampler`
   keyed on (dp_rank, dp_size), so the ranks of a tensor-parallel group see the same samples; the
   reader also counts the step's global non-pad tokens ``N`` from the memory-mapped lengths of
   every DP rank's samples: no collective is needed for it;
2. for each micro-batch sets the dropout key (the optimizer step, and the position of the
   micro-batch in the step's global batch), runs forward, and back-propagates
   ``loss_sum * dp_size * grad_accum / N``.
   DeepSpeed divides by ``grad_accum`` and averages over data-parallel ranks, so the gradient is
   that of the mean loss over all N tokens of the step: DP=2 equals DP=1 with the doubled
   micro-batch even when the ranks hold different numbers of padding positions;
3. calls ``engine.step()`` (clipping by the model-parallel-aware global norm; under fp32/fp16 a
   step whose gradient norm is not finite is skipped by DeepSpeed's optimizer wrapper, or by our
   guard at ZeRO stage 0 in fp32; under bf16 it is caught at the next log line or checkpoint);
4. every ``training.vote_every`` steps, and before every evaluation and checkpoint, all-reduces
   "a stop signal arrived here" over the gloo control group, so all ranks stop at the same step.
   Statistics stay on the device and are reduced once per log line.

A SIGTERM or SIGINT (SLURM preemption, Ctrl-C) finishes the current step, writes a checkpoint
and returns normally (exit 0).  ``training.max_nonfinite_steps`` consecutive skipped steps raise
:class:`NonFiniteTrainingError`; no checkpoint is published during such a streak, so ``latest``
names weights from before it.
"""

from __future__ import annotations

import contextlib
import math
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from parallel_latent.checkpoint import (
    CheckpointSaveError,
    checkpoints_dir,
    find_latest_checkpoint,
    load_training_checkpoint,
    remove_unfinished_saves,
    resolve_checkpoint,
    save_training_checkpoint,
    saved_client_state,
)
from parallel_latent.config import (
    Config,
    ConfigError,
    keep_global_batch,
    resolved_global_batch_size,
    save_config,
    validate_world,
)
from parallel_latent.coordination import broadcast_value, directory_is_shared, is_main, main_first
from parallel_latent.data import ShardedBatchSampler, build_datasets, check_source, get_batch
from parallel_latent.data.prefetch import BatchPrefetcher, StepBatches
from parallel_latent.engine import EngineBundle, dump_deepspeed_config, initialize_engine, resolve_device
from parallel_latent.errors import ExitStatus
from parallel_latent.metrics import MetricsLogger, model_flops_per_sample, peak_flops_per_device, peak_memory_bytes
from parallel_latent.model import build_model, eval_mode
from parallel_latent.model.features import random_features_notice, random_features_unannounced
from parallel_latent.model.tokenizer import apply_tokenizer_facts, load_tokenizer, tokenizer_facts
from parallel_latent.parallel import init_distributed, launcher_environment
from parallel_latent.quality import (
    corpus_bleu,
    output_totals,
    position_accuracy,
    reconstruction_metrics,
    reconstruction_records,
    truncation_note,
)

__all__ = ["NonFiniteTrainingError", "TrainResult", "preflight", "train"]


class NonFiniteTrainingError(RuntimeError):
    """Too many consecutive steps with a non-finite loss or gradient."""

    exit_status = ExitStatus.NONFINITE


@dataclass
class TrainResult:
    run_dir: Path
    step: int  # optimizer steps taken (applied or skipped)
    stopped_by: str  # "max_steps" | "signal"
    final_eval: dict[str, float] | None
    checkpoint: Path | None
    skipped_steps: int
    wall_time_s: float
    reconstructions: list[tuple[str, str]] = field(default_factory=list)


# --------------------------------------------------------------------------- #
# Checks that need no process group (the CLI runs them before launching ranks).
# --------------------------------------------------------------------------- #


def preflight(cfg: Config, world_size: int, source: str = "<config>", processes_per_node: int | None = None) -> None:
    """Everything about ``cfg`` that can be checked without building anything: the world size
    against TP and the batch sizes, the device, the data path, the checkpoint to resume.
    Raises ConfigError / DataError with one line; writes nothing."""
    validate_world(cfg, world_size, source, processes_per_node)
    resolve_device(cfg, source)
    check_source(cfg.data)  # DataError if missing or empty; the contents are checked when prepared
    run_dir = Path(cfg.logging.run_dir)
    blocking = next((p for p in (run_dir, *run_dir.parents) if p.exists()), None)
    if blocking is not None and not blocking.is_dir():
        raise ConfigError(f"{source}: logging.run_dir={run_dir}: {blocking} is a file, not a directory")
    resume = cfg.checkpoint.resume
    if resume == "never":
        existing = checkpoints_dir(cfg.logging.run_dir)
        if existing.is_dir() and any(p.name.startswith("step_") for p in existing.iterdir()):
            raise ConfigError(
                f"{source}: checkpoint.resume=never but {existing} already holds checkpoints; "
                "choose another logging.run_dir or resume with checkpoint.resume=auto"
            )
    elif resume != "auto" and not Path(resume).exists():
        raise ConfigError(f"{source}: checkpoint.resume={resume}: no such checkpoint")
    elif resume != "auto" and not Path(resume).is_dir():
        raise ConfigError(f"{source}: checkpoint.resume={resume}: is a file; give a checkpoint or run directory")
    # A checkpoint whose global batch cannot be kept on this many processes: one line now, before
    # any rank starts (the trainer makes the same plan from rank 0's choice of checkpoint).
    planned_resume(cfg, world_size, checkpoint_to_resume(cfg))


def checkpoint_to_resume(cfg: Config) -> Path | None:
    """The checkpoint ``checkpoint.resume`` names, as this process sees it: ``auto`` = the run
    directory's latest complete one (None if there is none), ``never`` = None, else that path."""
    resume = cfg.checkpoint.resume
    if resume == "never":
        return None
    if resume == "auto":
        return find_latest_checkpoint(checkpoints_dir(cfg.logging.run_dir))
    return resolve_checkpoint(resume)


def planned_resume(cfg: Config, world_size: int, path: Path | None) -> tuple[Config, str | None]:
    """``cfg`` for continuing from ``path`` on ``world_size`` processes: the checkpoint's global
    batch kept (micro-batch and accumulation chosen for the new data-parallel size), and the line
    that says so; ConfigError (one line) when it cannot be kept. Unchanged without a checkpoint."""
    if path is None:
        return cfg, None
    sampler = saved_client_state(path).get("sampler") or {}
    if "global_batch_size" not in sampler:
        return cfg, None
    return keep_global_batch(cfg, world_size, int(sampler["global_batch_size"]), str(path))


def require_shared_run_dir(run_dir: Path, source: str) -> None:
    """Checkpoints are written by every rank into one directory tree and published by rank 0; a
    run directory on node-local disks (or a relative path from different working directories)
    would be a different directory per node, and the job would hang at its first save or resume.
    Refuse it at start-up, in seconds, on every rank (collective). Nothing is created: the probe
    goes into the nearest existing ancestor and is removed."""
    probe_dir = next(p for p in (run_dir, *run_dir.parents) if p.exists())
    if not directory_is_shared(probe_dir):
        raise ConfigError(
            f"{source}: logging.run_dir={run_dir} is not one directory for all ranks (node-local disks, or a "
            "relative path from different working directories): put the run directory on a file system "
            "every node shares"
        )


def load_tokenizer_once_per_node(cfg: Config):
    """The tokenizer, fetched by the first process of each node before the others look for it in
    the (node-local) hub cache: one download per node instead of one per rank."""
    with main_first(per_node=True):
        return load_tokenizer(cfg.tokenizer)


def build_model_once_per_node(cfg: Config, tp_group):
    """The model; a pretrained feature model is fetched from the hub by the first process of each
    node before the others read it from the cache. Random features are said once, in the banner."""
    with main_first(per_node=True) if cfg.feature_model.pretrained else random_features_unannounced():
        return build_model(cfg, tp_group)


# --------------------------------------------------------------------------- #
# Signals.
# --------------------------------------------------------------------------- #


class StopRequest:
    """SIGTERM / SIGINT set a flag that the training loop polls once per step (a second SIGINT
    interrupts at once, as usual)."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._previous: dict[int, Any] = {}

    def _handler(self, signum, frame) -> None:
        if self.signal_name is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal_name = signal.Signals(signum).name

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    @contextmanager
    def installed(self) -> Iterator[StopRequest]:
        for signum in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(ValueError):  # not the main thread: leave signals alone
                self._previous[signum] = signal.signal(signum, self._handler)
        try:
            yield self
        finally:
            for signum, previous in self._previous.items():
                signal.signal(signum, previous)


# --------------------------------------------------------------------------- #
# The trainer.
# --------------------------------------------------------------------------- #


# Layout of the per-step statistics vector (float64: exact integer counts up to 2**53).
LOSS_SUM, TOKENS, CORRECT, EXACT, SAMPLES = range(5)
NUM_STATS = 5


class Trainer:
    def __init__(self, cfg: Config, deepspeed_overrides: dict | None = None, source: str = "<config>"):
        self.source = source
        self.deepspeed_overrides = deepspeed_overrides
        self.start_time = time.perf_counter()
        launcher = launcher_environment()
        preflight(cfg, launcher["world_size"], source, launcher["local_world_size"])
        self.state = init_distributed(cfg.parallel.tensor_parallel, cfg.parallel.backend)
        if self.state.rank == 0:
            # Before anything is written: a save killed half-way may have left the disk full.
            for unfinished in remove_unfinished_saves(checkpoints_dir(cfg.logging.run_dir)):
                print(f"removed {unfinished}: a checkpoint save that never finished", flush=True)
        require_shared_run_dir(Path(cfg.logging.run_dir), source)

        self.tokenizer = load_tokenizer_once_per_node(cfg)
        self.tokenizer_facts = tokenizer_facts(self.tokenizer)
        cfg = apply_tokenizer_facts(cfg, self.tokenizer_facts)
        # Rank 0 decides which checkpoint every rank loads: ranks must never disagree on it (a
        # rank that resumed and one that started fresh would wait for each other forever). Its
        # global batch is kept, whatever the new layout: the run goes on as the same run.
        path = checkpoint_to_resume(cfg) if is_main() else None
        path = broadcast_value(None if path is None else str(path))
        self.resume_path = None if path is None else Path(path)
        self.cfg, self.batch_note = planned_resume(cfg, self.state.world_size, self.resume_path)
        cfg = self.cfg
        self.train_set, self.eval_set = build_datasets(cfg, self.tokenizer)
        self.micro_batch = cfg.training.micro_batch_size
        self.grad_accum = cfg.training.grad_accum_steps
        self.global_batch = resolved_global_batch_size(cfg, self.state.world_size)
        self.sampler = ShardedBatchSampler(
            len(self.train_set),
            self.micro_batch,
            self.state.dp_rank,
            self.state.dp_size,
            seed=cfg.training.seed,
            drop_last=True,
            grad_accum=self.grad_accum,
        )
        model = build_model_once_per_node(cfg, self.state.tp_group)
        self.bundle: EngineBundle = initialize_engine(model, cfg, self.state.world_size, deepspeed_overrides)
        self.engine = self.bundle.engine
        self.model = self.engine.module
        self.device = self.engine.device
        self.device_kind = resolve_device(cfg)
        self.run_dir = Path(cfg.logging.run_dir)
        self.is_main = self.state.rank == 0

        self.prefetcher: BatchPrefetcher | None = None
        self.step = 0
        self.step_lr = math.nan
        self.skipped_steps = 0
        self.consecutive_nonfinite = 0
        self.last_saved_step: int | None = None
        self.last_checkpoint: Path | None = None
        features = self.model.feature_model  # the GPT-2 that was loaded, not the YAML's widths
        self.flops_per_sample = model_flops_per_sample(cfg, features.blocks, features.width)["train"]
        self.peak_flops, self.peak_flops_source = peak_flops_per_device(self.device_kind, cfg.training.precision)

        # Everything above may still fail on bad input; only now is anything written.
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            save_config(cfg, self.run_dir / "config.yaml")
            (self.run_dir / "deepspeed_config.json").write_text(dump_deepspeed_config(self.bundle.config) + "\n")
        self._resume()
        if self.is_main:
            self._print_banner()
        self.logger = MetricsLogger(
            self.run_dir,
            enabled=self.is_main,
            total_steps=cfg.training.max_steps,
            start_step=self.step,
            tensorboard=cfg.logging.tensorboard,
            progress_bar=cfg.logging.progress_bar,
        )

    # -- resume ------------------------------------------------------------ #

    def _resume(self) -> None:
        """Continue from ``checkpoint.resume``: ``auto`` = this run directory's latest complete
        checkpoint if any; a path = that checkpoint (a step directory, a checkpoints directory
        or a run directory).  The checkpoint package restores weights, optimizer, schedule,
        engine counters and every RNG, also at another TP x DP layout; the data position and
        our counters come back from the client state saved by :meth:`save`."""
        path = self.resume_path
        if path is None:
            return
        loaded = load_training_checkpoint(self.engine, path, model=self.model, tp_group=self.state.tp_group)
        client = loaded.client_state
        self.step = int(client.get("step", loaded.step))
        self.skipped_steps = int(client.get("skipped_steps", 0))
        if "sampler" in client:
            self.sampler.load_state_dict(client["sampler"])
        self.last_saved_step, self.last_checkpoint = self.step, loaded.path
        if self.is_main:
            layout = " (resharded from another layout)" if loaded.resharded else ""
            print(f"resumed from {loaded.path} at step {self.step}{layout}", flush=True)
            if self.batch_note:
                print(self.batch_note, flush=True)

    def save(self) -> Path:
        """A training checkpoint of this step (collective), with the portable weights if
        ``checkpoint.export_portable``; ``latest`` moves only once it is complete. A save that
        cannot be written (CheckpointSaveError, on every rank) ends the run: the metrics are
        closed and the error goes up to the command line, which prints its one line."""
        client_state = {"step": self.step, "skipped_steps": self.skipped_steps, "sampler": self.sampler.state_dict()}
        try:
            path = save_training_checkpoint(
                self.engine,
                checkpoints_dir(self.run_dir),
                self.step,
                client_state,
                model=self.model,
                cfg=self.cfg,
                tokenizer_facts=self.tokenizer_facts,
                keep_last=self.cfg.checkpoint.keep_last,
                export_portable=self.cfg.checkpoint.export_portable,
                tp_group=self.state.tp_group,
            )
        except CheckpointSaveError:
            self.logger.close()
            raise
        self.last_saved_step, self.last_checkpoint = self.step, path
        return path

    # -- one step ------------------------------------------------------------ #

    def _to_device(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        # Pinned host memory (the prefetcher's, on a GPU) copies without blocking the host.
        return (
            batch["input_ids"].to(self.device, non_blocking=True),
            batch["attention_mask"].to(self.device, non_blocking=True),
        )

    def _step_batches(self) -> StepBatches:
        """This step's micro-batches and global token count, read ahead by the prefetcher. The
        prefetcher restarts from the sampler if something else moved it (a resume, a benchmark)."""
        position = (self.sampler.epoch, self.sampler.batches_consumed)
        batches = self.prefetcher.next() if self.prefetcher is not None else None
        if batches is None or batches.position != position:
            self.close()
            pin = self.device.type == "cuda"
            self.prefetcher = BatchPrefetcher(self.train_set, self.sampler, self.grad_accum, pin_memory=pin)
            batches = self.prefetcher.next()
        self.sampler.advance(self.grad_accum)
        return batches

    def close(self) -> None:
        """Stop the background reader (the trainer can be stepped again: it restarts)."""
        if self.prefetcher is not None:
            self.prefetcher.close()
            self.prefetcher = None

    def _vote_due(self, step: int) -> bool:
        """Whether the ranks vote on stopping before ``step`` (1-based): the same answer on every rank."""
        training, checkpoint = self.cfg.training, self.cfg.checkpoint
        return (
            step % training.vote_every == 0
            or step >= training.max_steps
            or bool(training.eval_every and step % training.eval_every == 0)
            or bool(checkpoint.save_every and step % checkpoint.save_every == 0)
        )

    def _vote(self, stop_requested: bool) -> bool:
        """Whether any rank was asked to stop (collective over the gloo control group)."""
        vote = torch.full((1,), 1.0 if stop_requested else 0.0, dtype=torch.float64)
        dist.all_reduce(vote, group=self.state.control_group)
        return bool(vote.numpy()[0] > 0)  # numpy(): a host tensor, by construction

    def train_step(self, stop_requested: bool = False) -> StepOutcome:
        """One optimizer step. Nothing here reads a device value or copies host data to the device
        blocking: the batches come pinned from the prefetcher with the step's token count, the
        statistics stay on the device (read once per log line), and a collective outside the engine
        (the stop vote, over gloo) runs only every ``training.vote_every`` steps. Under bf16 the same
        holds for DeepSpeed's ZeRO-1/2 step (tests/test_train_syncs.py)."""
        state, engine, rng = self.state, self.engine, self.model.dropout_rng
        self.step_lr = self.bundle.lr_scheduler.get_last_lr()[0]  # what this step's update uses
        batches = self._step_batches()
        stop = self._vote(stop_requested) if self._vote_due(self.step + 1) else False
        step_tokens = float(batches.global_tokens)
        # DeepSpeed divides each micro-batch loss by grad_accum and averages gradients over the
        # dp_size data-parallel ranks; this weight undoes both and normalises by the step's
        # global token count instead.
        weight_per_token = state.dp_size * self.grad_accum / max(step_tokens, 1.0)
        step_stats = torch.zeros(NUM_STATS, dtype=torch.float64, device=self.device)
        for micro_step, batch in enumerate(batches.micro_batches):
            input_ids, attention_mask = self._to_device(batch)
            # Masks keyed on (optimizer step, position in the step's global batch): the same masks
            # however the global batch is cut into micro-batches and data-parallel ranks.
            rng.step = self.step
            rng.sample_offset = (micro_step * state.dp_size + state.dp_rank) * self.micro_batch
            out = engine(input_ids, attention_mask)
            engine.backward(out.loss_sum * weight_per_token)
            engine.step()
            # In place on the device: no indexed assignment (it would build a tensor from Python data).
            step_stats[:SAMPLES].add_(output_totals(out))
            step_stats[SAMPLES:].add_(input_ids.shape[0])
        # DeepSpeed's own skip decision, already a Python bool: fp16's loss scaler and the bf16
        # ZeRO-3 / stage-0 optimizers read the norm's finiteness on the host inside engine.step();
        # the bf16 ZeRO-1/2 step has no overflow scan and reads nothing from the device
        # (engine.sync_free_zero_step), so there it is always True.
        applied = bool(engine.was_step_applied())
        return StepOutcome(step_stats, applied, stop, step_tokens, self.global_batch)

    def _reduce_stats(self, stats: torch.Tensor) -> torch.Tensor:
        """Sum over the world, divided by TP: the ranks of a TP group hold identical statistics
        (same samples, the loss is reduced over the vocabulary slices), so this is the sum over
        the data-parallel group (on the host: the one read of these numbers)."""
        reduced = stats.to(self.device, copy=True)
        dist.all_reduce(reduced)
        return reduced.cpu() / self.state.tp_size

    # -- evaluation ------------------------------------------------------------ #

    def evaluate(self) -> dict[str, float] | None:
        """Loss, token accuracy, exact-match rate and BLEU on the held-out split (the same numbers
        on every rank).  Uses the first ``eval_batches * micro_batch * dp_size`` held-out samples,
        rounded down to a multiple of dp_size; DP rank r takes the r-th contiguous share, so
        every rank runs the same number of forwards (ZeRO-3 gathers parameters over DP).

        BLEU scores each reconstruction against its input as the model saw it (its first
        ``max_length`` tokens): the predicted ids are gathered over DP, rank 0 scores them with
        sacrebleu and broadcasts the score.  Rank 0 keeps the first
        ``training.eval_reconstructions`` samples with their reconstructions (``eval_examples``)."""
        cfg, state = self.cfg, self.state
        limit = cfg.training.eval_batches * self.micro_batch * state.dp_size
        total = min(len(self.eval_set), limit) // state.dp_size * state.dp_size
        if total == 0:
            return None
        share = total // state.dp_size
        start = state.dp_rank * share
        stats = torch.zeros(NUM_STATS, dtype=torch.float64)
        predictions = []
        self.engine.eval()
        try:
            with torch.no_grad():
                for offset in range(0, share, self.micro_batch):
                    indices = list(range(start + offset, start + min(offset + self.micro_batch, share)))
                    input_ids, attention_mask = self._to_device(get_batch(self.eval_set, indices))
                    out = self.engine(input_ids, attention_mask, return_predictions=True)
                    stats[:SAMPLES] += output_totals(out).cpu()
                    stats[SAMPLES] += len(indices)
                    predictions.append(out.predictions)
        finally:
            self.engine.train()
        totals = self._reduce_stats(stats)
        predicted = self._gather_over_dp(torch.cat(predictions))
        bleu = self._score_reconstructions(total, predicted)
        held_out = get_batch(self.eval_set, list(range(total)))
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

    def _eval_truncated(self, count: int) -> torch.Tensor | None:
        """Which of the first ``count`` held-out samples were cut to ``max_length`` tokens."""
        if hasattr(self.eval_set, "truncated_at"):
            return torch.as_tensor(self.eval_set.truncated_at(list(range(count))))
        truncated = getattr(self.eval_set, "truncated", None)
        return None if truncated is None else torch.as_tensor(truncated[:count])

    def _score_reconstructions(self, total: int, predicted: torch.Tensor) -> float:
        """Corpus BLEU of the first ``total`` held-out samples' reconstructions (collective); keeps
        the examples of this evaluation on rank 0."""
        score = torch.zeros(1, dtype=torch.float64, device=self.device)
        self.eval_examples, self.eval_examples_step = [], self.step
        if self.is_main:
            batch, cut = get_batch(self.eval_set, list(range(total))), self._eval_truncated(total)
            records = reconstruction_records(
                self.tokenizer, batch["input_ids"], batch["attention_mask"], predicted.cpu(), cut
            )
            score[0] = corpus_bleu([r["reconstruction"] for r in records], [r["input"] for r in records])
            self.eval_examples = records[: self.cfg.training.eval_reconstructions]
        dist.broadcast(score, src=0)
        return score.item()

    def reconstructions(self, count: int) -> list[tuple[str, str]]:
        """A few held-out samples as the model saw them (a cut one marked) and their reconstructions:
        those of this step's evaluation if there was one, else computed now (collective: all ranks)."""
        if getattr(self, "eval_examples_step", None) == self.step:
            records = self.eval_examples[:count]
        else:
            count = min(count, len(self.eval_set))
            batch = get_batch(self.eval_set, list(range(count)))
            input_ids, attention_mask = self._to_device(batch)
            with self._gathered_parameters(), eval_mode(self.model), torch.no_grad():
                predicted = self.model(input_ids, attention_mask, return_predictions=True).predictions
            cut = self._eval_truncated(count)
            records = reconstruction_records(
                self.tokenizer, batch["input_ids"], batch["attention_mask"], predicted.cpu(), cut
            )
        note = truncation_note(self.cfg.model.max_length)
        return [(r["input"] + (f" {note}" if r["truncated"] else ""), r["reconstruction"]) for r in records]

    @contextmanager
    def _gathered_parameters(self):
        """ZeRO-3 keeps each parameter partitioned over DP; gather them for code that runs the
        model outside the engine's forward (reconstruction, portable export)."""
        if self.cfg.parallel.zero_stage == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(self.model.parameters()), modifier_rank=None):
                yield
        else:
            yield

    # -- the loop ------------------------------------------------------------ #

    def run(self, stop: StopRequest) -> TrainResult:
        cfg, training = self.cfg, self.cfg.training
        max_steps = training.max_steps
        window = self._new_window()
        final_eval: dict[str, float] | None = None
        eval_step = -1
        stopped_by = "max_steps"
        if self.step >= max_steps:
            self.logger.print(
                f"{self.run_dir} is already at step {self.step} (training.max_steps={max_steps}): "
                "nothing to train; raise training.max_steps to continue"
            )
            eval_step = self.step  # and no second evaluation of the same weights
        while self.step < max_steps:
            started = time.perf_counter()
            with self._counting_syncs(self.step + 1 == cfg.logging.count_syncs_at_step):
                outcome = self.train_step(stop.requested)
            self.step += 1
            if outcome.applied:
                self.consecutive_nonfinite = 0
            else:  # a non-finite loss or gradient: DeepSpeed skipped the update
                self.consecutive_nonfinite += 1
                self.skipped_steps += 1
            window.add(outcome, time.perf_counter() - started)

            postfix = {}
            if self.step % training.log_every == 0 or self.step == max_steps:
                postfix = self._log(window)
                window = self._new_window()
            self.logger.advance(1, **postfix)
            if training.eval_every and self.step % training.eval_every == 0:
                final_eval, eval_step = self._evaluate_and_log(), self.step

            limit = training.max_nonfinite_steps
            if limit and self.consecutive_nonfinite >= limit:
                self.logger.close()
                raise NonFiniteTrainingError(self._nonfinite_message(limit))
            if outcome.stop:
                stopped_by = "signal"
                break
            # No checkpoint in the middle of a non-finite streak: `latest` keeps pointing at
            # weights from before the trouble.
            if (
                cfg.checkpoint.save_every
                and self.step % cfg.checkpoint.save_every == 0
                and self.consecutive_nonfinite == 0
            ):
                self._refuse_nonfinite_bf16(window)
                self.save()

        self.close()
        if stopped_by == "max_steps" and eval_step != self.step and training.eval_every:
            final_eval = self._evaluate_and_log()
        if self.last_saved_step != self.step and (stopped_by == "signal" or cfg.checkpoint.save_final):
            self._refuse_nonfinite_bf16(window)
            self.save()
        if stopped_by == "signal":
            self.logger.print(
                f"stop requested ({stop.signal_name or 'signal on another rank'}): "
                f"checkpoint {self.last_checkpoint} written at step {self.step}"
            )
        examples: list[tuple[str, str]] = []
        if stopped_by == "max_steps" and cfg.logging.print_samples:
            examples = self.reconstructions(cfg.logging.print_samples)
        self.logger.close()
        result = TrainResult(
            run_dir=self.run_dir,
            step=self.step,
            stopped_by=stopped_by,
            final_eval=final_eval,
            checkpoint=self.last_checkpoint,
            skipped_steps=self.skipped_steps,
            wall_time_s=time.perf_counter() - self.start_time,
            reconstructions=examples,
        )
        if self.is_main:
            self._print_summary(result)
        return result

    def _refuse_nonfinite_bf16(self, window: _Window, totals: torch.Tensor | None = None) -> None:
        """Under bf16 DeepSpeed applies every step (no overflow scan, see engine.py): a non-finite
        loss since the last check means the weights are spoiled. Stop before they are logged as
        fine or published (collective: the window's statistics are reduced over the world)."""
        if self.cfg.training.precision != "bf16":
            return
        if totals is None and window.steps == 0:
            return  # checked when the window was logged; the same on every rank, so no collective is skipped
        if totals is None:
            totals = self._reduce_stats(window.stats)
        if not math.isfinite(float(totals[LOSS_SUM])):
            self.close()
            self.logger.close()
            where = (
                f"the last checkpoint, {self.last_checkpoint} (step {self.last_saved_step}), is from before it"
                if self.last_checkpoint
                else "no checkpoint had been written yet"
            )
            raise NonFiniteTrainingError(
                f"stopped at step {self.step}: a non-finite loss in the last {window.steps} steps under bf16, "
                f"whose steps are applied without an overflow check; {where}; try a lower optimizer.lr or "
                "optimizer.grad_clip > 0"
            )

    @contextmanager
    def _counting_syncs(self, enabled: bool):
        """On CUDA, count the host-device synchronisations of the enclosed step (torch warns at
        each one in its sync debug mode) and log them with their first sources."""
        if not enabled or self.device.type != "cuda":
            yield
            return
        import warnings

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = [w for w in caught if "synchroniz" in str(w.message)]
        sources = sorted({f"{Path(w.filename).name}:{w.lineno}" for w in syncs})
        self.logger.write({"kind": "syncs", "step": self.step + 1, "count": len(syncs), "sources": sources[:20]})

    def _nonfinite_message(self, limit: int) -> str:
        where = (
            f"the last checkpoint, {self.last_checkpoint} (step {self.last_saved_step}), is from before them"
            if self.last_checkpoint
            else "no checkpoint had been written yet"
        )
        return (
            f"stopped at step {self.step}: {self.consecutive_nonfinite} consecutive steps with a non-finite "
            f"loss or gradient (training.max_nonfinite_steps={limit}); they were skipped and {where}; "
            "try a lower optimizer.lr, optimizer.grad_clip > 0, or fp32/bf16 instead of fp16"
        )

    def _evaluate_and_log(self) -> dict[str, float] | None:
        result = self.evaluate()
        if result is not None:
            self.logger.write({"kind": "eval", "step": self.step, **result})
            self.logger.print(
                f"step {self.step}: held-out loss {result['eval_loss']:.4f}, token accuracy "
                f"{result['eval_token_accuracy']:.4f}, exact match {result['eval_exact_match']:.4f}, "
                f"BLEU {result['eval_bleu']:.2f} ({result['eval_samples']} samples)"
            )
            if self.is_main and self.eval_examples:
                self._write_reconstructions(self.eval_examples)
        return result

    def _write_reconstructions(self, records: list[dict]) -> None:
        """``run_dir/reconstructions/step_<step>.jsonl`` and TensorBoard text: the same held-out
        samples at every evaluation, so their lines show how the reconstructions evolve."""
        import json

        directory = self.run_dir / "reconstructions"
        directory.mkdir(parents=True, exist_ok=True)
        lines = [json.dumps({"step": self.step, "index": i, **r}) + "\n" for i, r in enumerate(records)]
        (directory / f"step_{self.step:08d}.jsonl").write_text("".join(lines), encoding="utf-8")
        writer = self.logger.tensorboard
        if writer is not None:

            def cell(text: str) -> str:
                return text.replace("|", "\\|").replace("\n", " ")

            table = ["| input (as the model saw it) | reconstruction | exact |", "| --- | --- | --- |"]
            table += [
                f"| {cell(r['input'])}{' *(cut)*' if r['truncated'] else ''} | {cell(r['reconstruction'])} | "
                f"{'yes' if r['exact'] else 'no'} |"
                for r in records
            ]
            writer.add_text("eval/reconstructions", "\n".join(table), self.step)

    def _new_window(self) -> _Window:
        return _Window(torch.zeros(NUM_STATS, dtype=torch.float64, device=self.device))

    def _log(self, window: _Window) -> dict[str, str]:
        """Write the window's metrics line; return the progress bar's new postfix. The one place
        per log interval where training statistics leave the device."""
        seconds = max(window.seconds, 1e-9)
        samples_per_s = window.samples_processed / seconds
        model_flops_per_s = self.flops_per_sample * samples_per_s
        memory, _ = peak_memory_bytes(self.device_kind)
        grad_norm = self.engine.get_global_grad_norm()
        totals = self._reduce_stats(window.stats)
        self._refuse_nonfinite_bf16(window, totals)
        loss_sum, tokens, correct, exact, samples = totals.tolist()
        finite = tokens > 0
        record = {
            "kind": "train",
            "step": self.step,
            "loss": loss_sum / tokens if finite else math.nan,
            "token_accuracy": correct / tokens if finite else math.nan,
            "exact_match": exact / samples if finite else math.nan,
            "lr": self.step_lr,
            "grad_norm": float(grad_norm) if grad_norm is not None else None,
            "tokens": int(window.tokens_processed),  # non-pad tokens of the window, all ranks
            "samples": int(window.samples_processed),
            "tokens_per_s": window.tokens_processed / seconds,
            "samples_per_s": samples_per_s,
            "step_time_s": seconds / window.steps,
            "mfu": model_flops_per_s / (self.state.world_size * self.peak_flops),
            "model_tflops_per_device": model_flops_per_s / self.state.world_size / 1e12,
            "peak_memory_gb": memory / 2**30,  # this rank (rank 0)
            "skipped_steps": self.skipped_steps,
            "steps_in_window": window.steps,
        }
        self.logger.write(record)
        return {
            "loss": f"{record['loss']:.4f}",
            "acc": f"{record['token_accuracy']:.3f}",
            "tok/s": f"{record['tokens_per_s']:.0f}",
        }

    def _print_banner(self) -> None:
        s, cfg = self.state, self.cfg
        # This rank's TP slices (ZeRO-3 partitions them further; ds_numel is the unpartitioned size).
        trainable = sum(getattr(p, "ds_numel", p.numel()) for p in self.model.trainable_parameters())
        print(
            f"parallel-latent: {s.world_size} rank(s) = TP {s.tp_size} x DP {s.dp_size}, ZeRO stage "
            f"{cfg.parallel.zero_stage}, {cfg.training.precision}, {self.device_kind}; "
            f"{len(self.train_set)} train / {len(self.eval_set)} held-out samples of {cfg.model.max_length} tokens; "
            f"global batch {self.global_batch}; "
            f"{trainable:,} trainable parameters on rank 0; run dir {self.run_dir}",
            flush=True,
        )
        zero = self.bundle.config["zero_optimization"]
        reduce_dtype = self.bundle.config.get("communication_data_type", cfg.training.precision)
        print(
            f"data parallelism: gradients reduced in {reduce_dtype}"
            + (f", overlapped with backward: {'on' if zero.get('overlap_comm') else 'off'}" if zero["stage"] else ""),
            flush=True,
        )
        if not cfg.feature_model.pretrained:
            print(random_features_notice(cfg.feature_model), flush=True)
        if s.tp_size > 1:
            print(f"tensor parallelism: {self._tp_options_line()}", flush=True)
        if self.device_kind == "cpu":
            print(f"MFU peak: {self.peak_flops_source}", flush=True)

    def _tp_options_line(self) -> str:
        parallel, model = self.cfg.parallel, self.model
        if model.split_feature_model:
            features = "frozen feature pass split over the TP group (one all-gather of the features)"
        elif not self.cfg.feature_model.frozen:
            features = "feature pass replicated on every TP rank (the feature model trains)"
        else:
            features = "feature pass replicated on every TP rank (parallel.split_feature_model=false)"
        sequence = "sequence parallel" if model.sequence_parallel else "no sequence parallelism"
        overlap = "backward collective overlapped" if parallel.tp_overlap_comm else "backward collective not overlapped"
        return f"{features}; {sequence}; {overlap}"

    def _print_summary(self, result: TrainResult) -> None:
        lines = [f"done: {result.step} steps in {result.wall_time_s:.0f} s ({result.skipped_steps} skipped)"]
        if result.final_eval:
            e = result.final_eval
            lines.append(
                f"held-out: loss {e['eval_loss']:.4f}, token accuracy {e['eval_token_accuracy']:.4f}, "
                f"exact match {e['eval_exact_match']:.4f}, BLEU {e['eval_bleu']:.2f}"
            )
        if result.reconstructions:
            lines.append("held-out samples, as the model saw them, and their reconstructions:")
        for original, reconstructed in result.reconstructions:
            lines.append(f"  input:         {original}")
            lines.append(f"  reconstructed: {reconstructed}")
        if result.checkpoint:
            lines.append(f"checkpoint: {result.checkpoint}")
        print("\n".join(lines), flush=True)


@dataclass
class _Window:
    """Statistics accumulated between two log lines. Throughput counts every step (host numbers);
    loss, accuracy and exact match (this rank's, on the device) count only the steps that were
    applied (a skipped step's non-finite loss would turn the window's means into NaN)."""

    stats: torch.Tensor  # [NUM_STATS] float64 on the training device
    steps: int = 0
    seconds: float = 0.0
    tokens_processed: float = 0.0
    samples_processed: float = 0.0

    def add(self, outcome: StepOutcome, seconds: float) -> None:
        self.steps += 1
        self.seconds += seconds
        self.tokens_processed += outcome.tokens
        self.samples_processed += outcome.samples
        if outcome.applied:
            self.stats += outcome.stats


@dataclass
class StepOutcome:
    stats: torch.Tensor  # this rank's [NUM_STATS] statistics of the step, on the device
    applied: bool  # False: DeepSpeed skipped a non-finite update
    stop: bool  # some rank received SIGTERM / SIGINT
    tokens: float  # non-pad tokens of the step's global batch
    samples: int  # samples of the step's global batch


def train(cfg: Config, deepspeed_overrides: dict | None = None, source: str = "<config>") -> TrainResult:
    """Train ``cfg`` on this rank (every rank calls it).  See the module docstring."""
    stop = StopRequest()
    with stop.installed():
        trainer = Trainer(cfg, deepspeed_overrides, source)
        try:
            return trainer.run(stop)
        finally:
            trainer.close()
