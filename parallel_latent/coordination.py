"""Host-side coordination between the ranks of a job: who does a piece of work first, whether a
directory is one file system for all ranks, agreeing on a value: rank 0 decides and every rank gets
its answer or its one-line error (:func:`decided_by_main`), or every rank checks and all raise the
first failure (:func:`checked_by_all`, :func:`first_failure`), or a rank's failure, whatever it is, ends
every rank with that rank's line (:func:`fail_together`).

Everything here runs over the control group of :mod:`parallel_latent.parallel.state` (gloo, CPU
tensors), so it never waits on a GPU stream and tolerates long waits (a corpus being tokenized by
one rank while the others wait). Without a process group every function is the one-process
answer, so the same code runs in a single process with no launcher.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from parallel_latent.errors import BadInput, PeerFailure, failure_reason
from parallel_latent.parallel import state

__all__ = [
    "all_gather_value",
    "all_ranks_agree",
    "barrier",
    "broadcast_value",
    "checked_by_all",
    "control_group",
    "decided_by_main",
    "directory_is_shared",
    "fail_together",
    "first_failure",
    "is_local_main",
    "is_main",
    "main_first",
]


def _active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def control_group():
    return state.get_parallel_state().control_group if state.is_initialized() else None


def is_main() -> bool:
    return not _active() or dist.get_rank() == 0


def is_local_main() -> bool:
    """Local rank 0: the first process of its node."""
    return not _active() or int(os.environ.get("LOCAL_RANK", "0")) == 0


def barrier() -> None:
    if _active():
        dist.barrier(group=control_group())


def broadcast_value(value: Any, src: int = 0) -> Any:
    """``value`` as global rank ``src`` has it (any picklable object), on every rank."""
    if not _active():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=src, group=control_group())
    return box[0]


def all_gather_value(value: Any) -> list[Any]:
    """Every rank's ``value`` (any picklable object), indexed by global rank, on every rank."""
    if not _active():
        return [value]
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value, group=control_group())
    return values


def all_ranks_agree(flag: bool) -> bool:
    """True on every rank iff ``flag`` is true on every rank."""
    if not _active():
        return flag
    vote = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(vote, op=dist.ReduceOp.MIN, group=control_group())
    return bool(vote.item())


def first_failure(message: str | None) -> str | None:
    """The first (by rank) of every rank's ``message``, on every rank; None if no rank has one."""
    return next((m for m in all_gather_value(message) if m), None)


def fail_together(error: BaseException | None, expected: type[Exception]) -> None:
    """Every rank learns whether any rank failed (collective; ``error``: this rank's, or None), and
    none goes on alone. A rank raises its own error; the others raise the first failing rank's (by
    rank): as ``expected`` when it was one (a line every rank says alike), else as
    :class:`PeerFailure` naming that rank, so the job's line is that rank's whichever rank's report
    a launcher reads first."""
    report = None
    if error is not None:
        is_expected = isinstance(error, expected)
        report = (is_expected, str(error) if is_expected else failure_reason(error))
    reports = all_gather_value(report)
    if error is not None:
        raise error
    failed = next((rank for rank, report in enumerate(reports) if report is not None), None)
    if failed is not None:
        was_expected, words = reports[failed]
        raise expected(words) if was_expected else PeerFailure(failed, words)


def decided_by_main(function, *args, errors: type | tuple[type, ...] = BadInput) -> Any:
    """``function(*args)`` run on global rank 0 alone; its value on every rank, or the one-line
    error of one of ``errors`` it raised there, raised on every rank alike."""
    value = error = None
    if is_main():
        try:
            value = function(*args)
        except errors as caught:
            error = (type(caught), str(caught))
    value, error = broadcast_value((value, error))
    if error is not None:
        raise error[0](error[1])
    return value


def checked_by_all(function, *args, errors: type | tuple[type, ...] = BadInput) -> Any:
    """``function(*args)`` run on every rank; its value, unless one of ``errors`` was raised on some
    rank: then every rank raises the first such error (by rank), so none goes on alone."""
    try:
        value, error = function(*args), None
    except errors as caught:
        value, error = None, (type(caught), str(caught))
    first = next((e for e in all_gather_value(error) if e is not None), None)
    if first is not None:
        raise first[0](first[1])
    return value


@contextlib.contextmanager
def main_first(per_node: bool = True) -> Iterator[bool]:
    """Run the block on the main process(es) first, then on the others (collective).

    ``per_node``: local rank 0 of every node goes first (node-local caches such as the Hugging
    Face hub cache on a local disk); otherwise global rank 0 alone (one shared file system). The
    block learns whether it runs first. Typical use: the first process downloads, the others then
    find the files in the cache.
    """
    first = is_local_main() if per_node else is_main()
    if not first:
        barrier()
    try:
        yield first
    finally:
        if first:
            barrier()


def directory_is_shared(directory: str | Path) -> bool:
    """Whether every rank sees the same ``directory`` (collective; it must exist on rank 0).

    Rank 0 writes a fresh random token into a file there; after a barrier every rank reads it
    back; the answer is agreed by all ranks. Two nodes with node-local disks (or two working
    directories with a relative path) do not see each other's file.
    """
    directory = Path(directory)
    if not _active():
        return True
    token = broadcast_value(secrets.token_hex(16) if is_main() else None)
    probe = directory / f".shared-check-{token}"
    if is_main():
        probe.write_text(token)
    barrier()
    try:
        seen = probe.read_text() == token
    except OSError:
        seen = False
    shared = all_ranks_agree(seen)
    barrier()  # everyone has looked before the file goes
    if is_main():
        probe.unlink(missing_ok=True)
    return shared
