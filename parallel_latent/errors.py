"""The project's error vocabulary, and the checks of path arguments every subcommand shares.

Torch-free, so that the command line can build its parser and report errors without loading torch.

- :data:`PROG` and :class:`ExitStatus`: what the command is called and how it ends;
- :class:`BadInput`: the base of every error that means "the input is wrong" (a config key, a
  path, a corrupt checkpoint, an empty corpus): one line naming the problem, exit status 2, and
  nothing written. An error class that ends a run otherwise names its status in ``exit_status``;
- :class:`CheckpointError`: a checkpoint that is missing, damaged or does not fit, raised by the
  checkpoint package and by the code below it that reads DeepSpeed's files and state
  (:mod:`parallel_latent.zero`);
- :func:`first_line`, :func:`os_reason`, :func:`one_line`: the one line an error is reported as;
- :func:`in_release_range`, :func:`release_range_words`: a dependency's supported releases, for
  the one line that refuses another;

A path that names the wrong kind of thing (a file where a directory is expected, a directory where
a file is expected, something missing or unreadable) is bad input.
"""

from __future__ import annotations

import enum
import errno
import os
import re
from pathlib import Path

PROG = "parallel-latent"


class ExitStatus(enum.IntEnum):
    OK = 0  # done, or stopped cleanly by SIGTERM/SIGINT with a checkpoint
    FAILURE = 1  # unexpected: the traceback is kept
    BAD_INPUT = 2  # met by every rank alike, before anything is written
    NONFINITE = 3  # stopped after too many consecutive non-finite steps
    SAVE_FAILED = 4  # a checkpoint (or another output) could not be written mid-way; the last complete one is intact
    HANG = 5  # a rank stalled: the hang watchdog ended the job (parallel_latent.training.watchdog)
    INTERRUPTED = 130  # Ctrl-C of a command that does not checkpoint (the shell's 128 + SIGINT)


class BadInput(ValueError):
    """Input that cannot work (one line, exit status 2). A ``ValueError``, so that code which
    catches the standard exception for a bad value catches these too."""

    exit_status = ExitStatus.BAD_INPUT


class CheckpointError(BadInput):
    """A checkpoint is missing, damaged, or does not fit the model; the message is one line."""


class DataError(BadInput):
    """A data problem (torch-free: the command line and every data module raise it); the message is
    one line naming the offending path."""


# OSErrors that say something about the path a user gave, not about the machine.
PATH_ERRORS = (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError, FileExistsError)
# A destination on a read-only mount (PermissionError is one of PATH_ERRORS): the path a user gave is wrong.
UNWRITABLE_ERRNOS = frozenset({errno.EROFS})
# A write that started and could not finish (the disk filled, the quota, the device): status 4.
WRITE_FAILED_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO})


class PeerFailure(RuntimeError):
    """This rank stops because rank ``rank`` failed unexpectedly, for ``reason``: the job's one line
    names that rank and its reason whichever rank's report the launcher reads first."""

    def __init__(self, rank: int, reason: str):
        super().__init__(f"rank {rank} failed: {reason}")
        self.rank, self.reason = rank, reason


class UsageError(BadInput):
    """A command-line problem found after parsing (one line)."""


Release = tuple[int, int, int]


def in_release_range(version: str, supported: tuple[Release, Release]) -> bool:
    """Whether ``version`` (``"0.19.8"``, ``"5.25.1.dev0"``, ``"0.19.9+cu130"``) lies in
    ``supported`` = [first, end): the releases a dependency's internals were used as. Its refusal
    outside is one line of bad input (DeepSpeed's in ``zero/version.py``, transformers' in
    ``feature_model/transformers_api.py``)."""
    numbers = [int(part) for part in re.findall(r"\d+", version.split("+")[0])[:3]]
    release = tuple(numbers + [0] * (3 - len(numbers)))
    return supported[0] <= release < supported[1]


def release_range_words(supported: tuple[Release, Release]) -> str:
    """``supported`` as a pip requirement's range: ``>=0.19.8,<0.20``."""
    (a, b, c), (d, e, _) = supported
    return f">={a}.{b}.{c},<{d}.{e}"


def first_line(error: BaseException) -> str:
    """The first line of an error's message, or its type's name when it has none."""
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def os_reason(error: OSError) -> str:
    """Why the operating system refused (``No space left on device``), or the error's type's name."""
    return error.strerror or type(error).__name__


def describe_path_error(error: OSError) -> str:
    """``<path>: <reason>`` for an OSError about a path (one line)."""
    where = error.filename if error.filename is not None else ""
    return f"{where}: {os_reason(error)}" if where else os_reason(error)


def one_line(error: BaseException) -> str:
    """The line an error is reported as: an OSError about a path names the path and the reason."""
    if isinstance(error, OSError) and (error.filename is not None or error.strerror):
        return describe_path_error(error)
    return first_line(error)


def failure_reason(error: BaseException) -> str:
    """The line of an unexpected failure: the error's type and its one line."""
    return f"{type(error).__name__}: {one_line(error)}"


def error_line(message: str) -> str:
    return f"{PROG}: error: {message}"


def exit_status(error: BaseException) -> ExitStatus:
    """How a command ends on ``error``: the status its class names (``exit_status``), bad input for
    any other ``ValueError`` or an OSError about a path of the wrong kind, else a failure."""
    named = getattr(type(error), "exit_status", None)
    if isinstance(named, ExitStatus):
        return named
    if isinstance(error, (ValueError, *PATH_ERRORS)):
        return ExitStatus.BAD_INPUT
    if isinstance(error, OSError) and error.errno in UNWRITABLE_ERRNOS:
        return ExitStatus.BAD_INPUT
    if isinstance(error, OSError) and error.errno in WRITE_FAILED_ERRNOS:
        return ExitStatus.SAVE_FAILED
    return ExitStatus.FAILURE


def require_writable(path: str | Path, what: str = "output") -> Path:
    """``path`` (missing, or a directory) can be written: its nearest existing ancestor is a
    directory this process may create files in, on a file system mounted read-write. Reads only."""
    path = Path(path)
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing is None or not existing.is_dir():
        return path  # a file in the way is the callers' own one line
    if os.statvfs(existing).f_flag & os.ST_RDONLY:
        raise UsageError(f"{path}: {what} cannot be written: {existing} is on a read-only file system")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"{path}: {what} cannot be written: no permission to write in {existing}")
    return path


def require_file(path: str | Path, what: str = "file") -> Path:
    """An existing, readable regular file."""
    path = Path(path)
    if not path.exists():
        raise UsageError(f"{path}: {what} does not exist")
    if path.is_dir():
        raise UsageError(f"{path}: {what} is a directory, expected a file")
    if not os.access(path, os.R_OK):
        raise UsageError(f"{path}: {what} is not readable")
    return path


def require_dir(path: str | Path, what: str = "directory") -> Path:
    """An existing, readable directory."""
    path = Path(path)
    if not path.exists():
        raise UsageError(f"{path}: {what} does not exist")
    if not path.is_dir():
        raise UsageError(f"{path}: {what} is a file, expected a directory")
    if not os.access(path, os.R_OK | os.X_OK):
        raise UsageError(f"{path}: {what} is not readable")
    return path


def require_new_file(path: str | Path, what: str = "output file") -> Path:
    """A file that may be written: it does not exist yet (nothing is overwritten), and its parent,
    if it exists, is a directory."""
    path = Path(path)
    if path.is_dir():
        raise UsageError(f"{path}: {what} is a directory, expected a file name")
    if path.exists():
        raise UsageError(f"{path}: {what} exists; not overwriting it")
    parent = next((p for p in path.parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise UsageError(f"{path}: {parent} is a file, not a directory")
    return require_writable(path, what)


def require_output_dir(path: str | Path, what: str = "output directory") -> Path:
    """A directory that may be written into: missing (it will be created) or an existing
    directory, never a file."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UsageError(f"{path}: {what} is a file, expected a directory")
    parent = next((p for p in path.parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise UsageError(f"{path}: {parent} is a file, not a directory")
    return require_writable(path, what)
