"""Every command that writes, pointed at a read-only file system (a real tmpfs remounted read-only,
holding a training run and a portable checkpoint): one line naming the path, status 2, before
anything is loaded, and nothing written (the mount would refuse it: the check is that the command
says so in one line instead of a traceback)."""

from __future__ import annotations

import errno
import os

import pytest

from parallel_latent.errors import ExitStatus, exit_status, one_line
from tests.helpers.filesystems import directory_bytes, tmpfs
from tests.helpers.in_process_cli import run_main
from tests.helpers.make_fixture import FIXTURE
from tests.helpers.trainer_runs import TINY_CONFIG, describe

STEP = "run/checkpoints/step_00000060"


@pytest.fixture(scope="module")
def read_only(tmp_path_factory):
    with tmpfs(tmp_path_factory.mktemp("destinations") / "ro", "4m", fill=FIXTURE, read_only=True) as mounted:
        yield mounted


def commands(ro):
    corpus = ro / "corpus.txt"  # (not there: the destination is refused first)
    return {
        "train": ["train", "--config", str(TINY_CONFIG), "--nproc=2", f"logging.run_dir={ro / 'new-run'}"],
        "export": ["export", str(ro / STEP), str(ro / "exported")],
        "consolidate": ["consolidate", str(ro / "portable"), str(ro / "consolidated")],
        "reshard": ["reshard", str(ro / STEP)],
        "save-pretrained": ["save-pretrained", str(ro / "portable"), str(ro / "pretrained"), "--no-evaluate"],
        "encode": ["encode", "--checkpoint", str(ro / "portable"), "--out", str(ro / "latents.safetensors"), "a"],
        "encode-corpus": ["encode-corpus", "--checkpoint", str(ro / "portable"), "--data", str(corpus), "--out",
                          str(ro / "latents")],
    }  # fmt: skip


@pytest.mark.parametrize(
    "command", ["train", "export", "consolidate", "reshard", "save-pretrained", "encode", "encode-corpus"]
)
def test_a_read_only_destination_is_one_line_and_status_2(read_only, command):
    before = directory_bytes(read_only)
    result = run_main(commands(read_only)[command])
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, describe(result)
    assert lines[0].startswith("parallel-latent: error: ") and "read-only file system" in lines[0], lines[0]
    assert directory_bytes(read_only) == before


@pytest.mark.parametrize(
    "number, status",
    [
        (errno.EROFS, ExitStatus.BAD_INPUT),
        (errno.ENOSPC, ExitStatus.SAVE_FAILED),
        (errno.EDQUOT, ExitStatus.SAVE_FAILED),
        (errno.EIO, ExitStatus.SAVE_FAILED),
        (errno.ECONNRESET, ExitStatus.FAILURE),
    ],
)
def test_a_write_the_system_refuses_mid_way_ends_with_its_status_in_one_line(number, status):
    """Where a write fails after the checks passed: a read-only mount is the path's fault (2), a disk
    that fills or fails mid-write is status 4, one line naming the path; anything else is unexpected."""
    error = OSError(number, os.strerror(number), "/out/shard.arrow")
    assert exit_status(error) is status
    assert one_line(error) == f"/out/shard.arrow: {os.strerror(number)}"
