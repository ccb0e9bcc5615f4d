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
   ``trained_loss_sum * dp_size * grad_accum / N`` (N: every position with ``model.predict_length``).
   DeepSpeed divides by ``grad_accum`` and averages over data-parallel ranks, so the gradient is
   that of the mean loss over all N tokens of the step: DP=2 equals DP=1 with the doubled
   micro-batch even when the ranks hold different numbers of padding positions;
3. calls ``engine.step()`` (clipping by the model-parallel-aware global norm; under fp32/fp16 a
   step whose gradient norm is not finite is skipped by DeepSpeed's optimizer wrapper, or by our
   guard at ZeRO stage 0 in fp32; under bf16 it is caught at the next log line or checkpoint);
4. every ``training.vote_every`` steps, and before every evaluation and checkpoint, all-reduces
   "a stop signal arrived here" over the gloo control group, so all ranks stop at the same step;
   while a background save is in flight, every step, with what this rank's writer has come to, so
   a write that failed on any rank ends the run on every rank at the step after it (exit status 4,
   the save's one line). Statistics stay on the device and are reduced once per log line.

A SIGTERM or SIGINT (SLURM preemption, Ctrl-C) finishes the current step, writes a checkpoint
and returns normally (exit 0); during start-up, with no step to finish and nothing new to save, it
has its usual effect at once (a rank that is still starting when its job is torn down leaves then,
not at the launcher's SIGKILL 30 s later).  ``training.max_nonfinite_steps`` consecutive skipped steps raise
:class:`NonFiniteTrainingError`; no checkpoint is published during such a streak, so ``latest``
names weights from before it.
"""

from __future__ import annotations

import contextlib
import math
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from parallel_latent.checkpoint import load_training_checkpoint
from parallel_latent.config import Config
from parallel_latent.data import ShardedBatchSampler
from parallel_latent.data.prefetch import BatchPrefetcher, StepBatches, to_device
from parallel_latent.errors import ExitStatus, one_line
from parallel_latent.evaluation.periodic import EvaluatedRun, Evaluator
from parallel_latent.evaluation.totals import LOSS_SUM, NUM_STATS, SAMPLES, output_totals, reduce_stats
from parallel_latent.launching.worker_logs import stop_cause

from .checkpointer import Checkpointer
from .flops import model_flops_per_sample, peak_flops_per_device, peak_memory_bytes
from .metrics import (
    MetricsLogger,
    Window,
    counting_syncs,
    profiling_kernels,
    progress_postfix,
    synchronize,
    train_record,
)
from .report import banner_lines, summary_text
from .startup import Run, preflight, start_run
from .world import resolved_global_batch_size

__all__ = ["NonFiniteTrainingError", "TrainResult", "Trainer", "preflight", "train"]


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


@dataclass(frozen=True)
class Vote:
    """What the ranks decided together before a step: the same on every rank."""

    stop: bool = False  # some rank received SIGTERM / SIGINT
    save_failed: bool = False  # some rank's writer of the background save in flight failed
    save_stopped: bool = False  # every rank's writer of that save has stopped


@dataclass
class StepOutcome:
    stats: torch.Tensor  # this rank's statistics of the step (parallel_latent.evaluation.totals), on the device
    applied: bool  # False: DeepSpeed skipped a non-finite update
    vote: Vote  # the stop vote before the step (all False where none was due)
    tokens: float  # non-pad tokens of the step's global batch
    samples: int  # samples of the step's global batch

    @property
    def stop(self) -> bool:
        return self.vote.stop


class StopRequest:
    """Once training has begun, SIGTERM / SIGINT set a flag that the training loop polls once per
    step (a second SIGINT interrupts at once, as usual); before, they do what they did before this
    was installed, at once."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self.training = False
        self._previous: dict[int, Any] = {}

    def _handler(self, signum, frame) -> None:
        if not self.training:
            previous = self._previous[signum]  # None: not set from Python, the default
            signal.signal(signum, signal.SIG_DFL if previous is None else previous)
            signal.raise_signal(signum)
            return
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


class NonFiniteWatch:
    """Consecutive steps whose update DeepSpeed skipped (a non-finite loss or gradient), and the two
    ways such trouble ends a run: too many skipped steps in a row, or (bf16, whose steps are applied
    without an overflow scan) a non-finite loss found at a log line or before a save."""

    def __init__(self, cfg: Config):
        self.limit, self.precision = cfg.training.max_nonfinite_steps, cfg.training.precision
        self.consecutive = 0
        self.skipped = 0

    def record(self, applied: bool) -> None:
        self.consecutive = 0 if applied else self.consecutive + 1
        self.skipped += not applied

    def check_streak(self, step: int, last: Callable[[], str]) -> None:
        """``last()``: the words on the last complete checkpoint, asked for only when the run stops."""
        if self.limit and self.consecutive >= self.limit:
            raise NonFiniteTrainingError(
                f"stopped at step {step}: {self.consecutive} consecutive steps with a non-finite loss or gradient "
                f"(training.max_nonfinite_steps={self.limit}); they were skipped and {last()} from before them; try a "
                "lower optimizer.lr, optimizer.grad_clip > 0, or fp32/bf16 instead of fp16"
            )

    def check_bf16_loss(self, loss_sum: float, steps: int, step: int, last: Callable[[], str]) -> None:
        if self.precision == "bf16" and not math.isfinite(loss_sum):
            raise NonFiniteTrainingError(
                f"stopped at step {step}: a non-finite loss in the last {steps} steps under bf16, whose steps are "
                f"applied without an overflow check; {last()} from before it; try a lower optimizer.lr or "
                "optimizer.grad_clip > 0"
            )


def evaluated_run(run: Run) -> EvaluatedRun:
    """What the periodic evaluation reads of ``run``."""
    return EvaluatedRun(
        engine=run.engine, model=run.model, tokenizer=run.tokenizer, eval_set=run.eval_set, state=run.state,
        training=run.cfg.training, max_length=run.cfg.model.max_length, run_dir=run.run_dir, is_main=run.is_main,
    )  # fmt: skip


class Trainer:
    """The training loop of one rank over a started :class:`Run`: the step, the data feeding, the
    stop vote, checkpoints, and when to log, evaluate and save."""

    def __init__(self, run: Run):
        self.job, self.cfg, self.state, self.progress = run, run.cfg, run.state, run.progress
        self.engine, self.model, self.device, self.bundle = run.engine, run.model, run.engine.device, run.bundle
        self.train_set, self.run_dir, self.is_main = run.train_set, run.run_dir, run.is_main
        training = self.cfg.training
        self.micro_batch, self.grad_accum = training.micro_batch_size, training.grad_accum_steps
        self.global_batch = resolved_global_batch_size(self.cfg, self.state.world_size)
        self.sampler = ShardedBatchSampler(
            len(self.train_set), self.micro_batch, self.state.dp_rank, self.state.dp_size,
            seed=training.seed, drop_last=True, grad_accum=self.grad_accum,
        )  # fmt: skip
        self.prefetcher: BatchPrefetcher | None = None
        self.step, self.step_lr = 0, math.nan
        self.evaluator = Evaluator(evaluated_run(run))
        self.checkpointer = Checkpointer(run, self.state_dict, self.evaluator.latent_stats_at)
        self.nonfinite = NonFiniteWatch(self.cfg)
        features = self.model.feature_model  # the decoder that was loaded, not the YAML's widths
        flops = model_flops_per_sample(self.cfg, features.blocks, features.width, features.matmul_weights)
        self.frozen_share = flops["frozen_forward"] / flops["train"] if flops["train"] else 0.0
        # What a step computes: with the feature cache, no frozen pass.
        cached = getattr(self.train_set, "features", None) is not None
        self.flops_per_sample = flops["train"] - (flops["frozen_forward"] if cached else 0.0)
        self.peak_flops, self.peak_flops_source = peak_flops_per_device(run.device_kind, training.precision)
        self._resume()
        if self.is_main:
            # This rank's TP slices (ZeRO-3 partitions them further; ds_numel is the unpartitioned size).
            trainable = sum(getattr(p, "ds_numel", p.numel()) for p in self.model.trainable_parameters())
            print(
                "\n".join(banner_lines(run, trainable, self.global_batch, self.peak_flops_source, self.frozen_share)),
                flush=True,
            )
        self.logger = MetricsLogger(
            self.run_dir, enabled=self.is_main, total_steps=training.max_steps, start_step=self.step,
            tensorboard=self.cfg.logging.tensorboard, progress_bar=self.cfg.logging.progress_bar,
        )  # fmt: skip

    # -- state: what a checkpoint keeps beside the engine's ------------------- #

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "skipped_steps": self.nonfinite.skipped, "sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: dict[str, Any], default_step: int) -> None:
        self.step = int(state.get("step", default_step))
        self.nonfinite.skipped = int(state.get("skipped_steps", 0))
        if "sampler" in state:
            self.sampler.load_state_dict(state["sampler"])

    def _resume(self) -> None:
        """Continue from the checkpoint start-up chose (rank 0's, for every rank). The checkpoint
        package restores weights, optimizer, schedule, engine counters and every RNG, also at
        another TP x DP layout; the data position and our counters come from :meth:`state_dict`."""
        if self.job.resume_path is None:
            return
        loaded = load_training_checkpoint(
            self.engine, self.job.resume_path, model=self.model, tp_group=self.state.tp_group
        )
        self.load_state_dict(loaded.client_state, loaded.step)
        self.checkpointer.resumed(self.step, loaded.path)
        if self.is_main:
            layout = " (resharded from another layout)" if loaded.resharded else ""
            print(f"resumed from {loaded.path} at step {self.step}{layout}", flush=True)
            if self.job.batch_note:
                print(self.job.batch_note, flush=True)

    def save(self) -> Path:
        """A checkpoint of this step (:meth:`.checkpointer.Checkpointer.save`)."""
        return self.checkpointer.save(self.step)

    # -- data ----------------------------------------------------------------- #

    def _step_batches(self) -> StepBatches:
        """This step's micro-batches and global token count, read ahead by the prefetcher. The
        prefetcher restarts from the sampler if something else moved it (a resume, a benchmark)."""
        position = (self.sampler.epoch, self.sampler.batches_consumed)
        batches = self.prefetcher.next() if self.prefetcher is not None else None
        if batches is None or batches.position != position:
            self._stop_prefetcher()
            pin = self.device.type == "cuda"
            self.prefetcher = BatchPrefetcher(self.train_set, self.sampler, self.grad_accum, pin_memory=pin)
            batches = self.prefetcher.next()
        self.sampler.advance(self.grad_accum)
        return batches

    def _stop_prefetcher(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.close()
            self.prefetcher = None

    def close(self) -> None:
        """Stop the background reader and close the metrics (the one teardown; the trainer can be stepped again)."""
        self.progress.enter("shutdown")
        self._stop_prefetcher()
        self.logger.close()

    # -- the stop vote ----------------------------------------------------------- #

    def _vote_due(self, step: int) -> bool:
        """Whether the ranks vote before ``step`` (1-based): the same answer on every rank (a
        background save is in flight on all or none: saves start and finish collectively)."""
        training, checkpoint = self.cfg.training, self.cfg.checkpoint
        return (
            self.checkpointer.pending is not None
            or step % training.vote_every == 0
            or step >= training.max_steps
            or self.evaluator.due(step)
            or bool(checkpoint.save_every and step % checkpoint.save_every == 0)
        )

    def _vote(self, stop_requested: bool) -> Vote:
        """Whether any rank was asked to stop and, for the background save in flight, whether any
        rank's writer failed and whether every rank's has stopped (one collective over the gloo
        control group). Each rank's ballot is a flag it holds, nothing it waits for, and every rank
        decides from the same sums, so all act at the same step whatever the writers' timing."""
        writer = self.checkpointer.writer_outcome()
        ballot = (stop_requested, writer == "failed", writer in ("written", "failed"))
        vote = torch.tensor(ballot, dtype=torch.float64)  # a host tensor, by construction
        dist.all_reduce(vote, group=self.state.control_group)
        stop, failed, stopped = vote.numpy().tolist()
        return Vote(stop > 0, failed > 0, stopped == self.state.world_size)

    # -- one step ------------------------------------------------------------ #

    def train_step(self, stop_requested: bool = False) -> StepOutcome:
        """One optimizer step. Nothing here reads a device value or copies host data to the device
        blocking: the batches come pinned from the prefetcher with the step's token count, the
        statistics stay on the device (read once per log line), and a collective outside the engine
        (the stop vote, over gloo: host tensors) runs only every ``training.vote_every`` steps, or
        every step while a background save is in flight. Under bf16 the same holds for DeepSpeed's
        ZeRO-1/2 step (tests/training/test_train_syncs.py)."""
        state, engine, rng, progress = self.state, self.engine, self.model.dropout_rng, self.progress
        self.step_lr = self.job.bundle.lr_scheduler.get_last_lr()[0]  # what this step's update uses
        progress.enter("data", self.step + 1)
        batches = self._step_batches()
        progress.enter("stop vote")
        vote = self._vote(stop_requested) if self._vote_due(self.step + 1) else Vote()
        step_tokens = float(batches.global_tokens)
        # DeepSpeed divides each micro-batch loss by grad_accum and averages gradients over the dp_size
        # data-parallel ranks; this weight undoes both and normalises by the step's global count of
        # trained positions instead: the real tokens, or every position with model.predict_length.
        trained = self.global_batch * self.cfg.model.max_length if self.cfg.model.predict_length else step_tokens
        weight_per_token = state.dp_size * self.grad_accum / max(trained, 1.0)
        step_stats = torch.zeros(NUM_STATS, dtype=torch.float64, device=self.device)
        for micro_step, batch in enumerate(batches.micro_batches):
            input_ids, attention_mask, features = to_device(batch, self.device)
            # Masks keyed on (optimizer step, position in the step's global batch): the same masks
            # however the global batch is cut into micro-batches and data-parallel ranks.
            rng.step = self.step
            rng.sample_offset = (micro_step * state.dp_size + state.dp_rank) * self.micro_batch
            progress.enter("forward")
            out = engine(input_ids, attention_mask, features=features)
            progress.enter("backward")
            engine.backward(out.trained_loss_sum * weight_per_token)
            progress.enter("optimizer")
            engine.step()
            # In place on the device: no indexed assignment (it would build a tensor from Python data).
            step_stats[:SAMPLES].add_(output_totals(out))
            step_stats[SAMPLES:].add_(input_ids.shape[0])
        # DeepSpeed's own skip decision, already a Python bool: fp16's loss scaler and the bf16
        # ZeRO-3 / stage-0 optimizers read the norm's finiteness on the host inside engine.step();
        # the bf16 ZeRO-1/2 step has no overflow scan and reads nothing from the device
        # (engine.sync_free_zero_step), so there it is always True.
        applied = bool(engine.was_step_applied())
        progress.finished_step()
        return StepOutcome(step_stats, applied, vote, step_tokens, self.global_batch)

    # -- what the loop does between steps ------------------------------------- #

    def _refuse_nonfinite_bf16(self, window: Window, totals: torch.Tensor | None = None) -> None:
        """Under bf16 a non-finite loss since the last check means the weights are spoiled: stop
        before they are logged as fine or published (collective: the window is reduced over the world)."""
        if self.cfg.training.precision != "bf16" or (totals is None and window.steps == 0):
            return  # (an empty window was checked when it was logged: the same on every rank)
        if totals is None:
            totals = reduce_stats(window.stats, self.device, self.state.tp_size)
        self.nonfinite.check_bf16_loss(float(totals[LOSS_SUM]), window.steps, self.step, self.checkpointer.last_words)

    def _log(self, window: Window) -> dict[str, str]:
        """Write the window's metrics line; return the progress bar's new postfix. The one place per
        log interval where training statistics leave the device."""
        grad_norm = self.engine.get_global_grad_norm()
        totals = reduce_stats(window.stats, self.device, self.state.tp_size)
        self._refuse_nonfinite_bf16(window, totals)
        record = train_record(
            window, totals.tolist(), step=self.step, lr=self.step_lr, grad_norm=grad_norm,
            skipped_steps=self.nonfinite.skipped, flops_per_sample=self.flops_per_sample,
            world_size=self.state.world_size, peak_flops=self.peak_flops,
            memory_bytes=peak_memory_bytes(self.job.device_kind)[0],
        )  # fmt: skip
        self.logger.write(record)
        return progress_postfix(record)

    def _evaluate_and_log(self) -> dict[str, float] | None:
        self.progress.enter("evaluation")
        result = self.evaluator.evaluate(self.step)
        if result is not None:
            self.logger.write({"kind": "eval", "step": self.step, **result})
            self.logger.print(
                f"step {self.step}: held-out loss {result['eval_loss']:.4f}, token accuracy "
                f"{result['eval_token_accuracy']:.4f}, exact match {result['eval_exact_match']:.4f}, "
                f"BLEU {result['eval_bleu']:.2f} ({result['eval_samples']} samples)"
            )
            self.evaluator.write_reconstructions(self.step, self.logger.tensorboard)
        return result

    # -- the loop ------------------------------------------------------------ #

    def run(self, stop: StopRequest) -> TrainResult:
        stop.training = True
        training = self.cfg.training
        window, final_eval, eval_step, stopped_by = self._new_window(), None, -1, "max_steps"
        if self.step >= training.max_steps:
            self.logger.print(
                f"{self.run_dir} is already at step {self.step} (training.max_steps={training.max_steps}): "
                "nothing to train; raise training.max_steps to continue"
            )
            eval_step = self.step  # and no second evaluation of the same weights
        first = self.step + 1
        while self.step < training.max_steps:
            started = time.perf_counter()
            with self._instrumented(self.step + 1):
                outcome = self.train_step(stop.requested)
            self.step += 1
            self.nonfinite.record(outcome.applied)
            log_due = self.step % training.log_every == 0 or self.step == training.max_steps
            if log_due or self.step == first:  # a window ends when the device has done its work
                synchronize(self.device)
            window.add(outcome, time.perf_counter() - started)
            if self.step == first:
                self._log_first_step(time.perf_counter() - started)
            postfix = {}
            if log_due:
                postfix, window = self._log(window), self._new_window()
            self.logger.advance(1, **postfix)
            # The save in flight, as the vote says: a failure on any rank ends the run here on every
            # rank (its one line); one every rank has written is finished, and the votes thin out again.
            self.checkpointer.settle(outcome.vote.save_failed, outcome.vote.save_stopped)
            if self.evaluator.due(self.step):
                final_eval, eval_step = self._evaluate_and_log(), self.step
            self.nonfinite.check_streak(self.step, self.checkpointer.last_words)
            if outcome.stop:
                stopped_by = "signal"
                break
            if self.checkpointer.due(self.step, self.nonfinite.consecutive):
                self._refuse_nonfinite_bf16(window)
                self.save()
        self._stop_prefetcher()
        if stopped_by == "max_steps" and eval_step != self.step and training.eval_every:
            final_eval = self._evaluate_and_log()
        if self.checkpointer.saved_step != self.step and (stopped_by == "signal" or self.cfg.checkpoint.save_final):
            self._refuse_nonfinite_bf16(window)
            self.save()
        self.checkpointer.finish()  # the final save, and a stop by a signal, wait for the save in flight
        return self._finish(stopped_by, final_eval, stop.signal_name)

    @contextmanager
    def _instrumented(self, step: int):
        """The step's host syncs and CUDA kernels, where logging asks for them at this step."""
        logging = self.cfg.logging
        with (
            counting_syncs(step == logging.count_syncs_at_step, self.device, self.logger, step),
            profiling_kernels(step == logging.profile_kernels_at_step, self.device, self.logger, step),
        ):
            yield

    def _log_first_step(self, seconds: float) -> None:
        """The run's first step apart (allocator, kernel selection, compilation), with the time since
        start-up began: what a job pays before its steady steps."""
        since_start = time.perf_counter() - self.job.started
        self.logger.write({"kind": "first_step", "step": self.step, "seconds": seconds, "since_start_s": since_start})

    def _new_window(self) -> Window:
        return Window(torch.zeros(NUM_STATS, dtype=torch.float64, device=self.device))

    def _finish(self, stopped_by: str, final_eval: dict | None, signal_name: str | None) -> TrainResult:
        if stopped_by == "signal":
            self.logger.print(
                f"{stop_cause(signal_name)}: checkpoint {self.checkpointer.last_path} written at step {self.step}"
            )
        samples = self.cfg.logging.print_samples
        examples = self.evaluator.reconstructions(samples, self.step) if stopped_by == "max_steps" and samples else []
        self.logger.close()
        result = TrainResult(
            run_dir=self.run_dir, step=self.step, stopped_by=stopped_by, final_eval=final_eval,
            checkpoint=self.checkpointer.last_path, skipped_steps=self.nonfinite.skipped,
            wall_time_s=time.perf_counter() - self.job.started, reconstructions=examples,
        )  # fmt: skip
        if self.is_main:
            print(summary_text(result), flush=True)
        return result


def train(
    cfg: Config, deepspeed_overrides: dict | None = None, source: str = "<config>", wait_for_lock_s: float = 0.0
) -> TrainResult:
    """Train ``cfg`` on this rank (every rank calls it).  See the module docstring."""
    stop = StopRequest()
    with stop.installed():
        run = start_run(cfg, deepspeed_overrides, source, wait_for_lock_s)
        failure = None
        try:
            trainer = Trainer(run)
            try:
                return trainer.run(stop)
            finally:
                trainer.close()
        except BaseException as error:
            failure = f"{type(error).__name__}: {one_line(error)}"
            raise
        finally:
            run.release(failure)
