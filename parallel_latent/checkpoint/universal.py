"""Resharded resume: continue training at another TP x DP (and ZeRO stage) with the optimizer's state.

The bridge between layouts is the *universal* state, stored as shards (:mod:`.shards`): for every
trainable parameter ``p`` its fp32 master ``fp32/<p>`` and the optimizer's per-parameter state
(``exp_avg/<p>`` and ``exp_avg_sq/<p>``, or SGD's ``momentum_buffer/<p>``; whole over DP, split over
TP like the weight), ``state/<name>`` for every frozen tensor, and the optimizer's kind, step and
hyperparameters in the manifest. It is converted from DeepSpeed's files of any ZeRO stage (read by
:mod:`parallel_latent.zero.checkpoint_files`), in one process: by rank 0 when a resume finds another layout, or
by ``parallel-latent reshard``; a resume sets it through :mod:`parallel_latent.zero.params`.
"""

import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from parallel_latent.coordination import broadcast_value, is_main
from parallel_latent.errors import require_writable
from parallel_latent.zero import params as zero_params
from parallel_latent.zero.checkpoint_files import MASTER, read_tp_rank

from . import layout, shards
from .layout import CheckpointError, CheckpointSaveError
from .portable import MODEL_PREFIX, check_model_record

UNIVERSAL_PREFIX = "optim"
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
    require_writable(output, "universal state")
    stage, precision = saved["zero_stage"], saved["precision"]
    if stage == 0 and precision != "fp32":
        raise CheckpointError(f"{step_dir}: converting ZeRO-0 with {precision} is not supported (its master weights)")
    optimizer_class = info.get("optimizer_class", "AdamW")
    moments = zero_params.moments_of(optimizer_class)
    per_rank = [read_tp_rank(step_dir, r, info, moments) for r in range(saved["tensor_parallel"])]

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
    zero_params.ensure_optimizer_state(engine, int(manifest["optimizer"]["step"]))
    with torch.no_grad():
        for name, tensor, place, key in plan:
            if not trainable(tensor):
                zero_params.write_param(tensor, checkpoint.read_block(key, place, tp_rank, tensor.dtype))
                continue
            zero_params.set_master(engine, tensor, checkpoint.read_block(key, place, tp_rank, torch.float32))
            for moment in zero_params.kept_moments(engine, manifest["optimizer"].get("class", "AdamW")):
                value = checkpoint.read_block(saved(moment, name, place), place, tp_rank, torch.float32)
                zero_params.set_moment(engine, tensor, moment, value)
    groups, optimizer = manifest["optimizer"].get("param_groups", []), zero_params.base_optimizer(engine)
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
    require_writable(output, "output directory")
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
