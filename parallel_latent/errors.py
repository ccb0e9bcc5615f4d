"""Command-line problems and the checks of path arguments every subcommand shares.

A path that names the wrong kind of thing (a file where a directory is expected, a directory where
a file is expected, something missing or unreadable) is bad input: one line naming the path and the
problem, exit status 2, and nothing written.
"""

from __future__ import annotations

import os
from pathlib import Path

# OSErrors that say something about the path a user gave, not about the machine.
PATH_ERRORS = (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError, FileExistsError)


class UsageError(ValueError):
    """A command-line problem found after parsing (one line)."""


def describe_path_error(error: OSError) -> str:
    """``<path>: <reason>`` for an OSError about a path (one line)."""
    where = error.filename if error.filename is not None else ""
    reason = error.strerror or type(error).__name__
    return f"{where}: {reason}" if where else reason


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
    return path


def require_output_dir(path: str | Path, what: str = "output directory") -> Path:
    """A directory that may be written into: missing (it will be created) or an existing
    directory, never a file."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UsageError(f"{path}: {what} is a file, expected a directory")
    parent = next((p for p in path.parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise UsageError(f"{path}: {parent} is a file, not a directory")
    return path
