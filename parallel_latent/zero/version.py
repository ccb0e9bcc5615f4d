"""The DeepSpeed releases this package was written for (:data:`SUPPORTED`, the range
``pyproject.toml`` pins) and the one gate every part of it goes through.

Every use of DeepSpeed's private classes, methods and checkpoint keys (:mod:`.patches`,
:mod:`.params`, :mod:`.checkpoint_files`) was written against these releases. What only speeds DeepSpeed up
asks :func:`usable` (outside the range: one warning, DeepSpeed's own code runs); what safety depends
on (the checkpoint engine's patches, DeepSpeed's private checkpoint keys) asks
:func:`require_supported_deepspeed` (outside the range: one line, exit status 2), which the job runs
before any work and :func:`import_deepspeed` runs before the checkpoint code touches DeepSpeed.

The version is read once from the installed distribution's metadata (no import of DeepSpeed), so
the command line checks it in milliseconds and every later check is free.
"""

from __future__ import annotations

import functools
import logging
import os
from importlib import metadata

from parallel_latent.errors import BadInput, in_release_range, release_range_words

__all__ = [
    "SUPPORTED",
    "DeepSpeedVersionError",
    "import_deepspeed",
    "installed_version",
    "prefer_cpu_accelerator",
    "require_supported_deepspeed",
    "supported",
    "usable",
]

logger = logging.getLogger(__name__)

# [first, end): the releases whose private classes, methods and checkpoint keys this code was written
# against and tested with.
SUPPORTED = ((0, 19, 8), (0, 20, 0))


class DeepSpeedVersionError(BadInput):
    """The installed DeepSpeed is outside the releases whose checkpoint engine this code patches."""


# Read once: the installed release does not change while the process runs, and reading the metadata
# costs milliseconds, which ZeRO-3's gathers (through the gate, for every tensor) would pay each time.
@functools.cache
def installed_version() -> str:
    """The installed DeepSpeed's version, from its distribution's metadata."""
    try:
        return metadata.version("deepspeed")
    except metadata.PackageNotFoundError:
        import deepspeed  # a source checkout on the path: its own attribute

        return deepspeed.__version__


def supported(version: str | None = None) -> bool:
    """Whether ``version`` (default: the installed DeepSpeed's) is in :data:`SUPPORTED`."""
    return in_release_range(installed_version() if version is None else version, SUPPORTED)


def require_supported_deepspeed(version: str | None = None) -> None:
    """Refuse (one line, exit status 2) a DeepSpeed whose checkpoint engine this code cannot patch."""
    version = installed_version() if version is None else version
    if not supported(version):
        words = release_range_words(SUPPORTED)
        raise DeepSpeedVersionError(
            f"DeepSpeed {version} is installed, but parallel-latent's checkpoints patch DeepSpeed's checkpoint "
            f"engine as releases {words} have it: pip install 'deepspeed{words}'"
        )


def usable(what: str, version: str | None) -> bool:
    """Whether a patch that only speeds DeepSpeed up applies; outside the range, one warning saying
    what is skipped (DeepSpeed's own code path runs: correct, slower)."""
    version = installed_version() if version is None else version
    if supported(version):
        return True
    logger.warning(
        "DeepSpeed %s is outside the releases %s that parallel-latent's %s was written for: skipped, "
        "DeepSpeed's own code runs instead (correct, slower)",
        version,
        release_range_words(SUPPORTED),
        what,
    )
    return False


def prefer_cpu_accelerator() -> None:
    """Without CUDA, tell DeepSpeed its accelerator is the CPU before it is imported: otherwise its
    import guesses so and says it in a warning its logger writes to stdout, in every process."""
    if "DS_ACCELERATOR" not in os.environ:
        import torch

        if not torch.cuda.is_available():
            os.environ["DS_ACCELERATOR"] = "cpu"


def import_deepspeed():
    """DeepSpeed, for code that reads its private state: refused (:func:`require_supported_deepspeed`)
    outside :data:`SUPPORTED`."""
    require_supported_deepspeed()
    prefer_cpu_accelerator()
    import deepspeed

    return deepspeed
