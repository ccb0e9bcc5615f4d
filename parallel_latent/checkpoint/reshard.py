"""Resharded resume: continue training at another TP x DP (and ZeRO stage) with Adam's state.

The bridge between layouts is the *universal* state, a portable checkpoint (same manifest and
safetensors machinery as the model weights) whose tensors are, for every trainable parameter ``p``:

    fp32/<p>        the fp32 master weight        (full over DP, sharded over TP like the weight)
    exp_avg/<p>     Adam's first moment
    exp_avg_sq/<p>  Adam's second moment

and ``state/<name>`` for every frozen parameter and buffer, plus Adam's step count and the param
groups' hyperparameters in the manifest. It can be written two ways:

* live, from a running engine (:func:`save_universal_state`, ``universal=True`` when saving a
  training checkpoint): DeepSpeed's ``safe_get_full_*`` gathers each parameter over DP;
* offline, from DeepSpeed's own files (:func:`convert_to_universal`, ``parallel-latent reshard``):
  ZeRO-0/1/2/3 shards are read with ``weights_only=True`` and reassembled per TP rank.

Loading (:func:`load_universal_state`) cuts each tensor for the new TP rank and writes it into the
new engine's model copy, fp32 master and Adam state through ``safe_set_full_*`` (any ZeRO stage).
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from parallel_latent.parallel.state import get_dp_rank
from parallel_latent.parallel.utils import group_rank, group_size

from .errors import CheckpointError
from .portable import (
    MANIFEST_NAME,
    Entry,
    Placement,
    PortableCheckpoint,
    _barrier,
    _is_global_rank0,
    assemble_manifest,
    check_model_config,
    fsync_directory,
    model_manifest_fields,
    module_tensors,
    placement_of,
    write_json_atomic,
    write_rank_file,
    write_sharded,
)
from .safetensors_io import dtype_from_name
from .zero_access import (
    ADAM_MOMENTS,
    base_optimizer,
    ensure_optimizer_state,
    gathered,
    get_master,
    get_moment,
    get_step,
    set_master,
    set_moment,
    write_param,
)

UNIVERSAL_PREFIX = "optim"
MASTER = "fp32"
FROZEN = "state"
# Param-group keys worth carrying over (the LR itself is re-derived by the scheduler too).
GROUP_KEYS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "initial_lr")


def _trainable(tensor: torch.Tensor) -> bool:
    return isinstance(tensor, nn.Parameter) and tensor.requires_grad


def _json_group(group: dict) -> dict:
    out = {}
    for key in GROUP_KEYS:
        value = group.get(key)
        if torch.is_tensor(value):
            value = value.item()
        if isinstance(value, (int, float, bool, list, tuple)):
            out[key] = list(value) if isinstance(value, tuple) else value
    return out


# --------------------------------------------------------------------------- #
# Live: from and into a running engine.
# --------------------------------------------------------------------------- #


def universal_entries(engine, model: nn.Module, tp_size: int) -> tuple[list[Entry], dict[str, str]]:
    tensors, aliases = module_tensors(model)
    entries = []
    for name, tensor in tensors.items():
        place = placement_of(tensor, tp_size, name)
        if _trainable(tensor):
            entries.append(Entry(f"{MASTER}/{name}", torch.float32, place, lambda t=tensor: get_master(engine, t)))
            for key in ADAM_MOMENTS:
                entries.append(
                    Entry(f"{key}/{name}", torch.float32, place, lambda t=tensor, k=key: get_moment(engine, t, k))
                )
        else:

            def value(t=tensor):
                with gathered([t]):
                    return t.detach().to("cpu", copy=True)

            entries.append(Entry(f"{FROZEN}/{name}", tensor.dtype, place, value))
    return entries, aliases


def save_universal_state(
    engine,
    directory: str | Path,
    *,
    tp_group=None,
    step: int | None = None,
    model=None,
    cfg=None,
    tokenizer_facts: dict | None = None,
) -> Path:
    """Write the universal state of ``engine`` into ``directory`` (must not exist). Collective."""
    from .training import engine_layout

    directory = Path(directory)
    model = model if model is not None else engine.module
    if tp_group is None:
        tp_group = getattr(model, "tp_group", None)
    if _is_global_rank0():
        directory.mkdir(parents=True)
    _barrier()
    entries, aliases = universal_entries(engine, model, group_size(tp_group))
    optimizer = base_optimizer(engine)
    fields = model_manifest_fields(model, cfg, tokenizer_facts, step)
    fields.update(
        contents="optimizer",
        source_layout=engine_layout(engine),
        optimizer={
            "class": type(optimizer).__name__,
            "step": get_step(engine),
            "param_groups": [_json_group(g) for g in optimizer.param_groups],
        },
    )
    write_sharded(
        directory,
        entries,
        prefix=UNIVERSAL_PREFIX,
        tp_group=tp_group,
        is_writer=get_dp_rank() == 0,
        manifest_fields=fields,
        aliases={f"{FROZEN}/{a}": f"{FROZEN}/{t}" for a, t in aliases.items()},
    )
    _barrier()
    return directory


def load_universal_state(engine, directory: str | Path, *, tp_group=None, load_optimizer: bool = True) -> dict:
    """Set ``engine``'s weights, fp32 masters, Adam moments and step from a universal state saved
    at any layout. No collective: each rank reads its own ranges. Returns the manifest."""
    checkpoint = PortableCheckpoint(directory)
    manifest = checkpoint.manifest
    if manifest.get("contents") != "optimizer":
        raise CheckpointError(f"{directory}: not a universal optimizer state (contents={manifest.get('contents')!r})")
    model = engine.module
    if tp_group is None:
        tp_group = getattr(model, "tp_group", None)
    tp_size, tp_rank = group_size(tp_group), group_rank(tp_group)
    check_model_config(checkpoint, model)
    tensors, _ = module_tensors(model)

    def saved(kind: str, name: str, place: Placement) -> str:
        key = f"{kind}/{name}"
        if key not in checkpoint.tensors:
            if kind == FROZEN and f"{MASTER}/{name}" in checkpoint.tensors:
                return f"{MASTER}/{name}"  # trained before, frozen now: its weight is its master
            raise CheckpointError(
                f"{directory}: no {key!r} in the universal state (a different model, or "
                "a parameter that was frozen when it was saved?)"
            )
        if checkpoint.tensors[key]["shape"] != list(place.full_shape):
            raise CheckpointError(
                f"{directory}: {key!r} is {checkpoint.tensors[key]['shape']} in the checkpoint "
                f"but {list(place.full_shape)} in the model (a different model size?)"
            )
        return key

    plan = []
    for name, tensor in tensors.items():
        place = placement_of(tensor, tp_size, name)
        kind = MASTER if _trainable(tensor) else FROZEN
        plan.append((name, tensor, place, saved(kind, name, place)))
    if load_optimizer:
        ensure_optimizer_state(engine, int(manifest["optimizer"]["step"]))
    with torch.no_grad():
        for name, tensor, place, key in plan:
            if not _trainable(tensor):
                write_param(tensor, checkpoint.read_block(key, place, tp_rank, tensor.dtype))
                continue
            set_master(engine, tensor, checkpoint.read_block(key, place, tp_rank, torch.float32))
            if load_optimizer:
                for moment in ADAM_MOMENTS:
                    set_moment(
                        engine,
                        tensor,
                        moment,
                        checkpoint.read_block(saved(moment, name, place), place, tp_rank, torch.float32),
                    )
    if load_optimizer:
        groups = manifest["optimizer"].get("param_groups", [])
        optimizer = base_optimizer(engine)
        if len(groups) == len(optimizer.param_groups):
            for group, saved_group in zip(optimizer.param_groups, groups, strict=True):
                for key, value in saved_group.items():
                    if key in group:
                        group[key] = tuple(value) if isinstance(group[key], tuple) else value
    return manifest


# --------------------------------------------------------------------------- #
# Offline: from DeepSpeed's files.
# --------------------------------------------------------------------------- #


def _optim_file(step_dir: Path, dp_rank: int, mp_rank: int, precision: str) -> Path:
    prefix = "bf16_" if precision == "bf16" else ""
    return step_dir / f"{prefix}zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_optim_states.pt"


def _zero12_tensors(step_dir: Path, mp_rank: int, dp_size: int, precision: str) -> tuple[dict, dict, int, list]:
    """(trainable {name: {fp32, exp_avg, exp_avg_sq}}, lp module state, Adam step, param groups)
    of one TP rank from ZeRO-1/2 files: each DP rank's flat fp32 partition holds a contiguous run of
    fragments; ``param_slice_mappings`` says which parameter each fragment belongs to, in order."""
    from .training import safe_torch_load

    model_states = safe_torch_load(step_dir / f"mp_rank_{mp_rank:02d}_model_states.pt", "cpu")
    shapes = {name: tuple(shape) for group in model_states["param_shapes"] for name, shape in group.items()}
    pieces: dict[str, dict[str, list[torch.Tensor]]] = {
        n: {MASTER: [], **{k: [] for k in ADAM_MOMENTS}} for n in shapes
    }
    step, groups = 0, []
    for dp_rank in range(dp_size):
        sd = safe_torch_load(_optim_file(step_dir, dp_rank, mp_rank, precision), "cpu")["optimizer_state_dict"]
        base = sd["base_optimizer_state"]
        groups = base.get("param_groups", groups)
        for group_index, mapping in enumerate(sd["param_slice_mappings"]):
            flat = {MASTER: sd["single_partition_of_fp32_groups"][group_index]}
            state = base["state"].get(group_index, {})
            for key in ADAM_MOMENTS:
                flat[key] = state.get(key, torch.zeros_like(flat[MASTER]))
            if "step" in state:
                step = int(state["step"].item() if torch.is_tensor(state["step"]) else state["step"])
            for name, address in mapping.items():
                for key, tensor in flat.items():
                    pieces[name][key].append(tensor.narrow(0, address.start, address.numel))
    trainable = {}
    for name, shape in shapes.items():
        trainable[name] = {}
        for key, parts in pieces[name].items():
            flat = torch.cat(parts) if parts else torch.empty(0)
            if flat.numel() != math.prod(shape):
                raise CheckpointError(
                    f"{step_dir}: ZeRO fragments of {name!r} hold {flat.numel()} elements, expected {math.prod(shape)}"
                )
            trainable[name][key] = flat.view(shape).float()
    return trainable, model_states["module"], step, [_json_group(g) for g in groups]


def _zero3_tensors(step_dir: Path, mp_rank: int, dp_size: int, precision: str) -> tuple[dict, dict, int, list]:
    """The same from ZeRO-3 files: every parameter is split into ``ceil(numel / dp)`` pieces, one
    per DP rank (the last padded), and a rank's flat group is its pieces of all parameters in order."""
    from .training import safe_torch_load

    model_states = [
        safe_torch_load(step_dir / f"zero_pp_rank_{r}_mp_rank_{mp_rank:02d}_model_states.pt", "cpu")
        for r in range(dp_size)
    ]
    shapes = {name: tuple(shape) for group in model_states[0]["param_shapes"] for name, shape in group.items()}
    flats: dict[str, list[torch.Tensor]] = {MASTER: [], **{k: [] for k in ADAM_MOMENTS}}
    step, groups = 0, []
    for dp_rank in range(dp_size):
        sd = safe_torch_load(_optim_file(step_dir, dp_rank, mp_rank, precision), "cpu")["optimizer_state_dict"]
        base = sd["optimizer_state_dict"]
        groups = base.get("param_groups", groups)
        fp32_groups = sd["fp32_flat_groups"]
        flats[MASTER].append(torch.cat([g.reshape(-1) for g in fp32_groups]))
        for key in ADAM_MOMENTS:
            flats[key].append(
                torch.cat(
                    [
                        base["state"].get(i, {}).get(key, torch.zeros_like(g)).reshape(-1)
                        for i, g in enumerate(fp32_groups)
                    ]
                )
            )
        first = base["state"].get(0, {})
        if "step" in first:
            step = int(first["step"].item() if torch.is_tensor(first["step"]) else first["step"])
    trainable: dict[str, dict[str, torch.Tensor]] = {name: {} for name in shapes}
    offset = 0
    for name, shape in shapes.items():
        numel = math.prod(shape)
        per_rank = math.ceil(numel / dp_size)
        for key, rank_flats in flats.items():
            whole = torch.cat([f.narrow(0, offset, per_rank) for f in rank_flats])
            trainable[name][key] = whole[:numel].view(shape).float()
        offset += per_rank
    # Frozen parameters are stored as each rank's fragment; buffers whole in every rank's module.
    module = dict(model_states[0]["module"])
    for name, shape in (model_states[0].get("frozen_param_shapes") or {}).items():
        numel = math.prod(shape)
        whole = torch.cat([ms["frozen_param_fragments"][name].reshape(-1) for ms in model_states])
        module[name] = whole[:numel].view(tuple(shape))
    return trainable, module, step, [_json_group(g) for g in groups]


def _zero0_tensors(step_dir: Path, mp_rank: int, names: list[str]) -> tuple[dict, dict, int, list]:
    """ZeRO-0 (fp32): weights and the torch optimizer's state dict sit in the model states file;
    the state is keyed by position in the optimizer, mapped to names recorded at save time."""
    from .training import safe_torch_load

    model_states = safe_torch_load(step_dir / f"mp_rank_{mp_rank:02d}_model_states.pt", "cpu")
    module = model_states["module"]
    optimizer_sd = model_states.get("optimizer") or {}
    state = optimizer_sd.get("state", {})
    order = [i for group in optimizer_sd.get("param_groups", []) for i in group["params"]]
    if len(order) != len(names):
        raise CheckpointError(f"{step_dir}: optimizer holds {len(order)} tensors, {len(names)} names recorded")
    trainable, step = {}, 0
    for index, name in zip(order, names, strict=True):
        entry = state.get(index, {})
        weight = module[name].float()
        trainable[name] = {MASTER: weight, **{k: entry.get(k, torch.zeros_like(weight)).float() for k in ADAM_MOMENTS}}
        if "step" in entry:
            step = int(entry["step"].item() if torch.is_tensor(entry["step"]) else entry["step"])
    return trainable, module, step, [_json_group(g) for g in optimizer_sd.get("param_groups", [])]


def convert_to_universal(step_dir: str | Path, output: str | Path | None = None) -> Path:
    """Build the universal state of a training checkpoint from DeepSpeed's files (one process, no
    process group). Written next to the files as ``universal/`` unless ``output`` is given, under a
    staging name renamed into place when complete."""
    from .training import INFO_FILE, UNIVERSAL_DIR, read_info

    step_dir = Path(step_dir)
    info = read_info(step_dir)
    layout, table = info["layout"], info.get("tensors")
    if not table:
        raise CheckpointError(
            f"{step_dir / INFO_FILE}: no tensor table (saved by an older version); resume it at its own layout"
        )
    tp_size, dp_size = layout["tensor_parallel"], layout["data_parallel"]
    stage, precision = layout["zero_stage"], layout["precision"]
    output = Path(output) if output is not None else step_dir / UNIVERSAL_DIR
    if output.exists():
        raise CheckpointError(f"{output}: already exists")
    staging = output.with_name(f".{output.name}.partial")
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)

    names = list(table)
    per_rank = []
    for mp_rank in range(tp_size):
        if stage == 0:
            if precision != "fp32":
                raise CheckpointError(
                    f"{step_dir}: offline conversion of ZeRO-0 with {precision} is not supported; "
                    "save with universal=True instead"
                )
            per_rank.append(_zero0_tensors(step_dir, mp_rank, info.get("optimizer_param_names", [])))
        elif stage in (1, 2):
            per_rank.append(_zero12_tensors(step_dir, mp_rank, dp_size, precision))
        else:
            per_rank.append(_zero3_tensors(step_dir, mp_rank, dp_size, precision))

    entries_by_rank: list[list[Entry]] = [[] for _ in range(tp_size)]
    for name in names:
        spec = table[name]
        place = Placement(spec["partition_dim"], tuple(spec["local_shape"]), tuple(spec["full_shape"]))
        for mp_rank, (trainable, module, _, _) in enumerate(per_rank):
            if spec["trainable"]:
                if name not in trainable:
                    raise CheckpointError(f"{step_dir}: trainable {name!r} missing from the optimizer files")
                for key in (MASTER, *ADAM_MOMENTS):
                    entries_by_rank[mp_rank].append(
                        Entry(f"{key}/{name}", torch.float32, place, lambda v=trainable[name][key]: v)
                    )
            else:
                if name not in module:
                    raise CheckpointError(f"{step_dir}: frozen tensor {name!r} missing from the model files")
                entries_by_rank[mp_rank].append(
                    Entry(f"{FROZEN}/{name}", dtype_from_name(spec["dtype"]), place, lambda v=module[name]: v)
                )
    parts = [
        write_rank_file(staging, entries, prefix=UNIVERSAL_PREFIX, tp_rank=r, tp_size=tp_size, is_writer=True)
        for r, entries in enumerate(entries_by_rank)
    ]
    client_path = step_dir / "client_state.json"
    client = json.loads(client_path.read_text(encoding="utf-8")) if client_path.is_file() else {}
    config = client.get("config") or {}
    _, _, step, groups = per_rank[0]
    fields = {
        "contents": "optimizer",
        "step": info["step"],
        "model_config": config.get("model"),
        "feature_model_config": config.get("feature_model"),
        "tokenizer": client.get("tokenizer"),
        "config": config or None,
        "source_layout": layout,
        "converted_from": "deepspeed",
        "optimizer": {"class": info.get("optimizer_class", "AdamW"), "step": step, "param_groups": groups},
    }
    aliases = {f"{FROZEN}/{a}": f"{FROZEN}/{t}" for a, t in (info.get("aliases") or {}).items()}
    manifest = assemble_manifest(entries_by_rank[0], parts, tp_size, fields, aliases)
    write_json_atomic(staging / MANIFEST_NAME, manifest)
    fsync_directory(staging)
    os.rename(staging, output)
    fsync_directory(output.parent)
    return output


def ensure_universal_state(step_dir: Path) -> Path:
    """The checkpoint's universal state, converting it from DeepSpeed's files first (rank 0, the
    others wait) when the checkpoint was saved without one. Collective."""
    from .training import UNIVERSAL_DIR

    universal = step_dir / UNIVERSAL_DIR
    failure = None
    if not universal.is_dir() and _is_global_rank0():
        try:
            convert_to_universal(step_dir)
        except CheckpointError as error:
            failure = str(error)
    if dist.is_available() and dist.is_initialized():
        message = [failure]
        dist.broadcast_object_list(message, src=0)
        failure = message[0]
    if failure:
        raise CheckpointError(failure)
    return universal


def tensor_table(model: nn.Module, tp_size: int) -> tuple[dict[str, Any], dict[str, str]]:
    """How each tensor of ``model`` is laid out (recorded in checkpoint.json for offline conversion)."""
    tensors, aliases = module_tensors(model)
    table = {}
    for name, tensor in tensors.items():
        place = placement_of(tensor, tp_size, name)
        table[name] = {
            "partition_dim": place.partition_dim,
            "local_shape": list(place.local_shape),
            "full_shape": list(place.full_shape),
            "dtype": str(tensor.dtype).removeprefix("torch."),
            "trainable": _trainable(tensor),
        }
    return table, aliases
