"""Training checkpoints: DeepSpeed's files plus everything needed to continue bit for bit.

Layout under the run's checkpoint directory::

    checkpoints/
      latest                       # the tag of the newest complete checkpoint ("step_00000020")
      step_00000020/
        checkpoint.json            # layout (TP, DP, ZeRO stage, precision), step; written last
        client_state.json          # the trainer's state (data position, metrics, ...), engine counters
        rng/rank_00000.json ...    # every RNG of every rank, incl. the dropout RNG (JSON, no pickle)
        mp_rank_00_model_states.pt, zero_pp_rank_0_mp_rank_00_optim_states.pt, ...   (DeepSpeed)
        model/                     # portable weights (checkpoint.export_portable)
        universal/                 # layout-free fp32 weights + Adam moments (resharded resume)
      .tmp-step_00000030/          # a save in progress, or one that died: never `latest`

Publishing: every rank writes into ``.tmp-step_N``; after a barrier (all ranks finished and fsynced)
rank 0 renames it to ``step_N`` (atomic), then moves ``latest`` (temporary file + os.replace),
then prunes to the last K. A save killed at any point leaves the previous ``latest`` intact.
DeepSpeed's own ``latest`` file is not used (``save_latest=False``): it would be written before our
extra files exist. The training checkpoints assume a file system shared by all ranks, as
DeepSpeed's do.

DeepSpeed's files are pickles; they are read with ``torch.load(weights_only=True)`` and an explicit
allowlist of the few DeepSpeed classes they contain (:func:`deepspeed_safe_globals`). Anything else
in them is reported, not loaded.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import random
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .errors import CheckpointError
from .portable import (
    _barrier,
    _is_global_rank0,
    _plain,
    compare_model_configs,
    fsync_directory,
    save_portable,
    write_json_atomic,
)

logger = logging.getLogger(__name__)

TAG_PATTERN = re.compile(r"^step_(\d{8,})$")
STAGING_PREFIX = ".tmp-"
REPLACED_PREFIX = ".replaced-"
LATEST_FILE = "latest"
# A run directory keeps its training checkpoints here (the trainer's layout).
RUN_CHECKPOINTS_DIR = "checkpoints"
INFO_FILE = "checkpoint.json"
CLIENT_STATE_FILE = "client_state.json"
RNG_DIR = "rng"
PORTABLE_DIR = "model"
UNIVERSAL_DIR = "universal"
# Test hook: seconds to sleep after everything is written and before the rename that publishes.
PAUSE_BEFORE_PUBLISH_ENV = "PARALLEL_LATENT_PAUSE_BEFORE_PUBLISH"
PAUSE_MARKER = "PAUSED_BEFORE_PUBLISH"


def checkpoint_tag(step: int) -> str:
    return f"step_{step:08d}"


# --------------------------------------------------------------------------- #
# Layout of the running job.
# --------------------------------------------------------------------------- #


def engine_layout(engine) -> dict[str, Any]:
    """TP x DP, ZeRO stage and precision of a DeepSpeed engine (what a checkpoint's files depend on)."""
    mpu = getattr(engine, "mpu", None)
    tp = mpu.get_model_parallel_world_size() if mpu is not None else 1
    precision = "bf16" if engine.bfloat16_enabled() else "fp16" if engine.fp16_enabled() else "fp32"
    if precision == "fp32" and any(p.dtype == torch.float64 for p in engine.module.parameters()):
        precision = "fp64"
    world = dist.get_world_size() if dist.is_initialized() else 1
    return {
        "tensor_parallel": tp,
        "data_parallel": int(engine.dp_world_size),
        "zero_stage": int(engine.zero_optimization_stage()),
        "precision": precision,
        "world_size": world,
    }


def _tp_group_for(model) -> Any:
    if hasattr(model, "tp_group"):
        return model.tp_group
    from parallel_latent.parallel import state

    return state.get_tp_group() if state.is_initialized() else None


# --------------------------------------------------------------------------- #
# RNG states (JSON: nothing here needs pickle).
# --------------------------------------------------------------------------- #


def capture_rng_state(model=None) -> dict[str, Any]:
    version, mt_state, gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_cached = np.random.get_state()
    state = {
        "python": [version, list(mt_state), gauss],
        "numpy": [np_name, np_keys.tolist(), int(np_pos), int(np_has_gauss), float(np_cached)],
        "torch": torch.get_rng_state().tolist(),
        "cuda": [s.tolist() for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else None,
    }
    dropout_rng = getattr(model, "dropout_rng", None)
    if dropout_rng is not None:
        state["dropout"] = dropout_rng.state_dict()
    return state


def restore_rng_state(state: dict[str, Any], model=None) -> None:
    version, mt_state, gauss = state["python"]
    random.setstate((version, tuple(mt_state), gauss))
    np_name, np_keys, np_pos, np_has_gauss, np_cached = state["numpy"]
    np.random.set_state((np_name, np.array(np_keys, dtype=np.uint32), np_pos, np_has_gauss, np_cached))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if state.get("cuda") and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])
    dropout_rng = getattr(model, "dropout_rng", None)
    if dropout_rng is not None and "dropout" in state:
        dropout_rng.load_state_dict(state["dropout"])


def _rng_file(step_dir: Path, rank: int) -> Path:
    return step_dir / RNG_DIR / f"rank_{rank:05d}.json"


# --------------------------------------------------------------------------- #
# Loading DeepSpeed's pickles with weights_only=True.
# --------------------------------------------------------------------------- #


def deepspeed_safe_globals() -> list:
    """The DeepSpeed types found in its checkpoint files (0.19): plain data holders whose
    unpickling runs no code of theirs beyond setting attributes or building an enum/namedtuple."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def safe_torch_load(path: str | Path, map_location=None):
    """``torch.load(weights_only=True)`` with DeepSpeed's allowlist; a file that needs anything
    else raises :class:`CheckpointError` naming the offending global instead of being unpickled."""
    try:
        with torch.serialization.safe_globals(deepspeed_safe_globals()):
            return torch.load(path, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file missing") from None
    except (pickle.UnpicklingError, RuntimeError, AttributeError, TypeError) as error:
        detail = next(
            (line.strip() for line in str(error).splitlines() if "GLOBAL" in line or "global" in line),
            str(error).splitlines()[0] if str(error) else type(error).__name__,
        )
        raise CheckpointError(f"{path}: refused to load with weights_only=True ({detail[:300]})") from None


@contextlib.contextmanager
def weights_only_loading(engine):
    """Route DeepSpeed's checkpoint reads through :func:`safe_torch_load` (its own engine calls
    ``torch.load(weights_only=False)``)."""
    checkpoint_engine = engine.checkpoint_engine
    original = checkpoint_engine.load
    checkpoint_engine.load = lambda path, map_location=None: safe_torch_load(path, map_location)
    try:
        yield
    finally:
        checkpoint_engine.load = original


# --------------------------------------------------------------------------- #
# Finding checkpoints.
# --------------------------------------------------------------------------- #


def is_complete(step_dir: Path) -> bool:
    return TAG_PATTERN.match(step_dir.name) is not None and (step_dir / INFO_FILE).is_file()


def list_checkpoints(checkpoint_dir: str | Path) -> list[Path]:
    """Complete checkpoints under ``checkpoint_dir``, oldest first."""
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        return []
    found = [p for p in checkpoint_dir.iterdir() if p.is_dir() and is_complete(p)]
    return sorted(found, key=lambda p: int(TAG_PATTERN.match(p.name).group(1)))


def find_latest_checkpoint(checkpoint_dir: str | Path) -> Path | None:
    """The checkpoint ``latest`` names; if that one is gone or incomplete (a crash between
    renames), the newest complete one; None when there is none."""
    checkpoint_dir = Path(checkpoint_dir)
    latest = checkpoint_dir / LATEST_FILE
    if latest.is_file():
        candidate = checkpoint_dir / latest.read_text(encoding="utf-8").strip()
        if is_complete(candidate):
            return candidate
        logger.warning(
            "%s names %s, which is not a complete checkpoint; using the newest complete one", latest, candidate.name
        )
    complete = list_checkpoints(checkpoint_dir)
    return complete[-1] if complete else None


def resolve_checkpoint(path: str | Path) -> Path:
    """A training checkpoint directory from a path to it, to the directory holding ``latest``, or
    to a run directory (its ``checkpoints/``)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint or run directory")
    if not path.is_dir():
        raise CheckpointError(f"{path}: is a file; expected a checkpoint or run directory")
    if path.name.startswith((STAGING_PREFIX, REPLACED_PREFIX)):
        raise CheckpointError(f"{path}: an unfinished save (never published); not loadable")
    if (path / INFO_FILE).is_file():
        return path
    if (path / RUN_CHECKPOINTS_DIR).is_dir():
        path = path / RUN_CHECKPOINTS_DIR
    found = find_latest_checkpoint(path)
    if found is None:
        raise CheckpointError(f"{path}: no complete training checkpoint here ({INFO_FILE} or {LATEST_FILE} missing)")
    return found


def read_info(step_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((step_dir / INFO_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{step_dir}: {INFO_FILE} missing (not a complete training checkpoint)") from None
    except (OSError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{step_dir / INFO_FILE}: unreadable ({error})") from None


# --------------------------------------------------------------------------- #
# Saving.
# --------------------------------------------------------------------------- #


def _fsync_tree(path: Path) -> None:
    """fsync every file this rank can see under ``path`` (cheap next to the data; makes the
    rename that follows publish data that is on disk, not only in the page cache)."""
    for root, _, files in os.walk(path):
        for name in files:
            try:
                fd = os.open(os.path.join(root, name), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fsync(fd)
            except OSError:
                pass
            finally:
                os.close(fd)
        fsync_directory(Path(root))


def _pause_before_publish(staging: Path) -> None:
    seconds = os.environ.get(PAUSE_BEFORE_PUBLISH_ENV)
    if not seconds:
        return
    marker = staging / PAUSE_MARKER
    marker.write_text(str(os.getpid()))
    time.sleep(float(seconds))
    marker.unlink(missing_ok=True)


def _publish(checkpoint_dir: Path, staging: Path, tag: str) -> Path:
    """Rank 0: rename the finished staging directory into place, then move ``latest``."""
    final = checkpoint_dir / tag
    replaced = None
    if final.exists():
        # The same step saved again (e.g. a run resumed at its last step): the old copy is moved
        # aside, not deleted, until the new one is in place.
        replaced = checkpoint_dir / f"{REPLACED_PREFIX}{tag}-{os.getpid()}"
        os.rename(final, replaced)
    os.rename(staging, final)
    fsync_directory(checkpoint_dir)
    write_text_atomic(checkpoint_dir / LATEST_FILE, tag)
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)
    return final


def write_text_atomic(path: Path, text: str) -> None:
    """Write a small text file atomically (temporary file, fsync, os.replace)."""
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(temporary, "w", encoding="utf-8") as handle:
        handle.write(text + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    fsync_directory(path.parent)


def prune_checkpoints(checkpoint_dir: Path, keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` complete checkpoints (0 = keep all) and leftovers of
    saves that died; never the one ``latest`` names. Rank 0 only, after a publish."""
    removed = []
    latest = find_latest_checkpoint(checkpoint_dir)
    complete = list_checkpoints(checkpoint_dir)
    if keep_last > 0:
        for old in complete[:-keep_last]:
            if latest is not None and old.resolve() == latest.resolve():
                continue
            shutil.rmtree(old, ignore_errors=True)
            removed.append(old)
    for leftover in checkpoint_dir.iterdir():
        # Another save's staging directory can only be a dead one: saves are collective and serial.
        if leftover.is_dir() and leftover.name.startswith((STAGING_PREFIX, REPLACED_PREFIX)):
            shutil.rmtree(leftover, ignore_errors=True)
            removed.append(leftover)
    return removed


def _tensor_facts(engine, model, tp_size: int) -> dict[str, Any]:
    """What offline conversion to the universal state needs to know beyond DeepSpeed's files: how
    each tensor is split over TP, and (ZeRO-0) which parameter each optimizer slot belongs to."""
    from .reshard import tensor_table
    from .zero_access import base_optimizer

    table, aliases = tensor_table(model, tp_size)
    facts: dict[str, Any] = {"tensors": table, "aliases": aliases}
    try:
        optimizer = base_optimizer(engine)
    except CheckpointError:
        return facts
    facts["optimizer_class"] = type(optimizer).__name__
    names = {id(p): n for n, p in model.named_parameters()}
    if optimizer is engine.optimizer:
        facts["optimizer_param_names"] = [names.get(id(p), "?") for g in optimizer.param_groups for p in g["params"]]
    return facts


def save_training_checkpoint(
    engine,
    checkpoint_dir: str | Path,
    step: int,
    client_state: dict | None = None,
    *,
    model=None,
    cfg=None,
    tokenizer_facts: dict | None = None,
    keep_last: int = 0,
    export_portable: bool = False,
    universal: bool = False,
    tp_group=None,
) -> Path:
    """Save a training checkpoint of ``engine`` at ``step`` and publish it atomically.

    Collective: every rank calls it. ``client_state`` must be JSON-serializable (data sampler
    position, metrics, ...); the engine's counters and LR scheduler, and every rank's RNG states
    (torch, CUDA, numpy, python, ``model.dropout_rng``) are added here. ``export_portable`` also
    writes ``model/`` (portable safetensors shards), ``universal`` writes ``universal/`` (fp32
    weights and Adam moments, for resuming at another layout without a conversion step).
    Returns the published directory (``<checkpoint_dir>/step_XXXXXXXX``).
    """
    checkpoint_dir = Path(checkpoint_dir)
    model = model if model is not None else engine.module
    tp_group = tp_group if tp_group is not None else _tp_group_for(model)
    tag = checkpoint_tag(step)
    staging = checkpoint_dir / f"{STAGING_PREFIX}{tag}"
    rank = dist.get_rank() if dist.is_initialized() else 0
    if _is_global_rank0():
        checkpoint_dir.mkdir(parents=True, exist_ok=True)
        if staging.exists():
            shutil.rmtree(staging)  # an earlier attempt at this step died before publishing
    _barrier()

    layout = engine_layout(engine)
    tensor_facts = _tensor_facts(engine, model, layout["tensor_parallel"])
    engine.save_checkpoint(str(checkpoint_dir), tag=staging.name, client_state={"step": step}, save_latest=False)

    rng_file = _rng_file(staging, rank)
    rng_file.parent.mkdir(parents=True, exist_ok=True)
    with open(rng_file, "w", encoding="utf-8") as handle:
        json.dump(capture_rng_state(model), handle)
    if export_portable:
        save_portable(model, staging / PORTABLE_DIR, cfg, tokenizer_facts, tp_group, step=step)
    if universal:
        from .reshard import save_universal_state

        save_universal_state(
            engine,
            staging / UNIVERSAL_DIR,
            tp_group=tp_group,
            step=step,
            model=model,
            cfg=cfg,
            tokenizer_facts=tokenizer_facts,
        )
    if _is_global_rank0():
        scheduler = getattr(engine, "lr_scheduler", None)
        state = {
            "step": step,
            "client": _plain(client_state or {}),
            "engine": {
                "global_steps": int(engine.global_steps),
                "global_samples": int(engine.global_samples),
                "skipped_steps": int(engine.skipped_steps),
            },
            "lr_scheduler": _plain(scheduler.state_dict()) if scheduler is not None else None,
            "tokenizer": _plain(tokenizer_facts),
            "config": _plain(cfg) if cfg is not None else None,
        }
        write_json_atomic(staging / CLIENT_STATE_FILE, state)
    _fsync_tree(staging)
    _barrier()  # every rank has written and fsynced its files

    if _is_global_rank0():
        info = {
            "tag": tag,
            "step": step,
            "layout": layout,
            "portable": export_portable,
            "universal": universal,
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            **tensor_facts,
        }
        try:
            import deepspeed

            info["deepspeed_version"] = deepspeed.__version__
        except ImportError:
            pass
        # Written last: its presence marks the directory complete.
        write_json_atomic(staging / INFO_FILE, info)
        _pause_before_publish(staging)
        _publish(checkpoint_dir, staging, tag)
        prune_checkpoints(checkpoint_dir, keep_last)
    _barrier()
    return checkpoint_dir / tag


# --------------------------------------------------------------------------- #
# Loading.
# --------------------------------------------------------------------------- #


@dataclass
class LoadedCheckpoint:
    path: Path
    step: int
    client_state: dict  # what the trainer passed to save_training_checkpoint
    resharded: bool  # loaded through the universal state at another layout
    saved_layout: dict = field(default_factory=dict)


def load_training_checkpoint(
    engine, path: str | Path, *, model=None, load_optimizer: bool = True, tp_group=None
) -> LoadedCheckpoint:
    """Restore ``engine`` (weights, optimizer, LR scheduler, counters) and this rank's RNG states.

    ``path`` is a ``step_N`` directory or the directory holding ``latest``. At the saved layout
    (TP, DP, ZeRO stage, precision) this is DeepSpeed's ``load_checkpoint`` with weights-only
    unpickling; at any other layout the universal state is loaded (and, if the checkpoint has
    none, first converted from DeepSpeed's files by rank 0). Collective: every rank calls it.
    """
    step_dir = resolve_checkpoint(path)
    info = read_info(step_dir)
    model = model if model is not None else engine.module
    tp_group = tp_group if tp_group is not None else _tp_group_for(model)
    current = engine_layout(engine)
    saved = info["layout"]
    same_layout = all(
        saved.get(k) == current[k] for k in ("tensor_parallel", "data_parallel", "zero_stage", "precision")
    )
    try:
        client = json.loads((step_dir / CLIENT_STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{step_dir / CLIENT_STATE_FILE}: unreadable ({error})") from None
    # Another model (e.g. another vocabulary head) would fail deep in DeepSpeed's state-dict load.
    compare_model_configs({"model_config": (client.get("config") or {}).get("model")}, model, step_dir)

    if same_layout:
        with weights_only_loading(engine):
            load_path, _ = engine.load_checkpoint(
                str(step_dir.parent),
                tag=step_dir.name,
                load_optimizer_states=load_optimizer,
                load_lr_scheduler_states=load_optimizer,
            )
        if load_path is None:
            raise CheckpointError(f"{step_dir}: DeepSpeed found no checkpoint files for this rank")
    else:
        from .reshard import ensure_universal_state, load_universal_state

        universal_dir = ensure_universal_state(step_dir)
        load_universal_state(engine, universal_dir, tp_group=tp_group, load_optimizer=load_optimizer)
        counters = client.get("engine", {})
        engine.global_steps = counters.get("global_steps", info["step"])
        engine.global_samples = counters.get("global_samples", 0)
        engine.skipped_steps = counters.get("skipped_steps", 0)
        scheduler = getattr(engine, "lr_scheduler", None)
        if load_optimizer and scheduler is not None and client.get("lr_scheduler"):
            scheduler.load_state_dict(client["lr_scheduler"])

    rank = dist.get_rank() if dist.is_initialized() else 0
    rng_file = _rng_file(step_dir, rank)
    if saved.get("world_size") == current["world_size"] and rng_file.is_file():
        restore_rng_state(json.loads(rng_file.read_text(encoding="utf-8")), model)
    else:
        # Another world size: per-rank generator streams do not map onto the new ranks. Dropout is
        # keyed on (seed, step) and needs only those two, taken from rank 0's record.
        reference = _rng_file(step_dir, 0)
        dropout_rng = getattr(model, "dropout_rng", None)
        if dropout_rng is not None and reference.is_file():
            recorded = json.loads(reference.read_text(encoding="utf-8")).get("dropout")
            if recorded:
                dropout_rng.seed, dropout_rng.step = recorded["seed"], recorded["step"]
    return LoadedCheckpoint(
        path=step_dir,
        step=int(info["step"]),
        client_state=client.get("client", {}),
        resharded=not same_layout,
        saved_layout=saved,
    )
