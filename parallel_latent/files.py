"""Durable files: fsync, publish a directory by one atomic rename, replace a small file atomically.

Used by the checkpoints (:mod:`parallel_latent.checkpoint.layout`) and the prepared corpus copies
(:mod:`parallel_latent.data.prepare`): whatever a reader finds under its final name is complete,
and stays so after a crash of the machine.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

__all__ = ["fsync", "inside", "publish", "replace_file"]


def inside(directory: Path, name: str, what: str) -> Path:
    """``directory / name`` for a ``name`` that a file of ``directory`` records (a manifest's shard):
    refused (ValueError, one line) when it is absolute or climbs with ``..``. Directories are
    downloaded from hubs: what they name must stay in them. (Links are followed: a Hugging Face
    cache's snapshot is links into its blob store.)"""
    if not name or Path(name).is_absolute() or ".." in Path(name).parts or "\\" in name:
        raise ValueError(f"{directory}: {what} names {name!r}, which is not a file inside the directory; not read")
    return Path(directory) / name


def fsync(path: Path) -> None:
    """Flush a file's data, or a directory's entries, to the disk. A file system that cannot fsync a
    directory says EINVAL: nothing to flush there."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as error:
        if error.errno not in (errno.EINVAL, errno.ENOTSUP) or not path.is_dir():
            raise
    finally:
        os.close(fd)


def replace_file(path: Path, text: str) -> None:
    """Replace the small file ``path`` atomically: readers see the old or the new, never a mix."""
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        temporary.write_text(text, encoding="utf-8")
        fsync(temporary)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    fsync(path.parent)


def publish(staging: Path, final: Path) -> None:
    """Make every file under ``staging`` durable (here and nowhere else), then rename it to the new
    ``final`` in one atomic step."""
    # safetensors creates its files 0600; checkpoints and exports are read by other users of a
    # shared file system, so every file gets the mode the umask gives this directory's files.
    mode = staging.stat().st_mode & 0o666
    for root, _, files in os.walk(staging):
        for name in files:
            os.chmod(Path(root, name), mode)
            fsync(Path(root, name))
        fsync(Path(root))
    os.rename(staging, final)
    fsync(final.parent)
