"""``parallel-latent ...`` run inside the test's own process (``parallel_latent.cli.main``), giving back
what a subprocess run gives: the exit status, stdout and stderr.

A subprocess costs its imports (torch, transformers' GPT-2, DeepSpeed: seconds of CPU) every time;
in this process they are paid once. What a command starts itself still runs as real processes: a
``--nproc N`` launcher run here starts torchrun and its ranks, whose output (file descriptors 1
and 2, inherited) is captured with this process's own. The environment is a launched rank's
(tests/helpers/trainer_runs.py rank_env) for the call only; the process groups a single-process run
creates are torn down after it (the CLI's own shutdown), so the next run starts clean.

:func:`train_on_pool`: a multi-rank training run on a pool of ranks that lives for a test module
(tests/helpers/distributed.py), for runs that test the training rather than its launch.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from dataclasses import dataclass

import pytest

from tests.helpers.trainer_runs import LAUNCHER_IDENTITY, RANK_SETTINGS


@dataclass
class Completed:
    """The fields of ``subprocess.CompletedProcess`` the tests read (``describe`` prints them)."""

    args: list[str]
    returncode: int
    stdout: str
    stderr: str


_DESCRIPTORS: dict[int, object] = {}


def _descriptor(fd: int):
    """A text stream on file descriptor ``fd``, the same one every call and never closed: a logging
    handler that one run bound to ``sys.stderr`` keeps writing to whatever fd 2 is then."""
    if fd not in _DESCRIPTORS:
        _DESCRIPTORS[fd] = open(fd, "w", buffering=1, closefd=False, errors="replace")  # noqa: SIM115
    return _DESCRIPTORS[fd]


def run_main(argv: list[str], env: dict | None = None) -> Completed:
    """``parallel_latent.cli.main(argv)`` in this process, with ``env`` set on top of a rank's."""
    from parallel_latent.cli import main

    with pytest.MonkeyPatch.context() as patch, tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        for key in LAUNCHER_IDENTITY:
            patch.delenv(key, raising=False)  # never inherit a launcher's identity
        for key, value in {**RANK_SETTINGS, **(env or {})}.items():
            patch.setenv(key, value)
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        try:
            os.dup2(out.fileno(), 1)  # what started processes write, and (below) what this one prints, in order
            os.dup2(err.fileno(), 2)
            with contextlib.redirect_stdout(_descriptor(1)), contextlib.redirect_stderr(_descriptor(2)):
                status = main(list(argv))
        finally:
            _descriptor(1).flush()
            _descriptor(2).flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
        out.seek(0)
        err.seek(0)
        stdout, stderr = (stream.read().decode(errors="replace") for stream in (out, err))
    return Completed(list(argv), int(status), stdout, stderr)


def train_on_pool(pool, config: str, overrides: list[str]) -> Completed:
    """``train --config CONFIG OVERRIDES`` as each launched rank runs it, on every rank of ``pool``
    (tests/helpers/pool_training.py train_task): rank 0's output, as from a launched job."""
    from tests.helpers.pool_training import train_task

    printed = pool.run(train_task, str(config), list(overrides))
    return Completed(["train", "--config", str(config), *overrides], 0, *printed[0])
