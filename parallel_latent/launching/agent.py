"""The torchrun agent of ``train --nproc`` and ``encode-corpus --nproc``: ``python -m
parallel_latent.launching.agent TORCHRUN_ARGS`` (the command :func:`.local.torchrun_command` builds).

It runs torchrun (``torch.distributed.run``) with ``$PARALLEL_LATENT_WORKER_LOGS`` naming the
launch's log directory (:mod:`.worker_logs`): torchrun's own messages go to ``agent.log`` there, and
a failed job ends with the first failing rank's one line and exit status (:mod:`.reports`) instead
of torchrun's ``ChildFailedError`` report.

torch loads inside :func:`run_agent` only.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path

from .reports import error_file_record, failure_lines
from .worker_logs import WORKER_LOGS_ENV, stop_time

__all__ = ["run_agent"]


def _agent_logs_to(path: Path) -> None:
    """torchrun's own messages ("closing signal SIGTERM", its failure report) into ``path``."""
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for name in ("torch.distributed", "torch.distributed.elastic", "torch.distributed.run"):
        torch_logger = logging.getLogger(name)
        torch_logger.handlers[:] = [handler]
        torch_logger.propagate = False


def _root_cause(failed, stopped_at: float | None = None) -> tuple[int, object, dict | None]:
    """(rank, failure, our record) of the rank that failed first.

    Our records carry the exact time. A rank that died without one (a signal, a hard crash) is only
    known to the second in which torchrun saw it dead, so it counts from a second before that: its
    peers' errors ("connection closed by peer") follow it within milliseconds. The SIGTERM with which
    torchrun stops the other ranks is a consequence, never a cause, unless the launcher forwarded a
    stop (``stopped_at``, :func:`.worker_logs.stop_time`): a rank it ended counts from then, before
    what its end made the others say (a rank whose training had begun only notes the stop, and
    meets the dead rank in its next collective), after any failure recorded before the stop."""
    candidates = []
    for rank, failure in failed.failures.items():
        record = error_file_record(failure)
        if record is not None:
            candidates.append((record["time"], rank, failure, record))
        elif failure.exitcode != -signal.SIGTERM:
            candidates.append((failure.timestamp - 1, rank, failure, record))
        elif stopped_at is not None:
            candidates.append((stopped_at, rank, failure, record))
    if not candidates:
        rank, failure = failed.get_first_failure()
        return rank, failure, error_file_record(failure)
    _, rank, failure, record = min(candidates, key=lambda item: (item[0], item[1]))
    return rank, failure, record


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
        lines, status = failure_lines(*_root_cause(failed, stop_time(log_dir)), log_dir)
        print("\n".join(lines), file=sys.stderr, flush=True)
        return status
    except SignalException as stopped:  # the agent itself was signalled: its ranks are gone too
        return 128 + int(stopped.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(run_agent(sys.argv[1:]))
