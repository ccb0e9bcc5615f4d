"""Saves that do not stop training: a checkpoint's files written on a thread of every rank from a copy
of the state taken off the training tensors, and published by rank 0 once every rank's files are on
disk.

The training loop only waits for the copy (:func:`snapshot`, into the host buffers of
:class:`HostCopies`, kept from save to save). The thread of each rank then writes its files and
leaves a marker in the staging directory (``.written/rank_N.ok``, or ``.failed``: no collective runs
on the thread, so it never interleaves with the training's); rank 0's thread waits for every marker
and publishes (``latest`` moves only then), or stops at a rank's failure. A thread never removes the
staging directory: another rank's thread may still be writing into it. What a thread has come to
(:meth:`BackgroundSave.outcome`: writing, written, failed) is read by the training loop without
waiting; the trainer's stop vote carries it every step while a save is in flight, so every rank
learns of a failed write at the step after it, all at the same step, and then waits for its thread
(a thread that is still writing or waiting skips the rest: :meth:`BackgroundSave.give_up`), the
ranks agree on the outcome (a collective of the training thread), and rank 0 removes the staging
directory of a failed save once every thread has stopped. A process that dies mid-write leaves an
unpublished staging directory, which the next start removes.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from . import layout

__all__ = ["WRITTEN_DIR", "BackgroundSave", "HostCopies", "snapshot"]

WRITTEN_DIR = ".written"
POLL_S = 0.05


class BackgroundSave:
    """One save of this rank, written on a thread: ``jobs`` run in order (a failed one records its
    reason and the rest are skipped), then this rank's marker; on rank 0 ``finish`` (publishing)
    runs once every one of the ``world_size`` ranks has marked its files written, within
    ``timeout_s``. ``failures``: what failed already (the jobs are then skipped)."""

    def __init__(
        self,
        staging: Path,
        step: int,
        rank: int,
        world_size: int,
        jobs: list[Callable[[], Any]],
        finish: Callable[[], Any],
        timeout_s: float,
        failures: list[str] | None = None,
    ) -> None:
        self.staging, self.step, self.rank, self.world_size = staging, step, rank, world_size
        self.jobs, self.finish, self.timeout_s = jobs, finish, timeout_s
        self.failures: list[str] = list(failures or [])  # this rank's own writes, then rank 0's publishing
        self.peers: str | None = None  # rank 0: why another rank's files are not there
        self._given_up = threading.Event()
        self._done = threading.Event()  # set last: what the thread recorded is final once it is
        self._thread = threading.Thread(target=self._run, name=f"checkpoint-writer-{step}", daemon=True)
        self._thread.start()

    def _marker(self, rank: int, outcome: str) -> Path:
        return self.staging / WRITTEN_DIR / f"rank_{rank:05d}.{outcome}"

    def _run(self) -> None:
        try:
            for job in self.jobs:
                if self._given_up.is_set():
                    return  # the ranks know the save failed: nothing more of it is needed
                layout.attempt(self.failures, job)
            outcome = "failed" if self.failures else "ok"
            try:
                self._marker(self.rank, outcome).parent.mkdir(exist_ok=True)
                self._marker(self.rank, outcome).touch()
            except OSError as error:
                self.failures.append(layout.error_reason(error))
            if self.rank == 0:
                self._publish_when_written()
        finally:
            self._done.set()

    def _publish_when_written(self) -> None:
        """Rank 0: every rank's marker, then ``finish``. The staging directory stays whatever
        happens: another rank may still be writing into it (:func:`.saving.finish_background_save`
        removes it once every rank's thread has stopped)."""
        deadline = time.monotonic() + self.timeout_s
        pending = set(range(self.world_size))
        while pending and self.peers is None and not self.failures and not self._given_up.is_set():
            failed = sorted(rank for rank in pending if self._marker(rank, "failed").exists())
            pending -= {rank for rank in pending if self._marker(rank, "ok").exists()}
            if failed:
                self.peers = f"rank {failed[0]} could not write its files"
            elif pending and time.monotonic() > deadline:
                self.peers = f"ranks {sorted(pending)} did not finish writing within {self.timeout_s:g} s"
            elif pending:
                self._given_up.wait(POLL_S)
        if not pending and self.peers is None and not self.failures and not self._given_up.is_set():
            layout.attempt(self.failures, self._finish)

    def _finish(self) -> None:
        layout.discard(self.staging / WRITTEN_DIR)
        self.finish()

    def outcome(self) -> str:
        """What this rank's thread has come to, known without waiting: ``"writing"`` (it runs),
        ``"failed"`` (this rank's files, or on rank 0 another rank's or the publishing) or
        ``"written"`` (on rank 0: published)."""
        if not self._done.is_set():
            return "writing"
        given_up = self._given_up.is_set()  # what it skipped is not written
        return "failed" if self.failures or self.peers is not None or given_up else "written"

    def give_up(self) -> None:
        """The ranks agreed that this save failed: the thread skips the writes it has not begun and
        stops waiting for markers (one that never comes, when a rank could not even write its
        marker, would hold it for ``timeout_s``); it publishes nothing."""
        self._given_up.set()

    def wait(self) -> tuple[str | None, str | None]:
        """Once the thread is done: this rank's failure, and (rank 0) why another rank's files are
        missing; None for each that did not happen."""
        self._thread.join()
        return (self.failures[0] if self.failures else None), self.peers


class HostCopies:
    """Host memory a background save copies the training state into, kept for the next save. A
    fresh buffer costs a page fault per page on its first touch, most of a copy's time on a CPU
    (a copy into a buffer already touched runs 3-4x faster), and on CUDA a copy into pageable
    memory is slow: so each slot (a place in the checkpoint: a file and a key path) keeps its
    buffer, pinned where the tensor is on a GPU. Within one save, tensors that view the same memory
    the same way (a tied weight under two names, the module's weights in DeepSpeed's file and in the
    portable one) are copied once, into one tensor: torch.save writes it once. One save at a time
    uses them: the trainer waits for a save before it starts the next."""

    def __init__(self):
        self._slots: dict[tuple, torch.Tensor] = {}
        self._taken: dict[tuple, torch.Tensor] = {}

    def begin(self) -> None:
        """A new save: nothing of it copied yet (the buffers stay)."""
        self._taken = {}

    def copy(self, tensor: torch.Tensor, slot: tuple) -> torch.Tensor:
        source = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
                  tensor.stride(), tensor.dtype, tensor.device)  # fmt: skip
        if source in self._taken:
            return self._taken[source]
        buffer = self._slots.get(slot)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            pinned = tensor.is_cuda and torch.cuda.is_available()
            buffer = self._slots[slot] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pinned)
        buffer.copy_(tensor.detach())
        self._taken[source] = buffer
        return buffer


def snapshot(value: Any, copies: HostCopies, slot: tuple = ()) -> Any:
    """A copy of ``value`` that later training steps cannot change: tensors copied to host memory
    (``copies``, each at its ``slot``: the path of keys to it), containers rebuilt, anything else
    deep-copied (DeepSpeed's state dicts hold small Python objects, such as its parameter groups'
    settings, beside the tensors)."""
    if isinstance(value, torch.Tensor):
        return copies.copy(value, slot)
    if isinstance(value, dict):
        copied = copy.copy(value)  # the same kind of mapping (an OrderedDict, a defaultdict and its factory)
        for key, item in value.items():
            copied[key] = snapshot(item, copies, (*slot, key))
        return copied
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        return type(value)(*(snapshot(item, copies, (*slot, i)) for i, item in enumerate(value)))
    if isinstance(value, (list, tuple)):
        return type(value)(snapshot(item, copies, (*slot, i)) for i, item in enumerate(value))
    return copy.deepcopy(value)
