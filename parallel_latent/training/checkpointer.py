"""The trainer's checkpoints: when one is due, writing it (now, or in the background while training
goes on: ``checkpoint.background``), and which checkpoint is the last complete one.

A background save takes the state off the training tensors (a copy in host memory) and the next
step starts; the files are written on a thread and published once complete
(:mod:`parallel_latent.checkpoint.background`). At most one save is in flight: the next save, the
final one and a stop by a signal wait for it, and there every rank learns whether it was written
(a save that was not ends the run on every rank with its one line, as a synchronous one does).
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

__all__ = ["Checkpointer"]


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
            model=run.model, cfg=self.cfg, tokenizer_facts=run.tokenizer_facts, keep_last=checkpoint.keep_last,
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

    def finish(self) -> None:
        """Wait for the save in flight and agree on it (collective; nothing to do without one)."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            self.run.progress.enter("save")
            self.last_path, self.last_step = finish_background_save(pending), pending.request.step
