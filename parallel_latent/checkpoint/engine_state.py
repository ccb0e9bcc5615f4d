"""Training checkpoints: DeepSpeed's files plus everything needed to continue bit for bit: what a
checkpoint records of the engine (its layout, its tensors, every RNG), and loading one, at its own
layout or, through the universal state, at any other. Writing one is :mod:`.saving`'s.
"""

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from parallel_latent.coordination import broadcast_value, is_main
from parallel_latent.zero.checkpoint_files import weights_only_loading
from parallel_latent.zero.params import base_optimizer

from . import layout
from .integrity import checkpoint_damage, damaged_error
from .layout import CheckpointError
from .portable import check_model_record, model_record
from .universal import ensure_universal_state, load_universal_state, tensor_table


def engine_layout(engine) -> dict[str, Any]:
    """TP x DP, ZeRO stage and precision of a DeepSpeed engine (what a checkpoint's files depend on)."""
    mpu = getattr(engine, "mpu", None)
    tp = mpu.get_model_parallel_world_size() if mpu is not None else 1
    precision = "bf16" if engine.bfloat16_enabled() else "fp16" if engine.fp16_enabled() else "fp32"
    if precision == "fp32" and any(p.dtype == torch.float64 for p in engine.module.parameters()):
        precision = "fp64"
    return {
        "tensor_parallel": tp,
        "data_parallel": int(engine.dp_world_size),
        "zero_stage": int(engine.zero_optimization_stage()),
        "precision": precision,
        "world_size": dist.get_world_size() if dist.is_initialized() else 1,
    }


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def capture_rng_state(model=None) -> dict[str, Any]:
    """Every generator a step draws from, as JSON (loading it runs no pickle)."""
    version, mt_state, gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_cached = np.random.get_state()
    dropout_rng = getattr(model, "dropout_rng", None)
    return {
        "python": [version, list(mt_state), gauss],
        "numpy": [np_name, np_keys.tolist(), int(np_pos), int(np_has_gauss), float(np_cached)],
        "torch": torch.get_rng_state().tolist(),
        "cuda": [s.tolist() for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else None,
        "dropout": dropout_rng.state_dict() if dropout_rng is not None else None,
    }


def restore_rng_state(state: dict[str, Any], model=None) -> None:
    version, mt_state, gauss = state["python"]
    random.setstate((version, tuple(mt_state), gauss))
    np_name, np_keys, np_pos, np_has_gauss, np_cached = state["numpy"]
    np.random.set_state((np_name, np.array(np_keys, dtype=np.uint32), np_pos, np_has_gauss, np_cached))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if state.get("cuda") and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])
    dropout_rng = getattr(model, "dropout_rng", None)
    if dropout_rng is not None and state.get("dropout"):
        dropout_rng.load_state_dict(state["dropout"])


def _rng_file(step_dir: Path, rank: int) -> Path:
    return step_dir / layout.RNG_DIR / f"rank_{rank:05d}.json"


def _tensor_facts(engine, model, tp_size: int, record_keywords: dict | None = None) -> dict[str, Any]:
    """What the conversion to the universal state needs beyond DeepSpeed's files: the model's record
    (given ``record_keywords``), how each tensor is split over TP, the optimizer's class and (ZeRO-0)
    which parameter each optimizer slot holds."""
    table, aliases = tensor_table(model, tp_size)
    facts: dict[str, Any] = {"model_record": model_record(model, record_keywords), "tensors": table, "aliases": aliases}
    try:
        optimizer = base_optimizer(engine)
    except CheckpointError:
        return facts
    facts["optimizer_class"] = type(optimizer).__name__
    names = {id(p): n for n, p in model.named_parameters()}
    if optimizer is engine.optimizer:
        facts["optimizer_param_names"] = [names.get(id(p), "?") for g in optimizer.param_groups for p in g["params"]]
    return facts


def saved_client_state(path: str | Path) -> dict:
    """What the trainer passed to :func:`save_training_checkpoint` (read without an engine)."""
    state = layout.read_json(layout.resolve_checkpoint(path) / layout.CLIENT_STATE_FILE, "client state")
    return state.get("client", {})


def saved_run_config(path: str | Path) -> dict:
    """The config the run that saved ``path`` trained with (its sections as dicts; empty if not recorded)."""
    state = layout.read_json(layout.resolve_checkpoint(path) / layout.CLIENT_STATE_FILE, "client state")
    return state.get("config") or {}


@dataclass
class LoadedCheckpoint:
    path: Path
    step: int
    client_state: dict  # what the trainer passed to save_training_checkpoint
    resharded: bool  # loaded through the universal state at another layout


def _same_splits(saved_table: dict | None, model, tp_size: int) -> bool:
    """Whether every tensor of ``model`` is split as the checkpoint's table records (a table the
    checkpoint predates: assumed so). A frozen decoder sharded over the TP group or replicated
    (``feature_model.parallel``) changes how the module's tensors are split at the same TP degree,
    which DeepSpeed's own files cannot load into: the universal state can."""
    if not saved_table:
        return True
    table, _ = tensor_table(model, tp_size)
    split = ("partition_dim", "partition_stride")
    return all({k: saved_table.get(name, {}).get(k, 1) for k in split} == {k: spec.get(k, 1) for k in split}
               for name, spec in table.items())  # fmt: skip


def load_training_checkpoint(engine, path: str | Path, *, model=None, tp_group=None) -> LoadedCheckpoint:
    """Restore ``engine`` (weights, optimizer, LR scheduler, counters) and this rank's RNG states
    from ``path`` (see :func:`.layout.resolve_checkpoint`). Collective. At the saved TP, DP, ZeRO
    stage and precision DeepSpeed loads its own files; at any other, the universal state is loaded."""
    step_dir = layout.resolve_checkpoint(path)
    info = layout.read_info(step_dir)
    # Checked by one reader before DeepSpeed reads a file, so that damage is named as damage.
    damage = broadcast_value(checkpoint_damage(step_dir) if is_main() else None)
    if damage is not None:
        raise damaged_error(step_dir, damage)
    model = model if model is not None else engine.module
    saved, now = info["layout"], engine_layout(engine)
    same_layout = all(saved.get(k) == now[k] for k in ("tensor_parallel", "data_parallel", "zero_stage", "precision"))
    same_layout = same_layout and _same_splits(info.get("tensors"), model, now["tensor_parallel"])
    client = layout.read_json(step_dir / layout.CLIENT_STATE_FILE, "client state")
    # Another model (e.g. another vocabulary head) would fail deep in DeepSpeed's state-dict load.
    check_model_record({"model_config": (client.get("config") or {}).get("model")}, model, step_dir)

    if same_layout:
        with weights_only_loading(engine):
            load_path, _ = engine.load_checkpoint(str(step_dir.parent), tag=step_dir.name)
        if load_path is None:
            raise CheckpointError(f"{step_dir}: DeepSpeed found no checkpoint files for this rank")
    else:
        load_universal_state(engine, ensure_universal_state(step_dir), tp_group=tp_group)
        counters = {"global_steps": info["step"], "global_samples": 0, "skipped_steps": 0, **client.get("engine", {})}
        for counter, value in counters.items():
            setattr(engine, counter, value)
        scheduler = getattr(engine, "lr_scheduler", None)
        if scheduler is not None and client.get("lr_scheduler"):
            scheduler.load_state_dict(client["lr_scheduler"])

    rng_file = _rng_file(step_dir, _rank())
    if saved.get("world_size") == now["world_size"] and rng_file.is_file():
        restore_rng_state(layout.read_json(rng_file, "RNG state"), model)
    else:
        # Another world size: per-rank generator streams do not map onto the new ranks. Dropout is
        # keyed on (seed, step) and needs only those two, taken from rank 0's record.
        reference, dropout_rng = _rng_file(step_dir, 0), getattr(model, "dropout_rng", None)
        if dropout_rng is not None and reference.is_file():
            recorded = layout.read_json(reference, "RNG state").get("dropout")
            if recorded:
                dropout_rng.seed, dropout_rng.step = recorded["seed"], recorded["step"]
    return LoadedCheckpoint(step_dir, int(info["step"]), client.get("client", {}), resharded=not same_layout)
