"""Resharded resume: continue training at another TP x DP (and ZeRO stage) with the optimizer's state.

The bridge between layouts is the *universal* state, stored as shards (:mod:`.shards`): for every
trainable parameter ``p`` its fp32 master ``fp32/<p>`` and the optimizer's per-parameter state
(``exp_avg/<p>`` and ``exp_avg_sq/<p>``, or SGD's ``momentum_buffer/<p>``; whole over DP, split over
TP like the weight), ``state/<name>`` for every frozen tensor, and the optimizer's kind, step and
hyperparameters in the manifest. It is converted from DeepSpeed's files of any ZeRO stage, in one
process: by rank 0 when a resume finds another layout, or by ``parallel-latent reshard``.
"""

import math
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from parallel_latent.coordination import broadcast_value, is_main

from . import layout, shards, zero_access
from .layout import CheckpointError, CheckpointSaveError
from .portable import MODEL_PREFIX, check_model_record

UNIVERSAL_PREFIX = "optim"
MASTER = "fp32"
FROZEN = "state"
# Param-group keys worth carrying over (the LR itself is re-derived by the scheduler too).
GROUP_KEYS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "initial_lr", "momentum", "dampening", "nesterov")


def trainable(tensor: torch.Tensor) -> bool:
    return isinstance(tensor, nn.Parameter) and tensor.requires_grad


def tensor_table(model: nn.Module, tp_size: int) -> tuple[dict[str, Any], dict[str, str]]:
    """How each tensor of ``model`` is laid out (recorded in checkpoint.json for the converter)."""
    tensors, aliases = shards.module_tensors(model)
    table = {name: shards.placement_of(t, tp_size, name).spec() for name, t in tensors.items()}
    for name, t in tensors.items():
        table[name].update(dtype=shards.dtype_name(t.dtype), trainable=trainable(t))
    return table, aliases


def _json_group(group: dict) -> dict:
    """A param group's hyperparameters (GROUP_KEYS) as JSON values."""
    values = {k: v.item() if torch.is_tensor(v) else v for k, v in group.items() if k in GROUP_KEYS}
    return {k: list(v) if isinstance(v, tuple) else v for k, v in values.items() if v is not None}


def _with_state(master: torch.Tensor, state: dict, moments: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """A master and the optimizer's state of it, zeros where there is none (before the first step;
    SGD without momentum)."""
    return {MASTER: master, **{k: torch.zeros_like(master) if state.get(k) is None else state[k] for k in moments}}


def _optimizer_files(step_dir: Path, mp_rank: int, saved: dict):
    """Every DP rank's ZeRO optimizer state, in order."""
    prefix = "bf16_" if saved["precision"] == "bf16" else ""
    for dp_rank in range(saved["data_parallel"]):
        path = step_dir / f"{prefix}zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_optim_states.pt"
        yield zero_access.safe_torch_load(path, "cpu")["optimizer_state_dict"]


def _param_shapes(model_states: dict) -> dict[str, tuple[int, ...]]:
    return {name: tuple(shape) for group in model_states["param_shapes"] for name, shape in group.items()}


def _whole(step_dir: Path, shapes: dict, runs: list[tuple[dict, dict]], moments: tuple[str, ...]) -> dict:
    """Each parameter's master and moments from the flat runs that hold its pieces, in order: a run
    is (flat tensors by key, ``{name: (start, length)}``)."""
    pieces = {name: {key: [] for key in (MASTER, *moments)} for name in shapes}
    for flat, mapping in runs:
        for name, (start, length) in mapping.items():
            for key, tensor in flat.items():
                pieces[name][key].append(tensor.narrow(0, start, length))
    for name, shape in shapes.items():
        for key, parts in pieces[name].items():
            whole = torch.cat(parts) if parts else torch.empty(0)
            if whole.numel() != math.prod(shape):
                raise CheckpointError(
                    f"{step_dir}: ZeRO fragments of {name!r} hold {whole.numel()} elements, expected {math.prod(shape)}"
                )
            pieces[name][key] = whole.view(shape).float()
    return pieces


def _zero12_tensors(step_dir: Path, mp_rank: int, info: dict, moments: tuple[str, ...]):
    """Each DP rank's flat fp32 partition holds a contiguous run of fragments;
    ``param_slice_mappings`` says which parameter each fragment belongs to, in order."""
    model_states = zero_access.safe_torch_load(step_dir / f"mp_rank_{mp_rank:02d}_model_states.pt", "cpu")
    runs, step, groups = [], 0, []
    for sd in _optimizer_files(step_dir, mp_rank, info["layout"]):
        base = sd["base_optimizer_state"]
        groups = base.get("param_groups", groups)
        for index, mapping in enumerate(sd["param_slice_mappings"]):
            state = base["state"].get(index, {})
            step = zero_access.adam_step(state) or step
            flat = _with_state(sd["single_partition_of_fp32_groups"][index], state, moments)
            runs.append((flat, {name: (address.start, address.numel) for name, address in mapping.items()}))
    return _whole(step_dir, _param_shapes(model_states), runs, moments), model_states["module"], step, groups


def _zero3_tensors(step_dir: Path, mp_rank: int, info: dict, moments: tuple[str, ...]):
    """Every parameter is split into ``ceil(numel / dp)`` pieces, one per DP rank (the last
    padded), and a rank's flat group is its pieces of all parameters in order."""
    dp_size = info["layout"]["data_parallel"]
    model_states = [
        zero_access.safe_torch_load(step_dir / f"zero_pp_rank_{r}_mp_rank_{mp_rank:02d}_model_states.pt", "cpu")
        for r in range(dp_size)
    ]
    shapes = _param_shapes(model_states[0])
    runs, step, groups = [], 0, []
    for dp_rank, sd in enumerate(_optimizer_files(step_dir, mp_rank, info["layout"])):
        base = sd["optimizer_state_dict"]
        groups = base.get("param_groups", groups)
        step = zero_access.adam_step(base["state"].get(0, {})) or step
        flats = [
            _with_state(g.reshape(-1), base["state"].get(i, {}), moments) for i, g in enumerate(sd["fp32_flat_groups"])
        ]
        mapping, offset = {}, 0
        for name, shape in shapes.items():
            per_rank = math.ceil(math.prod(shape) / dp_size)
            mapping[name] = (offset, max(0, min(per_rank, math.prod(shape) - dp_rank * per_rank)))  # padding cut
            offset += per_rank
        runs.append(({key: torch.cat([f[key].reshape(-1) for f in flats]) for key in flats[0]}, mapping))
    # Frozen parameters are stored as each rank's fragment; buffers whole in every rank's module.
    module = dict(model_states[0]["module"])
    for name, shape in (model_states[0].get("frozen_param_shapes") or {}).items():
        whole = torch.cat([ms["frozen_param_fragments"][name].reshape(-1) for ms in model_states])
        module[name] = whole[: math.prod(shape)].view(tuple(shape))
    return _whole(step_dir, shapes, runs, moments), module, step, groups


def _zero0_tensors(step_dir: Path, mp_rank: int, info: dict, moments: tuple[str, ...]):
    """ZeRO-0 (fp32): weights and the torch optimizer's state dict sit in the model states file;
    the state is keyed by position in the optimizer, mapped to names recorded at save time."""
    model_states = zero_access.safe_torch_load(step_dir / f"mp_rank_{mp_rank:02d}_model_states.pt", "cpu")
    module, names = model_states["module"], info.get("optimizer_param_names", [])
    optimizer_sd = model_states.get("optimizer") or {}
    order = [i for group in optimizer_sd.get("param_groups", []) for i in group["params"]]
    if len(order) != len(names):
        raise CheckpointError(f"{step_dir}: optimizer holds {len(order)} tensors, {len(names)} names recorded")
    result, step = {}, 0
    for index, name in zip(order, names, strict=True):
        state = optimizer_sd.get("state", {}).get(index, {})
        result[name] = _with_state(module[name].float(), state, moments)
        step = zero_access.adam_step(state) or step
    return result, module, step, optimizer_sd.get("param_groups", [])


def convert_to_universal(step_dir: str | Path, output: str | Path | None = None) -> Path:
    """Build the universal state of a training checkpoint from DeepSpeed's files (one process, no
    process group), as ``universal/`` next to them unless ``output`` is given."""
    step_dir = Path(step_dir)
    info = layout.read_info(step_dir)
    saved, table = info["layout"], info.get("tensors")
    if not table:
        raise CheckpointError(
            f"{step_dir / layout.INFO_FILE}: no tensor table (saved by an older version); resume it at its own layout"
        )
    output = Path(output) if output is not None else step_dir / layout.UNIVERSAL_DIR
    if output.exists():
        raise CheckpointError(f"{output}: already exists")
    stage, precision = saved["zero_stage"], saved["precision"]
    if stage == 0 and precision != "fp32":
        raise CheckpointError(f"{step_dir}: converting ZeRO-0 with {precision} is not supported (its master weights)")
    optimizer_class = info.get("optimizer_class", "AdamW")
    moments = zero_access.moments_of(optimizer_class)
    read = {0: _zero0_tensors, 1: _zero12_tensors, 2: _zero12_tensors, 3: _zero3_tensors}[stage]
    per_rank = [read(step_dir, r, info, moments) for r in range(saved["tensor_parallel"])]

    entries_by_rank: list[list[shards.Entry]] = [[] for _ in per_rank]
    for name, spec in table.items():
        place, kinds = shards.Placement.from_spec(spec), (MASTER, *moments) if spec["trainable"] else (FROZEN,)
        for entries, (weights, module, _, _) in zip(entries_by_rank, per_rank, strict=True):
            for kind in kinds:
                value = weights.get(name, {}).get(kind) if spec["trainable"] else module.get(name)
                if value is None:
                    raise CheckpointError(f"{step_dir}: {name!r} missing from DeepSpeed's files")
                dtype = torch.float32 if spec["trainable"] else shards.dtype_from_name(spec["dtype"])
                entries.append(shards.Entry(f"{kind}/{name}", dtype, place, lambda v=value: v))
    client_file = step_dir / layout.CLIENT_STATE_FILE
    client = layout.read_json(client_file, "client state") if client_file.is_file() else {}
    config = client.get("config") or {}
    _, _, step, groups = per_rank[0]
    # The model's own record; for a checkpoint saved before it was kept, the configs it was built from.
    saved_configs = {"model_config": config.get("model"), "feature_model_config": config.get("feature_model")}
    fields = {
        "contents": "optimizer",
        "step": info["step"],
        **(info.get("model_record") or saved_configs),
        "tokenizer": client.get("tokenizer"),
        "config": config or None,
        "source_layout": saved,
        "converted_from": "deepspeed",
        "optimizer": {"class": optimizer_class, "step": step, "param_groups": list(map(_json_group, groups))},
    }
    aliases = {f"{FROZEN}/{a}": f"{FROZEN}/{t}" for a, t in (info.get("aliases") or {}).items()}
    with layout.staged(output) as staging:
        shards.write_all_ranks(staging, entries_by_rank, UNIVERSAL_PREFIX, fields, aliases)
    return output


def ensure_universal_state(step_dir: Path) -> Path:
    """The checkpoint's universal state, converted from DeepSpeed's files first (by rank 0, the
    others wait over the control group) when the checkpoint has none yet. Collective."""
    universal = step_dir / layout.UNIVERSAL_DIR
    failure = None
    if is_main() and not universal.is_dir():
        try:
            convert_to_universal(step_dir)
        except (CheckpointError, CheckpointSaveError) as error:
            failure = error
    failure = broadcast_value(failure)
    if failure is not None:
        raise failure
    return universal


def load_universal_state(engine, directory: str | Path, *, tp_group=None) -> dict:
    """Set ``engine``'s weights, fp32 masters, optimizer state (Adam's moments and step, SGD's
    momentum) from a universal state saved at any layout. No collective: each rank reads its own
    ranges. Returns the manifest."""
    checkpoint = shards.PortableCheckpoint(directory)
    manifest = checkpoint.manifest
    if manifest.get("contents") != "optimizer":
        raise CheckpointError(f"{directory}: not a universal optimizer state (contents={manifest.get('contents')!r})")
    model = engine.module
    tp_size, tp_rank = shards.tp_size_and_rank(model, tp_group)
    check_model_record(manifest, model, directory)

    def saved(kind: str, name: str, place: shards.Placement) -> str:
        key = f"{kind}/{name}"
        if key not in checkpoint.tensors:
            if kind == FROZEN and f"{MASTER}/{name}" in checkpoint.tensors:
                return f"{MASTER}/{name}"  # trained before, frozen now: its weight is its master
            raise CheckpointError(
                f"{directory}: no {key!r} in the universal state (a different model, or "
                "a parameter that was frozen when it was saved?)"
            )
        checkpoint.check_shape(key, place)
        return key

    plan = []
    for name, tensor in shards.module_tensors(model)[0].items():
        place = shards.placement_of(tensor, tp_size, name)
        plan.append((name, tensor, place, saved(MASTER if trainable(tensor) else FROZEN, name, place)))
    zero_access.ensure_optimizer_state(engine, int(manifest["optimizer"]["step"]))
    with torch.no_grad():
        for name, tensor, place, key in plan:
            if not trainable(tensor):
                zero_access.write_param(tensor, checkpoint.read_block(key, place, tp_rank, tensor.dtype))
                continue
            zero_access.set_master(engine, tensor, checkpoint.read_block(key, place, tp_rank, torch.float32))
            for moment in zero_access.moments_of(manifest["optimizer"].get("class", "AdamW")):
                value = checkpoint.read_block(saved(moment, name, place), place, tp_rank, torch.float32)
                zero_access.set_moment(engine, tensor, moment, value)
    groups, optimizer = manifest["optimizer"].get("param_groups", []), zero_access.base_optimizer(engine)
    if len(groups) == len(optimizer.param_groups):
        for group, kept in zip(optimizer.param_groups, groups, strict=True):
            group.update({k: tuple(v) if isinstance(group[k], tuple) else v for k, v in kept.items() if k in group})
    return manifest


def export_portable(source: str | Path, output: str | Path) -> Path:
    """Write the portable weights of ``source`` (a portable directory, a training checkpoint, or a
    checkpoints directory's ``latest``) to the new directory ``output``: a copy of the ones saved
    with the checkpoint, else made from its universal state (converted into a temporary directory
    if needed, so the checkpoint is left as it is), the trained weights being the fp32 masters."""
    source, output = Path(source), Path(output)
    if output.exists():
        raise CheckpointError(f"{output}: already exists; not overwriting")
    step_dir = None if (source / layout.MANIFEST_NAME).is_file() else layout.resolve_checkpoint(source)
    if step_dir is None or (step_dir / layout.PORTABLE_DIR / layout.MANIFEST_NAME).is_file():
        portable = shards.PortableCheckpoint(layout.resolve_portable_dir(source))  # validated before copying
        with layout.staged(output) as staging:
            shutil.copytree(portable.directory, staging, dirs_exist_ok=True)
        return output
    info = layout.read_info(step_dir)  # its tensor table is there: convert_to_universal refuses one without
    if (step_dir / layout.UNIVERSAL_DIR / layout.MANIFEST_NAME).is_file():
        return _model_from_universal(step_dir / layout.UNIVERSAL_DIR, info, output)
    with tempfile.TemporaryDirectory(dir=output.parent, prefix=f".{output.name}.universal-") as scratch:
        return _model_from_universal(convert_to_universal(step_dir, Path(scratch) / layout.UNIVERSAL_DIR), info, output)


def _model_from_universal(universal_dir: Path, info: dict, output: Path) -> Path:
    universal = shards.PortableCheckpoint(universal_dir)

    def entry(name: str, spec: dict, tp_rank: int) -> shards.Entry:
        place, dtype = shards.Placement.from_spec(spec), shards.dtype_from_name(spec["dtype"])
        key = f"{MASTER if spec['trainable'] else FROZEN}/{name}"
        return shards.Entry(name, dtype, place, lambda: universal.read_block(key, place, tp_rank, dtype))

    tensors = info["tensors"].items()
    entries_by_rank = [[entry(n, spec, r) for n, spec in tensors] for r in range(universal.manifest["tp_size"])]
    dropped = (*shards.WRITER_KEYS, "optimizer", "source_layout", "converted_from")
    fields = {k: v for k, v in universal.manifest.items() if k not in dropped}
    fields.update(contents="model", step=info["step"])
    aliases = {a.removeprefix(f"{FROZEN}/"): t.removeprefix(f"{FROZEN}/") for a, t in universal.aliases.items()}
    with layout.staged(output) as staging:
        shards.write_all_ranks(staging, entries_by_rank, MODEL_PREFIX, fields, aliases)
    return output
