"""One line per problem: how a rank says why it stops, and what the terminal shows for a job.

- a failing rank writes torchrun's error file (``$TORCHELASTIC_ERROR_FILE``) with its one-line
  reason and our record (:data:`RECORD_KEY`: the reason, the exit status, the exact time), and its
  traceback, if the failure was unexpected, to its ``rank<R>.log`` (:mod:`.worker_logs`);
- the agent of ``train --nproc`` (:mod:`.agent`), once every rank has stopped, prints the first
  failing rank's line (:func:`failure_lines`) last (after the log's path when there is a traceback)
  and exits with that rank's status (2 bad input, 3 non-finite, 4 a failed save, 5 a stalled rank
  found by the hang watchdog, 1 anything else) instead of torchrun's ``ChildFailedError`` report;
- a restarted job says first which restart it is and how the attempt before it ended
  (:func:`restart_line`); the hang watchdog (:mod:`parallel_latent.training.watchdog`) says why it
  ends a rank through the same error file (:func:`write_error_file`).

Under another launcher (torchrun, deepspeed, srun) the launcher's behaviour stays, and every failing
rank writes the error file whose reason torchrun's report shows as the root cause. An unexpected
failure is printed by each rank it hits, its traceback then ``rank R: <reason>`` as its last line;
bad input and non-finite steps, which every rank meets alike, are printed once, by rank 0.

Torch-free.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

from parallel_latent.errors import PROG, ExitStatus, PeerFailure, error_line, failure_reason, one_line

from .cluster import environment_rank
from .worker_logs import INTERRUPTED_MARKER, WORKER_LOGS_ENV, rank_log

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
RECORD_KEY = "parallel_latent"  # our entry in torchrun's error file, beside its "message"

__all__ = [
    "ERROR_FILE_ENV",
    "RECORD_KEY",
    "error_file_record",
    "failure_lines",
    "report_failure",
    "restart_line",
    "write_error_file",
]


# --------------------------------------------------------------------------- #
# In every rank.
# --------------------------------------------------------------------------- #


def write_error_file(reason: str, details: str, exit_code: int, origin: int | None = None) -> None:
    """torchrun's error file (the format of ``ErrorHandler.record_exception``, which its
    ``ChildFailedError`` report shows) plus our record: the reason, the exit status, the exact time,
    and the rank the failure comes from when that is another rank (:class:`PeerFailure`)."""
    path = os.environ.get(ERROR_FILE_ENV)
    if not path:
        return
    now = time.time()
    record = {"reason": reason, "exit_code": exit_code, "time": now}
    if origin is not None:
        record["rank"] = origin
    data = {
        "message": {"message": reason, "extraInfo": {"py_callstack": details, "timestamp": str(int(now))}},
        RECORD_KEY: record,
    }
    with contextlib.suppress(OSError):  # the line on stderr (or the agent's fallback) still says it
        Path(path).write_text(json.dumps(data), encoding="utf-8")


def _with_rank(reason: str, rank: int, exit_code: int) -> str:
    """An unexpected failure is about one rank: say which. Bad input and non-finite steps are met by
    every rank alike: the reason alone."""
    return f"rank {rank}: {reason}" if exit_code == ExitStatus.FAILURE else reason


def report_failure(error: BaseException, exit_code: int) -> int:
    """Say why this rank stops, in one line (call inside the ``except`` block); returns ``exit_code``.

    ``exit_code`` 2 (bad input) and 3 (non-finite steps) are failures every rank meets alike, whose
    message is the whole story; anything else (1) is unexpected, and its traceback is kept."""
    rank, world = environment_rank(), int(os.environ.get("WORLD_SIZE", "1"))
    origin = error.rank if isinstance(error, PeerFailure) else None
    if origin is not None:
        reason = error.reason
    elif exit_code == ExitStatus.FAILURE:
        reason = failure_reason(error)
    else:
        reason = one_line(error)
    details = traceback.format_exc() if exit_code == ExitStatus.FAILURE else reason
    write_error_file(reason, details, exit_code, origin)
    log_dir = os.environ.get(WORKER_LOGS_ENV)
    if log_dir and "RANK" in os.environ:  # started by train --nproc: the agent says it, once
        if exit_code == ExitStatus.FAILURE:
            with open(rank_log(log_dir, rank), "a", encoding="utf-8") as log:
                log.write(details)
        return exit_code
    if exit_code != ExitStatus.FAILURE:  # met by every rank alike: rank 0 says it (the error file has it too)
        if rank == 0:
            print(error_line(reason), file=sys.stderr, flush=True)
        return exit_code
    sys.stderr.write(details)  # what Python would have printed, then the one line, naming the rank
    named = rank if origin is None else origin
    print(error_line(f"rank {named}: {reason}" if world > 1 else reason), file=sys.stderr, flush=True)
    return exit_code


def restart_line(before: str | None, resume_step: int | None, env=None) -> str | None:
    """The line a restarted job says first (rank 0): which restart this is (torchrun's count of its
    own, or SLURM's requeues), how the attempt before it ended (``before``, from its ranks' progress
    records), and the step it resumes from; None when the job is not a restart."""
    env = os.environ if env is None else env
    restarts, allowed = int(env.get("TORCHELASTIC_RESTART_COUNT") or 0), env.get("TORCHELASTIC_MAX_RESTARTS")
    requeues = int(env.get("SLURM_RESTART_COUNT") or 0)
    if restarts:
        head = f"restart {restarts} of {allowed} (attempt {restarts + 1})"
    elif requeues:
        head = f"requeued job, start {requeues + 1} (SLURM_RESTART_COUNT={requeues})"
    else:
        return None
    what = before or "the attempt before left no record of how it ended"
    where = f"resuming from step {resume_step}" if resume_step is not None else "no checkpoint yet: starting afresh"
    return f"{head}: {what}; {where}"


# --------------------------------------------------------------------------- #
# In the agent of ``train --nproc``, once every rank has stopped.
# --------------------------------------------------------------------------- #


def error_file_record(failure) -> dict | None:
    """Our record in the error file of a failed rank (torchrun's ``ProcessFailure``), if it wrote one."""
    data = failure.error_file_data
    return data.get(RECORD_KEY) if isinstance(data, dict) and isinstance(data.get(RECORD_KEY), dict) else None


def failure_lines(rank: int, failure, record: dict | None, log_dir: Path) -> tuple[list[str], int]:
    """What the terminal shows for the root failure (the reason last), and the exit status."""
    if record is not None:
        exit_code = int(record["exit_code"])
        rank = int(record.get("rank", rank))  # a rank that stopped for another's failure names that one
        lines = [error_line(_with_rank(record["reason"], rank, exit_code))]
        if exit_code == ExitStatus.FAILURE:
            lines.insert(0, f"{PROG}: traceback of rank {rank}: {rank_log(log_dir, rank)}")
        return lines, exit_code
    if failure.exitcode == -signal.SIGTERM:  # every rank's: the job was stopped from outside (a Ctrl-C
        # forwarded by `train --nproc`, the cluster) during start-up, when a signal has its usual effect
        if (log_dir / INTERRUPTED_MARKER).exists():  # the terminal's Ctrl-C: as Ctrl-C ends any command
            return [error_line("interrupted")], ExitStatus.INTERRUPTED
        line = error_line("stopped by SIGTERM during start-up, before the first step (nothing to save)")
        return [line], 128 + signal.SIGTERM
    if failure.exitcode == -signal.SIGKILL:
        how = "was killed by SIGKILL (out of memory?)"
    elif failure.exitcode < 0:
        how = f"was killed by {failure.signal_name()}"
    else:
        how = f"exited with status {failure.exitcode} without saying why"
    log = rank_log(log_dir, rank)
    if rank != 0 and log.is_file() and log.stat().st_size:
        how += f"; its output: {log}"
    # A rank killed by a signal ends the job as the shell ends a command killed by it: 128 + its number.
    status = 128 - failure.exitcode if failure.exitcode < 0 else ExitStatus.FAILURE
    return [error_line(f"rank {rank} {how}")], status
