"""The trainer's checkpoints: when one is due, writing it (now, or in the background while training
goes on: ``checkpoint.background``), and which checkpoint is the last complete one.

A background save takes the state off the training tensors (a copy in host memory) and the next
step starts; the files are written on a thread and published once complete
(:mod:`parallel_latent.checkpoint.background`). While it is in flight the trainer's stop vote runs
every step and carries what each rank's writer has come to (:meth:`Checkpointer.writer_outcome`);
from the all-reduced vote every rank decides alike (:meth:`Checkpointer.settle`): a failure on any
rank ends the run at that step on every rank with its one line, as a synchronous save does, and a
save every rank has written is finished there (the per-step vote ends with it). At most one save is
in flight: the next save, the final one and a stop by a signal wait for it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from parallel_latent.checkpoint import (
    checkpoints_dir,
    finish_background_save,
    save_training_checkpoint,
    start_background_save,
)
from parallel_latent.checkpoint.background import HostCopies
from parallel_latent.checkpoint.saving import PendingSave
from parallel_latent.feature_model.tokenizer import OFFLINE

__all__ = ["Checkpointer"]


def saved_tokenizer(run):
    """The tokenizer a checkpoint stores the files of: any but the built-in offline GPT-2 BPE (a
    feature model's own, a path's, a hub id's), so that the checkpoint decodes without them."""
    return None if run.cfg.tokenizer.name_or_path == OFFLINE else run.tokenizer


class Checkpointer:
    """The checkpoints of one run (``run``: a :class:`.startup.Run`). ``state``: what the trainer
    keeps beside the engine's state (its ``state_dict``); ``latent_stats_at(step)``: the latents'
    statistics that a checkpoint of ``step`` records (measured first if need be; collective)."""

    def __init__(self, run: Any, state: Callable[[], dict], latent_stats_at: Callable[[int], Any]):
        self.run, self.cfg = run, run.cfg
        self.state, self.latent_stats_at = state, latent_stats_at
        self.saved_step: int | None = None  # the step of the last save started
        self.last_step: int | None = None  # the last complete checkpoint's step, and its directory
        self.last_path: Path | None = None
        self.pending: PendingSave | None = None
        self.copies = HostCopies()  # the host buffers of background saves, reused by the next

    def resumed(self, step: int, path: Path) -> None:
        self.saved_step, self.last_step, self.last_path = step, step, path

    def due(self, step: int, nonfinite_streak: int) -> bool:
        """A periodic checkpoint of ``step``; none in the middle of a non-finite streak: ``latest``
        keeps naming weights from before it."""
        every = self.cfg.checkpoint.save_every
        return bool(every and step % every == 0 and nonfinite_streak == 0)

    def last_words(self) -> str:
        """What a run that stops with an error says of its checkpoints (every rank asks, together):
        the save in flight finished first, since its state was taken before whatever stops the run."""
        self.finish()
        if self.last_path:
            return f"the last checkpoint, {self.last_path} (step {self.last_step}), is"
        return "no checkpoint had been written yet, nothing is"

    def save(self, step: int) -> Path:
        """A training checkpoint of ``step`` (collective), with the portable weights if
        ``checkpoint.export_portable``; ``latest`` moves only once it is complete. A save that cannot
        be written raises CheckpointSaveError on every rank (a background one: where it is waited
        for), which ends the run with its one line."""
        run, checkpoint = self.run, self.cfg.checkpoint
        run.progress.enter("save")
        self.finish()
        arguments = dict(
            model=run.model, cfg=self.cfg, tokenizer_facts=run.tokenizer_facts, tokenizer=saved_tokenizer(run),
            keep_last=checkpoint.keep_last,
            export_portable=checkpoint.export_portable, tp_group=run.state.tp_group,
            record_keywords={"latent_stats": self.latent_stats_at(step)},
        )  # fmt: skip
        directory, state = checkpoints_dir(run.run_dir), self.state()
        if checkpoint.background:
            timeout_s = self.cfg.training.hang_long_phase_s or 3600.0
            self.pending = start_background_save(
                run.engine, directory, step, state, timeout_s=timeout_s, copies=self.copies, **arguments
            )
            path = self.pending.path
        else:
            path = save_training_checkpoint(run.engine, directory, step, state, **arguments)
            self.last_step, self.last_path = step, path
        self.saved_step = step
        return path

    def writer_outcome(self) -> str | None:
        """What this rank's writer of the save in flight has come to, known without waiting
        (``"writing"``, ``"written"``, ``"failed"``); None when no save is in flight."""
        return self.pending.outcome() if self.pending is not None else None

    def settle(self, any_failed: bool, all_stopped: bool) -> None:
        """After a vote on the save in flight (every rank gets the same answers, so every rank does
        the same here): if any rank's writer failed, the save ends now with its one line on every
        rank; once every rank's writer has stopped, it is finished (and the vote goes back to its
        schedule)."""
        if self.pending is not None and (any_failed or all_stopped):
            self.finish(given_up=any_failed)

    def finish(self, given_up: bool = False) -> None:
        """Wait for the save in flight and agree on it (collective; nothing to do without one).
        ``given_up``: the ranks know already that it failed (the writers skip what they have left)."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            self.run.progress.enter("save")
            self.last_path, self.last_step = finish_background_save(pending, given_up), pending.request.step
