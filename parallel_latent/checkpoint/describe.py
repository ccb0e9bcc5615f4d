"""``parallel-latent inspect``: what a checkpoint holds, for a portable or a training checkpoint."""

import math
from pathlib import Path

from . import layout
from .shards import PortableCheckpoint


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _settings(title: str, config: dict | None) -> list[str]:
    return [f"{title}: " + ", ".join(f"{k}={v}" for k, v in config.items())] if config else []


def _split(partition_dim: int | None) -> str:
    return "replicated" if partition_dim is None else f"split dim {partition_dim}"


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]], max_rows: int | None) -> list[str]:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    shown = rows if max_rows is None else rows[:max_rows]
    lines = ["  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in [header, *shown]]
    return lines + ([f"  ... {len(rows) - len(shown)} more"] if len(shown) < len(rows) else [])


def describe_portable(directory: Path, max_rows: int | None = None) -> list[str]:
    checkpoint = PortableCheckpoint(directory, verify_checksums=False)
    manifest, tensors = checkpoint.manifest, checkpoint.tensors
    lines = [
        f"portable checkpoint: {directory}",
        f"contents: {manifest.get('contents', 'model')}, TP degree {manifest['tp_size']}, "
        f"step {manifest.get('step')}, format v{manifest['format_version']}",
        *_settings("model", manifest.get("model_config")),
        *_settings("feature model", manifest.get("feature_model_config")),
        *_settings("tokenizer", manifest.get("tokenizer")),
    ]
    if optimizer := manifest.get("optimizer"):
        groups = len(optimizer.get("param_groups", []))
        lines.append(f"optimizer: {optimizer.get('class')} at step {optimizer.get('step')}, {groups} param group(s)")
    files = manifest["files"]
    lines.append(f"files: {len(files)}, {_size(sum(info['bytes'] for info in files.values()))}")
    lines += [f"  {name}  {_size(info['bytes'])}" for name, info in files.items()]
    elements = sum(math.prod(info["shape"]) for info in tensors.values())
    aliases = f" ({len(checkpoint.aliases)} aliases)" if checkpoint.aliases else ""
    lines.append(f"tensors: {len(tensors)}, {elements:,} elements{aliases}")
    rows = [
        (n, "x".join(map(str, i["shape"])) or "scalar", i["dtype"], _split(i["partition_dim"]), str(len(i["shards"])))
        for n, i in tensors.items()
    ]
    return lines + _table(("name", "shape", "dtype", "partition", "shards"), rows, max_rows)


def describe_training(step_dir: Path, max_rows: int | None = None) -> list[str]:
    info = layout.read_info(step_dir)
    saved = info["layout"]
    lines = [
        f"training checkpoint: {step_dir}",
        f"step {info['step']}, saved {info.get('saved_at', '?')} with DeepSpeed {info.get('deepspeed_version', '?')}",
        f"layout: TP={saved['tensor_parallel']} x DP={saved['data_parallel']} (world {saved['world_size']}), "
        f"ZeRO stage {saved['zero_stage']}, {saved['precision']}",
    ]
    if (step_dir / layout.CLIENT_STATE_FILE).is_file():
        client = layout.read_json(step_dir / layout.CLIENT_STATE_FILE, "client state")
        engine = client.get("engine") or {}
        scalars = {k: v for k, v in (client.get("client") or {}).items() if isinstance(v, (int, float, str, bool))}
        lines += _settings("model", (client.get("config") or {}).get("model"))
        lines += _settings("tokenizer", client.get("tokenizer"))
        lines += _settings("engine", {k: engine.get(k) for k in ("global_steps", "global_samples", "skipped_steps")})
        lines += _settings("client state", scalars)
    deepspeed_files = sorted(p for p in step_dir.iterdir() if p.is_file() and p.suffix == ".pt")
    lines.append(f"DeepSpeed files: {len(deepspeed_files)}, {_size(sum(p.stat().st_size for p in deepspeed_files))}")
    lines += [f"  {path.name}  {_size(path.stat().st_size)}" for path in deepspeed_files]
    lines.append(f"total on disk: {_size(sum(p.stat().st_size for p in step_dir.rglob('*') if p.is_file()))}")
    for sub in (layout.PORTABLE_DIR, layout.UNIVERSAL_DIR):
        if (step_dir / sub / layout.MANIFEST_NAME).is_file():
            lines += ["", *describe_portable(step_dir / sub, max_rows)]
    table = info.get("tensors")
    if table and not (step_dir / layout.PORTABLE_DIR / layout.MANIFEST_NAME).is_file():
        lines.append(f"tensors (from {layout.INFO_FILE}): {len(table)}")
        rows = [
            (name, "x".join(map(str, s["full_shape"])), s["dtype"], _split(s["partition_dim"]), str(s["trainable"]))
            for name, s in table.items()
        ]
        lines += _table(("name", "shape", "dtype", "partition", "trained"), rows, max_rows)
    return lines


def inspect_checkpoint(path: str | Path, max_rows: int | None = None) -> str:
    """A human-readable summary of a portable directory, a training checkpoint, or a checkpoints
    directory (its ``latest``)."""
    path = Path(path)
    if (path / layout.MANIFEST_NAME).is_file():
        return "\n".join(describe_portable(path, max_rows))
    return "\n".join(describe_training(layout.resolve_checkpoint(path), max_rows))
