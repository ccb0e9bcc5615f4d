"""Fault injection for checkpoint saves (never imported by the package), run inside a rank's process.

:func:`full_disk_at`: one rank's writes of one save fail as a full disk fails them (an OSError with
ENOSPC), raised where the checkpoint package writes DeepSpeed's files
(``parallel_latent.checkpoint.saving.save_keeping_errno``: a background save's first writes, on its
writer thread), and the other ranks' writes of that save may be held until the test releases them.
:func:`failure_known_at_next_vote`: the ordering a test needs to say at which step a run stops.
Both order threads and processes by events and collectives, never by a clock.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable, Iterator


def staging_name(step: int) -> str:
    return f".tmp-step_{step:08d}"


@contextlib.contextmanager
def full_disk_at(step: int, rank: int, before_write: Callable[[], object] | None = None) -> Iterator[None]:
    """Inside the block, rank ``rank``'s writes of DeepSpeed's files for the checkpoint of ``step``
    raise ENOSPC (the first one fails, and a failed save writes nothing more); each write of that
    save on another rank first calls ``before_write`` (a test's hold, e.g. an Event's ``wait``)."""
    import torch.distributed as dist

    from parallel_latent.checkpoint import saving

    write = saving.save_keeping_errno
    staging = f"/{staging_name(step)}/"

    def on_a_full_disk(state, path: str, zipfile: bool) -> None:
        if staging in str(path):
            if dist.get_rank() == rank:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
            if before_write is not None:
                before_write()
        write(state, path, zipfile)

    saving.save_keeping_errno = on_a_full_disk  # read when a job runs: the writer thread sees it
    try:
        yield
    finally:
        saving.save_keeping_errno = write


@contextlib.contextmanager
def failure_known_at_next_vote(step: int, rank: int) -> Iterator[None]:
    """On rank ``rank``, the trainer's first vote after the save of ``step`` began waits until that
    rank's writer has stopped (here: failed at once). A writer that fails while a vote is under way is
    reported at the vote after it; this makes the failure come before the next one, so the run must
    stop at the step after the save, not a step later by the threads' timing."""
    import torch.distributed as dist

    from parallel_latent.training.checkpointer import Checkpointer

    outcome = Checkpointer.writer_outcome

    def after_the_writer(self) -> str | None:
        pending = self.pending
        saving = pending.save if pending is not None and pending.request.step == step else None
        if saving is not None and dist.get_rank() == rank:
            saving.wait()
        return outcome(self)

    Checkpointer.writer_outcome = after_the_writer
    try:
        yield
    finally:
        Checkpointer.writer_outcome = outcome
