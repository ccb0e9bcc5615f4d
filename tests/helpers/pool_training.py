"""The real trainer run as a library on the ranks of a DistributedPool (tests/helpers/distributed.py).

What ``parallel-latent train`` runs on each rank under torchrun (``parallel_latent.training.trainer.train``),
called on every rank of a pool that lives for a test module: a run costs its steps, not a launcher
and four Pythons importing torch, transformers and DeepSpeed. Used where a test compares runs of
the trainer and needs no launcher or fault of a process of its own."""

from __future__ import annotations

import contextlib
import io

from tests.helpers.distributed import DistributedPool

# What tests/helpers/trainer_runs.rank_env gives a launched rank (OMP threads: the pool's own).
POOL_ENV = {"DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}


def training_pool(world_size: int) -> DistributedPool:
    return DistributedPool(world_size, env=POOL_ENV)


_SHARED: dict[int, DistributedPool] = {}


def shared_pool(request, world_size: int) -> DistributedPool:
    """The pool of ``world_size`` ranks that every module run in this pytest process (the serial run,
    or one xdist worker) shares (tests/conftest.py's ``pool2`` and ``pool4``): its ranks start (and
    import torch, transformers and DeepSpeed) once, not once per module. Every task sets up the
    process groups it needs on top of the default one, and they are destroyed when it returns; a
    task that fails, or a rank that dies, tears the pool down and the next task starts it afresh.
    A task leaves nothing running behind it (a trainer's watchdog is stopped: the ranks live on).
    Closed when the session ends. ``request``: any fixture's."""
    pool = _SHARED.get(world_size)
    if pool is None:
        pool = _SHARED[world_size] = training_pool(world_size)
        request.config.add_cleanup(lambda: _SHARED.pop(world_size).close())
    return pool


def train_task(config: str, overrides: list[str], deepspeed_overrides: dict | None = None) -> tuple[str, str]:
    """On every rank: ``train --config CONFIG OVERRIDES`` (with ``--deepspeed-overrides``) as a rank
    of a launched job runs it (the trainer, on this rank's gloo group); returns what this rank
    printed (stdout, stderr)."""
    import os

    from parallel_latent.config import load_config
    from parallel_latent.launching.worker_logs import quiet_repeated_notices
    from parallel_latent.training.trainer import train

    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # a pool started without POOL_ENV
    cfg = load_config(config, overrides)
    quiet_repeated_notices()
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        train(cfg, deepspeed_overrides, source=config)
    return out.getvalue(), err.getvalue()


def train_in_pool(
    pool: DistributedPool, run_dir, *overrides: str, deepspeed_overrides: dict | None = None
) -> tuple[str, str]:
    """One training job of the tiny config (tests/helpers/trainer_runs.py TINY) on every rank of
    ``pool``; what the ranks printed (stdout, stderr), rank by rank."""
    from tests.helpers.trainer_runs import TINY, TINY_CONFIG

    overrides = [*TINY, f"logging.run_dir={run_dir}", *overrides]
    printed = pool.run(train_task, str(TINY_CONFIG), overrides, deepspeed_overrides)
    return "".join(out for out, _ in printed), "".join(err for _, err in printed)
