"""The checks of a training job that need no process group and build nothing: the world size
against TP and the batch sizes, the device, the data path, the checkpoint to resume and the global
batch it keeps. ``train --nproc N`` runs them in its own process before it launches a rank, so this
module imports neither transformers nor DeepSpeed (seconds of start-up that process does not need);
every rank runs them again at start-up (:mod:`.startup`).
"""

from __future__ import annotations

from pathlib import Path

from parallel_latent.checkpoint import (
    checkpoints_dir,
    require_intact,
    resolve_checkpoint,
    resumable,
    saved_client_state,
)
from parallel_latent.config import Config, ConfigError
from parallel_latent.data import check_source
from parallel_latent.errors import BadInput
from parallel_latent.parallel import device_kind
from parallel_latent.zero import require_supported_deepspeed

from .world import keep_global_batch, validate_world

__all__ = ["checkpoint_to_resume", "planned_resume", "preflight", "resolve_device"]


def preflight(cfg: Config, world_size: int, source: str = "<config>", processes_per_node: int | None = None) -> None:
    """Everything about ``cfg`` that can be checked without building anything: the world size
    against TP and the batch sizes, the device, the data path, the checkpoint to resume.
    Raises ConfigError / DataError with one line; writes nothing."""
    require_supported_deepspeed()  # before any work: checkpoints patch DeepSpeed's checkpoint engine
    validate_world(cfg, world_size, source, processes_per_node)
    resolve_device(cfg, source)
    check_source(cfg.data)  # DataError if missing or empty; the contents are checked when prepared
    run_dir = Path(cfg.logging.run_dir)
    blocking = next((p for p in (run_dir, *run_dir.parents) if p.exists()), None)
    if blocking is not None and not blocking.is_dir():
        raise ConfigError(f"{source}: logging.run_dir={run_dir}: {blocking} is a file, not a directory")
    resume = cfg.checkpoint.resume
    if resume == "never":
        existing = checkpoints_dir(cfg.logging.run_dir)
        if existing.is_dir() and any(p.name.startswith("step_") for p in existing.iterdir()):
            raise ConfigError(
                f"{source}: checkpoint.resume=never but {existing} already holds checkpoints; "
                "choose another logging.run_dir or resume with checkpoint.resume=auto"
            )
    elif resume != "auto" and not Path(resume).exists():
        raise ConfigError(f"{source}: checkpoint.resume={resume}: no such checkpoint")
    elif resume != "auto" and not Path(resume).is_dir():
        raise ConfigError(f"{source}: checkpoint.resume={resume}: is a file; give a checkpoint or run directory")
    # A checkpoint whose global batch cannot be kept on this many processes: one line now, before
    # any rank starts (the trainer makes the same plan from rank 0's choice of checkpoint).
    planned_resume(cfg, world_size, checkpoint_to_resume(cfg))


def checkpoint_to_resume(cfg: Config) -> Path | None:
    """The checkpoint ``checkpoint.resume`` names, as this process sees it (reading only):
    ``auto`` = the run directory's latest, or the newest intact one before it if that is damaged
    (None if there is none); ``never`` = None; else that path, which must be intact."""
    resume = cfg.checkpoint.resume
    if resume == "never":
        return None
    if resume == "auto":
        return resumable(checkpoints_dir(cfg.logging.run_dir))[0]
    return require_intact(resolve_checkpoint(resume))


def planned_resume(cfg: Config, world_size: int, path: Path | None) -> tuple[Config, str | None]:
    """``cfg`` for continuing from ``path`` on ``world_size`` processes: the checkpoint's global
    batch kept (micro-batch and accumulation chosen for the new data-parallel size), and the line
    that says so; ConfigError (one line) when it cannot be kept. Unchanged without a checkpoint."""
    if path is None:
        return cfg, None
    sampler = saved_client_state(path).get("sampler") or {}
    if "global_batch_size" not in sampler:
        return cfg, None
    return keep_global_batch(cfg, world_size, int(sampler["global_batch_size"]), str(path))


def resolve_device(cfg: Config, source: str = "<runtime>", check_precision: bool = True) -> str:
    """``cpu`` or ``cuda`` for ``training.device`` (:func:`parallel_latent.parallel.device_kind`);
    ConfigError when there is no such device, or (``check_precision``) the precision needs one it is
    not: fp16 needs CUDA."""
    try:
        device = device_kind(cfg.training.device, "training.device")
    except BadInput as error:
        raise ConfigError(f"{source}: {error}") from None
    if check_precision and cfg.training.precision == "fp16" and device != "cuda":
        raise ConfigError(f"{source}: training.precision=fp16 needs a CUDA device (use bf16 or fp32 on CPU)")
    return device
