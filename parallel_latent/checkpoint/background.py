"""Saves that do not stop training: a checkpoint's files written on a thread of every rank from a copy
of the state taken off the training tensors, and published by rank 0 once every rank's files are on
disk.

The training loop only waits for the copy (:func:`.zero_access.snapshot`). The thread of each rank then writes
its files and leaves a marker in the staging directory (``.written/rank_N.ok``, or ``.failed``: no
collective runs on the thread, so it never interleaves with the training's); rank 0's thread waits
for every marker and publishes (``latest`` moves only then) or, if a rank failed, removes the
staging directory. At most one save is in flight: the next save, and the end of training, wait for
it, and there every rank learns its outcome together (a collective of the training thread), so a
save that failed ends the run on every rank with the same line, as a synchronous one does. A
process that dies mid-write leaves an unpublished staging directory, which the next start removes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import layout

__all__ = ["WRITTEN_DIR", "BackgroundSave"]

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
        self._thread = threading.Thread(target=self._run, name=f"checkpoint-writer-{step}", daemon=True)
        self._thread.start()

    def _marker(self, rank: int, outcome: str) -> Path:
        return self.staging / WRITTEN_DIR / f"rank_{rank:05d}.{outcome}"

    def _run(self) -> None:
        for job in self.jobs:
            layout.attempt(self.failures, job)
        outcome = "failed" if self.failures else "ok"
        try:
            self._marker(self.rank, outcome).parent.mkdir(exist_ok=True)
            self._marker(self.rank, outcome).touch()
        except OSError as error:
            self.failures.append(layout.error_reason(error))
        if self.rank == 0:
            self._publish_when_written()

    def _publish_when_written(self) -> None:
        """Rank 0: every rank's marker, then ``finish``; the staging goes if any rank failed."""
        deadline = time.monotonic() + self.timeout_s
        pending = set(range(self.world_size))
        while pending and self.peers is None and not self.failures:
            failed = sorted(rank for rank in pending if self._marker(rank, "failed").exists())
            pending -= {rank for rank in pending if self._marker(rank, "ok").exists()}
            if failed:
                self.peers = f"rank {failed[0]} could not write its files"
            elif pending and time.monotonic() > deadline:
                self.peers = f"ranks {sorted(pending)} did not finish writing within {self.timeout_s:g} s"
            elif pending:
                time.sleep(POLL_S)
        if self.peers is None and not self.failures:
            layout.attempt(self.failures, self._finish)
        if self.peers is not None or self.failures:
            layout.discard(self.staging)

    def _finish(self) -> None:
        layout.discard(self.staging / WRITTEN_DIR)
        self.finish()

    def wait(self) -> tuple[str | None, str | None]:
        """Once the thread is done: this rank's failure, and (rank 0) why another rank's files are
        missing; None for each that did not happen."""
        self._thread.join()
        return (self.failures[0] if self.failures else None), self.peers
