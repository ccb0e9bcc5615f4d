"""One line per problem: what the terminal shows when training runs as several processes.

``parallel-latent train --nproc N`` runs the torchrun agent through :func:`run_agent` (``python -m
parallel_latent.console``) with ``$PARALLEL_LATENT_WORKER_LOGS`` naming a fresh directory in the run
directory (``RUN/logs/<time>/``):

- rank 0 keeps the terminal (progress, banner, summary); every other rank writes its stdout and
  stderr to ``rank<R>.log`` there, so what every rank says alike (notices, library warnings) is
  shown once;
- a failing rank writes torchrun's error file (``$TORCHELASTIC_ERROR_FILE``) with its one-line
  reason, and its traceback, if the failure was unexpected, to ``rank<R>.log``; the agent, once every
  rank has stopped, prints the first failing rank's line last (after the log's path when there is a
  traceback) and exits with that rank's status (2 bad input, 3 non-finite, 4 a failed save, 5 a
  stalled rank found by the hang watchdog, 1 anything else) instead
  of torchrun's ``ChildFailedError`` report. torchrun's own messages go to ``agent.log``;
- afterwards empty files go; after bad input the whole launch's directory goes (the line says it all).

Under another launcher (torchrun, deepspeed, srun) the launcher's behaviour stays, and every failing
rank writes the error file whose reason torchrun's report shows as the root cause. An unexpected
failure is printed by each rank it hits, its traceback then ``rank R: <reason>`` as its last line;
bad input and non-finite steps, which every rank meets alike, are printed once, by rank 0. Ranks
other than 0 keep the package's own notices to themselves.

Deprecation warnings that third-party code raises inside calls the user cannot change are filtered
by message (:data:`UNACTIONABLE_WARNINGS`); nothing else is.

Nothing here imports torch at module level: :func:`redirect_worker_output` runs before the CLI loads.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import sys
import time
import traceback
from pathlib import Path

from parallel_latent.errors import PROG, ExitStatus, PeerFailure, error_line, failure_reason, one_line

WORKER_LOGS_ENV = "PARALLEL_LATENT_WORKER_LOGS"
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
RECORD_KEY = "parallel_latent"  # our entry in torchrun's error file, beside its "message"

# (message regex, category): raised by DeepSpeed's ZeRO collectives on torch >= 2.13, once per call
# site per rank; nothing a user of this package can change.
UNACTIONABLE_WARNINGS = [
    (r"`torch\.distributed\.all_gather_into_tensor` is deprecated", FutureWarning),
    (r"`torch\.distributed\.reduce_scatter_tensor` is deprecated", FutureWarning),
]

__all__ = [
    "UNACTIONABLE_WARNINGS",
    "WORKER_LOGS_ENV",
    "close_worker_logs",
    "filter_unactionable_warnings",
    "open_worker_logs",
    "quiet_repeated_notices",
    "redirect_worker_output",
    "report_failure",
    "report_hang",
    "restart_line",
    "run_agent",
]


def _rank() -> int:
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))


def _rank_log(log_dir: str | Path, rank: int) -> Path:
    return Path(log_dir) / f"rank{rank}.log"


# --------------------------------------------------------------------------- #
# In every rank.
# --------------------------------------------------------------------------- #


def redirect_worker_output() -> None:
    """A rank other than 0 started by ``train --nproc``: its stdout and stderr (file descriptors 1
    and 2, so native libraries' output too) go to its log file from here on."""
    log_dir = os.environ.get(WORKER_LOGS_ENV)
    if not log_dir or _rank() == 0 or "RANK" not in os.environ:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    descriptor = os.open(_rank_log(log_dir, _rank()), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(descriptor, 1)
    os.dup2(descriptor, 2)
    os.close(descriptor)


def filter_unactionable_warnings() -> None:
    import warnings

    for message, category in UNACTIONABLE_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)


def quiet_repeated_notices() -> None:
    """Under a launcher, the package's notices (warnings every rank logs alike, such as "``latest``
    names an incomplete checkpoint") are said by rank 0 only; ranks started by ``train --nproc``
    keep them in their log files instead."""
    filter_unactionable_warnings()
    if _rank() != 0 and not os.environ.get(WORKER_LOGS_ENV):
        logging.getLogger("parallel_latent").setLevel(logging.ERROR)


def _write_error_file(reason: str, details: str, exit_code: int, origin: int | None = None) -> None:
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
    rank, world = _rank(), int(os.environ.get("WORLD_SIZE", "1"))
    origin = error.rank if isinstance(error, PeerFailure) else None
    if origin is not None:
        reason = error.reason
    elif exit_code == ExitStatus.FAILURE:
        reason = failure_reason(error)
    else:
        reason = one_line(error)
    details = traceback.format_exc() if exit_code == ExitStatus.FAILURE else reason
    _write_error_file(reason, details, exit_code, origin)
    log_dir = os.environ.get(WORKER_LOGS_ENV)
    if log_dir and "RANK" in os.environ:  # started by train --nproc: the agent says it, once
        if exit_code == ExitStatus.FAILURE:
            with open(_rank_log(log_dir, rank), "a", encoding="utf-8") as log:
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


def report_hang(line: str, detected_here: bool) -> None:
    """Say that the hang watchdog ends this rank (from its thread, before ``os._exit``): the error
    file for the launcher on every rank; on the terminal, the rank that found the stall says it (the
    stalled rank may be rank 0), unless the agent of ``train --nproc`` says it once for all."""
    _write_error_file(line, line, ExitStatus.HANG)
    under_agent = os.environ.get(WORKER_LOGS_ENV) and "RANK" in os.environ
    if detected_here and not under_agent:
        print(error_line(line), file=sys.stderr, flush=True)
    sys.stdout.flush()


# --------------------------------------------------------------------------- #
# The local torchrun agent of ``train --nproc``, and its log directory.
# --------------------------------------------------------------------------- #


def open_worker_logs(run_dir: Path) -> tuple[Path, bool]:
    """A new ``RUN_DIR/logs/<time>/`` for one launch, and whether the run directory existed before."""
    existed = run_dir.exists()
    log_dir = run_dir / "logs" / time.strftime("%Y%m%d-%H%M%S")
    log_dir.mkdir(parents=True, exist_ok=True)
    return log_dir, existed


def close_worker_logs(log_dir: Path, run_dir_existed: bool, status: int, bad_input: int) -> None:
    """Keep what the ranks said (empty files and directories go). After bad input, whose one line
    says it all, nothing stays: neither the logs nor a run directory made only for them."""
    if status == bad_input:
        shutil.rmtree(log_dir, ignore_errors=True)
    else:
        for path in sorted(log_dir.rglob("*"), key=lambda p: len(p.parts), reverse=True):  # deepest first
            with contextlib.suppress(OSError):
                if path.is_dir():
                    path.rmdir()  # only if empty
                elif path.stat().st_size == 0:
                    path.unlink()
    run_dir = log_dir.parent.parent
    for directory in (log_dir, log_dir.parent, *(() if run_dir_existed else (run_dir,))):
        with contextlib.suppress(OSError):
            directory.rmdir()  # only if empty


def _agent_logs_to(path: Path) -> None:
    """torchrun's own messages ("closing signal SIGTERM", its failure report) into ``path``."""
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for name in ("torch.distributed", "torch.distributed.elastic", "torch.distributed.run"):
        torch_logger = logging.getLogger(name)
        torch_logger.handlers[:] = [handler]
        torch_logger.propagate = False


def _record(failure) -> dict | None:
    data = failure.error_file_data
    return data.get(RECORD_KEY) if isinstance(data, dict) and isinstance(data.get(RECORD_KEY), dict) else None


def _root_cause(failed) -> tuple[int, object, dict | None]:
    """(rank, failure, our record) of the rank that failed first.

    Our records carry the exact time. A rank that died without one (a signal, a hard crash) is only
    known to the second in which torchrun saw it dead, so it counts from a second before that: its
    peers' errors ("connection closed by peer") follow it within milliseconds. The SIGTERM with which
    torchrun stops the other ranks is a consequence, never a cause."""
    candidates = [
        (record["time"] if record else failure.timestamp - 1, rank, failure, record)
        for rank, failure in failed.failures.items()
        if (record := _record(failure)) is not None or failure.exitcode != -signal.SIGTERM
    ]
    if not candidates:
        rank, failure = failed.get_first_failure()
        return rank, failure, _record(failure)
    _, rank, failure, record = min(candidates, key=lambda item: (item[0], item[1]))
    return rank, failure, record


def failure_lines(rank: int, failure, record: dict | None, log_dir: Path) -> tuple[list[str], int]:
    """What the terminal shows for the root failure (the reason last), and the exit status."""
    if record is not None:
        exit_code = int(record["exit_code"])
        rank = int(record.get("rank", rank))  # a rank that stopped for another's failure names that one
        lines = [error_line(_with_rank(record["reason"], rank, exit_code))]
        if exit_code == ExitStatus.FAILURE:
            lines.insert(0, f"{PROG}: traceback of rank {rank}: {_rank_log(log_dir, rank)}")
        return lines, exit_code
    if failure.exitcode == -signal.SIGTERM:  # every rank's: the job was stopped from outside (a Ctrl-C
        # forwarded by `train --nproc`, the cluster) during start-up, when a signal has its usual effect
        line = error_line("stopped by SIGTERM during start-up, before the first step (nothing to save)")
        return [line], 128 + signal.SIGTERM
    if failure.exitcode == -signal.SIGKILL:
        how = "was killed by SIGKILL (out of memory?)"
    elif failure.exitcode < 0:
        how = f"was killed by {failure.signal_name()}"
    else:
        how = f"exited with status {failure.exitcode} without saying why"
    log = _rank_log(log_dir, rank)
    if rank != 0 and log.is_file() and log.stat().st_size:
        how += f"; its output: {log}"
    return [error_line(f"rank {rank} {how}")], ExitStatus.FAILURE


def run_agent(torchrun_args: list[str]) -> int:
    """torchrun (``torch.distributed.run``) with ``torchrun_args``; a failed job ends with the first
    failing rank's one line and exit status instead of torchrun's report."""
    log_dir = Path(os.environ[WORKER_LOGS_ENV])
    _agent_logs_to(log_dir / "agent.log")
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        run(parse_args(["--log-dir", str(log_dir / "torchrun"), *torchrun_args]))
    except ChildFailedError as failed:
        lines, status = failure_lines(*_root_cause(failed), log_dir)
        print("\n".join(lines), file=sys.stderr, flush=True)
        return status
    except SignalException as stopped:  # the agent itself was signalled: its ranks are gone too
        return 128 + int(stopped.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(run_agent(sys.argv[1:]))
