"""What a directory holds, byte for byte, and file systems that refuse writes (a read-only or a
small tmpfs), for the tests of what a command leaves behind."""

from __future__ import annotations

import contextlib
import hashlib
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


def directory_bytes(directory: Path) -> dict[str, str]:
    """Every file under ``directory`` (hidden ones too) and the SHA-256 of its bytes."""
    return {
        str(path.relative_to(directory)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


@contextlib.contextmanager
def tmpfs(path: Path, size: str, fill: Path | None = None, read_only: bool = False) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``path`` holding a copy of ``fill`` (if given), remounted
    read-only with ``read_only``; the test is skipped, with the reason, where mounting is refused
    (it needs root with CAP_SYS_ADMIN)."""
    path.mkdir(parents=True, exist_ok=True)
    mount = shutil.which("mount")
    mounted = subprocess.run(
        [mount, "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, text=True, check=False
    ) if mount else None  # fmt: skip
    if mounted is None or mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip() if mounted else 'no mount command'})")
    try:
        if fill is not None:
            shutil.copytree(fill, path, dirs_exist_ok=True, symlinks=True)
        if read_only:
            subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True, capture_output=True)
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)
