"""Where the ranks of a multi-process run write, so that the terminal shows what they say once.

``parallel-latent train --nproc N`` (and ``encode-corpus --nproc N``) sets
``$PARALLEL_LATENT_WORKER_LOGS`` to a fresh directory of one launch (``RUN/logs/<time>/``): rank 0
keeps the terminal (progress, banner, summary); every other rank writes its stdout and stderr to
``rank<R>.log`` there, so what every rank says alike (notices, library warnings) is shown once.
Afterwards empty files go; after bad input the whole launch's directory goes (the line says it all).

Under another launcher (torchrun, deepspeed, srun) ranks other than 0 keep the package's own
notices to themselves. Deprecation warnings that third-party code raises inside calls the user
cannot change are filtered by message (:data:`UNACTIONABLE_WARNINGS`); nothing else is.

Nothing here imports torch: :func:`redirect_worker_output` runs before the CLI loads.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import time
from pathlib import Path

from .cluster import environment_rank

WORKER_LOGS_ENV = "PARALLEL_LATENT_WORKER_LOGS"
# Left in the launch's log directory by the launcher, holding the time, before it forwards a stop to
# the ranks (as SIGTERM): a terminal's Ctrl-C (ranks it ends during start-up were interrupted by the
# user, not stopped by a cluster), or a SIGTERM it received.
INTERRUPTED_MARKER = "interrupted"
STOPPED_MARKER = "stopped"

# (message regex, category): raised by DeepSpeed's ZeRO collectives on torch >= 2.13, once per call
# site per rank; nothing a user of this package can change.
UNACTIONABLE_WARNINGS = [
    (r"`torch\.distributed\.all_gather_into_tensor` is deprecated", FutureWarning),
    (r"`torch\.distributed\.reduce_scatter_tensor` is deprecated", FutureWarning),
]

__all__ = [
    "INTERRUPTED_MARKER",
    "STOPPED_MARKER",
    "UNACTIONABLE_WARNINGS",
    "WORKER_LOGS_ENV",
    "close_worker_logs",
    "filter_unactionable_warnings",
    "mark_stop",
    "open_worker_logs",
    "quiet_repeated_notices",
    "rank_log",
    "redirect_worker_output",
    "stop_cause",
    "stop_time",
]


def rank_log(log_dir: str | Path, rank: int) -> Path:
    """The file a rank other than 0 writes to (and every rank's traceback goes to)."""
    return Path(log_dir) / f"rank{rank}.log"


def mark_stop(log_dir: Path, interrupted: bool) -> None:
    """Before the launcher forwards a stop to the ranks: which stop, and when (see the markers)."""
    with contextlib.suppress(OSError):
        (log_dir / (INTERRUPTED_MARKER if interrupted else STOPPED_MARKER)).write_text(f"{time.time()!r}\n")


def stop_time(log_dir: Path) -> float | None:
    """When the launcher forwarded a stop to the ranks (:func:`mark_stop`), or None if it did not."""
    for marker in (INTERRUPTED_MARKER, STOPPED_MARKER):
        with contextlib.suppress(OSError, ValueError):
            return float((log_dir / marker).read_text())
    return None


# --------------------------------------------------------------------------- #
# In every rank.
# --------------------------------------------------------------------------- #


def stop_cause(signal_name: str | None) -> str:
    """What stopped training, in the words of the line that reports it. A rank of ``train --nproc``
    hears every stop as the SIGTERM its launcher forwards; the launcher's marker says whether that
    was a terminal's Ctrl-C. ``signal_name``: what this rank received (None: another rank did)."""
    log_dir = os.environ.get(WORKER_LOGS_ENV)
    if signal_name == "SIGINT" or (log_dir and (Path(log_dir) / INTERRUPTED_MARKER).exists()):
        return "interrupted (Ctrl-C)"
    return f"stopped by {signal_name}" if signal_name else "stopped by a signal to another rank"


def redirect_worker_output() -> None:
    """A rank other than 0 started by ``train --nproc``: its stdout and stderr (file descriptors 1
    and 2, so native libraries' output too) go to its log file from here on."""
    log_dir = os.environ.get(WORKER_LOGS_ENV)
    if not log_dir or environment_rank() == 0 or "RANK" not in os.environ:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    descriptor = os.open(rank_log(log_dir, environment_rank()), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
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
    if environment_rank() != 0 and not os.environ.get(WORKER_LOGS_ENV):
        logging.getLogger("parallel_latent").setLevel(logging.ERROR)


# --------------------------------------------------------------------------- #
# In the launcher of ``--nproc``: one directory per launch.
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
