"""The plan of a training job, decided once before anything is written: the checks that need no
process group and build nothing (the world size against TP and the batch sizes, the device, the data
path, the run directory) and the decisions every rank then carries out (the checkpoint to resume,
read whole, and the damaged ones passed over; the global batch it keeps; the notices to say; a
pretrained decoder's config, added by :mod:`.decoder_plan`).

``train --nproc N`` makes the plan in its own process before it launches a rank and hands it to the
ranks (:data:`PLAN_ENV`); under another launcher (torchrun, deepspeed, SLURM), or when torchrun
restarts the ranks, rank 0 makes it the same way and the other ranks take it from rank 0
(:mod:`.startup`). This module imports neither transformers nor DeepSpeed (seconds of start-up the
launcher does not need): a pretrained decoder is planned by :mod:`.decoder_plan`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields
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
from parallel_latent.errors import BadInput, require_writable
from parallel_latent.files import JSONProblem, parse_json, tree_bytes
from parallel_latent.parallel import device_kind
from parallel_latent.zero import require_supported_deepspeed

from .world import keep_global_batch, validate_world

__all__ = [
    "PLAN_ENV",
    "TOKENIZER_KEYS",
    "JobPlan",
    "checkpoint_to_resume",
    "planned_resume",
    "preflight",
    "require_room_for_a_checkpoint",
    "require_same_model",
    "require_same_vocabulary",
    "resolve_device",
]

logger = logging.getLogger(__name__)

# Model keys the tokenizer sets (:func:`parallel_latent.feature_model.tokenizer.apply_tokenizer_facts`): before it is
# loaded they hold the YAML's defaults, so a check without it leaves them to the ranks.
TOKENIZER_KEYS = ("vocab_size", "mask_token_id", "pad_token_id")
# The launcher's plan, in the environment of the ranks it starts (JSON of :class:`JobPlan`).
PLAN_ENV = "PARALLEL_LATENT_JOB_PLAN"


@dataclass(frozen=True)
class JobPlan:
    """What a job's start-up decided, once, for every rank to carry out."""

    run_dir: str  # the run directory it was made for (resolved): a plan is for that run alone
    device: str  # "cpu" | "cuda"
    resume: str | None  # the checkpoint every rank resumes from; None: a fresh start
    passed_over: tuple[tuple[str, str], ...]  # damaged checkpoints (path, damage), moved aside once accepted
    global_batch: int | None  # the resumed checkpoint's global batch, which the run keeps
    notices: tuple[str, ...]  # what planning found to say (``latest`` names an older checkpoint, ...): said once
    decoder_config: dict | None = None  # a pretrained decoder's transformers config, read and checked once

    @property
    def resume_path(self) -> Path | None:
        return None if self.resume is None else Path(self.resume)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> JobPlan:
        value = parse_json(text)
        return cls(
            value["run_dir"], value["device"], value["resume"], tuple(tuple(p) for p in value["passed_over"]),
            value["global_batch"], tuple(value["notices"]), value["decoder_config"],
        )  # fmt: skip

    def say_notices(self) -> None:
        for notice in self.notices:
            logger.warning("%s", notice)


def plan_for_this_run(run_dir: Path) -> JobPlan | None:
    """The plan the launcher of this process made for ``run_dir`` (None: no launcher made one, or
    torchrun restarted the ranks since, and what the plan chose may be stale: a new plan is made)."""
    text = os.environ.get(PLAN_ENV)
    if not text or int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0) > 0:
        return None
    try:
        plan = JobPlan.from_json(text)
    except (JSONProblem, KeyError, TypeError, ValueError):
        return None
    return plan if plan.run_dir == str(run_dir.resolve()) else None


@contextlib.contextmanager
def _notices_kept(notices: list[str]) -> Iterator[None]:
    """The package's warnings while the plan is made, kept in ``notices`` instead of said: the
    process that makes the plan may be a launcher whose ranks say them, and rank 0 says them once."""
    package = logging.getLogger("parallel_latent")

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                notices.append(record.getMessage())
            else:  # what is not a notice goes where it would have gone
                logging.getLogger().handle(record)

    handler, propagate = Keep(), package.propagate
    package.addHandler(handler)
    package.propagate = False
    try:
        yield
    finally:
        package.removeHandler(handler)
        package.propagate = propagate


def preflight(
    cfg: Config,
    world_size: int,
    source: str = "<config>",
    processes_per_node: int | None = None,
) -> JobPlan:
    """The job's plan (:class:`JobPlan`): everything about ``cfg`` that can be checked without
    building anything, and the checkpoint to resume, read whole. Raises ConfigError / DataError /
    CheckpointError with one line; writes nothing."""
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
    # one line now, before any rank starts (the ranks check the tokenizer's vocabulary).
    notices: list[str] = []
    with _notices_kept(notices):
        resume_path, passed_over = checkpoint_to_resume(cfg)
        require_same_model(cfg, resume_path, ignore=TOKENIZER_KEYS)
        global_batch = _saved_global_batch(resume_path)
        if global_batch is not None:
            keep_global_batch(cfg, world_size, global_batch, str(resume_path))
        require_room_for_a_checkpoint(cfg, resume_path, source)
    return JobPlan(
        str(run_dir.resolve()), device, None if resume_path is None else str(resume_path),
        tuple((str(path), damage) for path, damage in passed_over), global_batch, tuple(notices),
    )  # fmt: skip


def _saved_global_batch(path: Path | None) -> int | None:
    if path is None:
        return None
    sampler = saved_client_state(path).get("sampler") or {}
    return int(sampler["global_batch_size"]) if "global_batch_size" in sampler else None


def checkpoint_to_resume(cfg: Config) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The checkpoint ``checkpoint.resume`` names, read whole, and the damaged ones passed over on
    the way (each with its damage): ``auto`` = the run directory's latest, or the newest intact
    one before it (None if there is none); ``never`` = None; else that path, which must be intact.
    Reads only."""
    resume = cfg.checkpoint.resume
    if resume == "never":
        return None, []
    if resume == "auto":
        return resumable(checkpoints_dir(cfg.logging.run_dir))
    return require_intact(resolve_checkpoint(resume)), []


def require_same_model(cfg: Config, path: Path | None, ignore: tuple[str, ...] = ()) -> None:
    """CheckpointError (one line naming the first key that differs) when the checkpoint at ``path``
    was trained as another model than ``cfg.model``, or over another decoder than
    ``cfg.feature_model`` chooses; the ``model`` keys in ``ignore`` are not compared. Warns when the
    checkpoint's decoder replaces the one ``cfg`` names (a notice of the plan)."""
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


def require_same_vocabulary(cfg: Config, path: Path | None) -> None:
    """What the plan could not compare (:data:`TOKENIZER_KEYS`, which the tokenizer sets): the
    checkpoint at ``path`` against ``cfg.model`` with the tokenizer's facts applied, one line."""
    record = saved_run_config(path).get("model") if path is not None else None
    if not record:
        return
    others = {item.name: getattr(cfg.model, item.name) for item in fields(cfg.model) if item.name not in TOKENIZER_KEYS}
    if problem := cfg.model.difference({**record, **others}):
        raise CheckpointError(f"{path}: config mismatch: {problem}")


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


def planned_resume(cfg: Config, world_size: int, plan: JobPlan) -> tuple[Config, str | None]:
    """``cfg`` for carrying out ``plan`` on ``world_size`` processes: the resumed checkpoint's global
    batch kept (micro-batch and accumulation chosen for the new data-parallel size), and the line
    that says so. Unchanged without a checkpoint (or one that recorded no global batch)."""
    if plan.global_batch is None:
        return cfg, None
    return keep_global_batch(cfg, world_size, plan.global_batch, str(plan.resume))


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
