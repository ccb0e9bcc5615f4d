"""The checks of a training job that need no process group and build nothing: the world size
against TP and the batch sizes, the device, the data path, the checkpoint to resume and the global
batch it keeps. ``train --nproc N`` runs them in its own process before it launches a rank, so this
module imports neither transformers nor DeepSpeed (seconds of start-up that process does not need);
every rank runs them again at start-up (:mod:`.startup`).
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from parallel_latent.checkpoint import (
    CheckpointError,
    checkpoints_dir,
    list_checkpoints,
    require_intact,
    resolve_checkpoint,
    resumable,
    saved_client_state,
    saved_run_config,
)
from parallel_latent.checkpoint.layout import STAGING_PREFIX
from parallel_latent.config import Config, ConfigError
from parallel_latent.data import check_source
from parallel_latent.errors import BadInput, SaidOnce, require_writable
from parallel_latent.files import tree_bytes
from parallel_latent.parallel import device_kind
from parallel_latent.zero import require_supported_deepspeed

from .world import keep_global_batch, validate_world

__all__ = [
    "TOKENIZER_KEYS",
    "checkpoint_to_resume",
    "planned_resume",
    "preflight",
    "require_room_for_a_checkpoint",
    "require_same_model",
    "resolve_device",
]

logger = logging.getLogger(__name__)
logger.addFilter(SaidOnce())  # preflight and every rank's start-up compare the models: one notice

# Model keys the tokenizer sets (:func:`parallel_latent.feature_model.tokenizer.apply_tokenizer_facts`): before it is
# loaded they hold the YAML's defaults, so a check without it leaves them to the ranks.
TOKENIZER_KEYS = ("vocab_size", "mask_token_id", "pad_token_id")


def preflight(
    cfg: Config,
    world_size: int,
    source: str = "<config>",
    processes_per_node: int | None = None,
    read_checkpoint_whole: bool = True,
) -> str:
    """Everything about ``cfg`` that can be checked without building anything: the world size
    against TP and the batch sizes, the device, the data path, the checkpoint to resume (read whole,
    unless ``read_checkpoint_whole`` is False: the ranks of a job whose launcher read it).
    Raises ConfigError / DataError with one line; writes nothing. Returns the device kind
    (:func:`resolve_device`), which start-up then hands on instead of resolving it again."""
    require_supported_deepspeed()  # before any work: checkpoints patch DeepSpeed's checkpoint engine
    validate_world(cfg, world_size, source, processes_per_node)
    device = resolve_device(cfg, source)
    check_source(cfg.data)  # DataError if missing or empty; the contents are checked when prepared
    run_dir = Path(cfg.logging.run_dir)
    blocking = next((p for p in (run_dir, *run_dir.parents) if p.exists()), None)
    if blocking is not None and not blocking.is_dir():
        raise ConfigError(f"{source}: logging.run_dir={run_dir}: {blocking} is a file, not a directory")
    try:
        require_writable(run_dir, "logging.run_dir")
    except BadInput as error:
        raise ConfigError(f"{source}: {error}") from None
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
    # A checkpoint of another model, or whose global batch cannot be kept on this many processes:
    # one line now, before any rank starts (the ranks check again with the tokenizer's vocabulary).
    resume_path = checkpoint_to_resume(cfg, read_checkpoint_whole)
    require_same_model(cfg, resume_path, ignore=TOKENIZER_KEYS)
    planned_resume(cfg, world_size, resume_path)
    require_room_for_a_checkpoint(cfg, resume_path, source)
    return device


def checkpoint_to_resume(cfg: Config, contents: bool = True) -> Path | None:
    """The checkpoint ``checkpoint.resume`` names, as this process sees it (reading only):
    ``auto`` = the run directory's latest, or the newest intact one before it if that is damaged
    (None if there is none); ``never`` = None; else that path, which must be intact (``contents``:
    :func:`~parallel_latent.checkpoint.checkpoint_damage`'s)."""
    resume = cfg.checkpoint.resume
    if resume == "never":
        return None
    if resume == "auto":
        return resumable(checkpoints_dir(cfg.logging.run_dir), contents)[0]
    return require_intact(resolve_checkpoint(resume), contents)


def require_same_model(cfg: Config, path: Path | None, ignore: tuple[str, ...] = ()) -> None:
    """CheckpointError (one line naming the first key that differs) when the checkpoint at ``path``
    was trained as another model than ``cfg.model``, or over another decoder than
    ``cfg.feature_model`` chooses; the ``model`` keys in ``ignore`` are not compared."""
    if path is None:
        return
    saved = saved_run_config(path)  # (a checkpoint without its config: the engine's load compares the tensors)
    record = saved.get("model")
    if record:
        record = {**record, **{key: getattr(cfg.model, key) for key in ignore}}
    if problem := cfg.model.difference(record) or cfg.feature_model.difference(saved.get("feature_model")):
        raise CheckpointError(f"{path}: config mismatch: {problem}")
    kept = (saved.get("feature_model") or {}).get("name_or_path")
    if (
        cfg.feature_model.pretrained
        and isinstance(kept, str)
        and not _same_source(kept, cfg.feature_model.name_or_path)
    ):
        logger.warning(
            "%s keeps the decoder it was trained over (%s, its weights saved in the checkpoint): "
            "feature_model.name_or_path=%s is replaced by it",
            path, kept, cfg.feature_model.name_or_path,
        )  # fmt: skip


def _same_source(saved: str, given: str) -> bool:
    """Whether two ``name_or_path`` values name the same model (one directory however written)."""
    if saved == given:
        return True
    saved_path, given_path = Path(saved).expanduser(), Path(given).expanduser()
    return saved_path.exists() and given_path.exists() and saved_path.resolve() == given_path.resolve()


def require_room_for_a_checkpoint(cfg: Config, resume_path: Path | None, source: str) -> None:
    """ConfigError when the run directory's file system has less room than one more checkpoint of
    this run takes, where that can be known: the size of the checkpoint resumed, else of the run's
    newest one (a fresh run's first save is not estimated). What dead saves left counts as room:
    start-up removes it."""
    checkpoints = checkpoints_dir(cfg.logging.run_dir)
    existing = list_checkpoints(checkpoints) if checkpoints.is_dir() else []
    sample = resume_path or (existing[-1] if existing else None)
    if sample is None:
        return
    needed = tree_bytes(sample)
    run_dir = Path(cfg.logging.run_dir)
    disk = next(p for p in (run_dir, *run_dir.parents) if p.exists())
    dead = [p for p in checkpoints.glob(f"{STAGING_PREFIX}*") if p.is_dir()] if checkpoints.is_dir() else []
    room = shutil.disk_usage(disk).free + sum(tree_bytes(p) for p in dead)
    if room < needed:
        raise ConfigError(
            f"{source}: logging.run_dir={run_dir}: {room / 2**20:.1f} MiB free, but a checkpoint of this run takes "
            f"{needed / 2**20:.1f} MiB ({sample.name}): free some space or choose another logging.run_dir"
        )


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
