"""``parallel-latent inspect``: what a checkpoint holds, for a portable or a training checkpoint."""

from __future__ import annotations

import math
from pathlib import Path

from .layout import (
    CLIENT_STATE_FILE,
    INFO_FILE,
    MANIFEST_NAME,
    PORTABLE_DIR,
    UNIVERSAL_DIR,
    read_info,
    read_json,
    resolve_checkpoint,
)
from .shards import PortableCheckpoint


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _config_lines(title: str, config: dict | None) -> list[str]:
    if not config:
        return []
    items = ", ".join(f"{k}={v}" for k, v in config.items())
    return [f"{title}: {items}"]


def describe_portable(directory: Path, max_rows: int | None = None) -> list[str]:
    checkpoint = PortableCheckpoint(directory, verify_checksums=False)
    manifest = checkpoint.manifest
    lines = [
        f"portable checkpoint: {directory}",
        f"contents: {manifest.get('contents', 'model')}, TP degree {manifest['tp_size']}, "
        f"step {manifest.get('step')}, format v{manifest['format_version']}",
    ]
    lines += _config_lines("model", manifest.get("model_config"))
    lines += _config_lines("feature model", manifest.get("feature_model_config"))
    lines += _config_lines("tokenizer", manifest.get("tokenizer"))
    if manifest.get("optimizer"):
        optimizer = manifest["optimizer"]
        lines.append(
            f"optimizer: {optimizer.get('class')} at step {optimizer.get('step')}, "
            f"{len(optimizer.get('param_groups', []))} param group(s)"
        )
    total_bytes = sum(info["bytes"] for info in manifest["files"].values())
    lines.append(f"files: {len(manifest['files'])}, {_size(total_bytes)}")
    for name, info in manifest["files"].items():
        lines.append(f"  {name}  {_size(info['bytes'])}")
    rows = []
    numel_total = 0
    for name, info in checkpoint.tensors.items():
        numel = math.prod(info["shape"])
        numel_total += numel
        split = "replicated" if info["partition_dim"] is None else f"split dim {info['partition_dim']}"
        rows.append(
            (name, "x".join(map(str, info["shape"])) or "scalar", info["dtype"], split, str(len(info["shards"])))
        )
    lines.append(
        f"tensors: {len(rows)}, {numel_total:,} elements"
        + (f" ({len(checkpoint.aliases)} aliases)" if checkpoint.aliases else "")
    )
    widths = [max(len(r[i]) for r in rows + [("name", "shape", "dtype", "partition", "shards")]) for i in range(5)]
    header = ("name", "shape", "dtype", "partition", "shards")
    lines.append("  " + "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
    shown = rows if max_rows is None else rows[:max_rows]
    for row in shown:
        lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))
    if len(shown) < len(rows):
        lines.append(f"  ... {len(rows) - len(shown)} more")
    return lines


def describe_training(step_dir: Path, max_rows: int | None = None) -> list[str]:
    info = read_info(step_dir)
    layout = info["layout"]
    lines = [
        f"training checkpoint: {step_dir}",
        f"step {info['step']}, saved {info.get('saved_at', '?')} with DeepSpeed {info.get('deepspeed_version', '?')}",
        f"layout: TP={layout['tensor_parallel']} x DP={layout['data_parallel']} (world {layout['world_size']}), "
        f"ZeRO stage {layout['zero_stage']}, {layout['precision']}",
    ]
    client_path = step_dir / CLIENT_STATE_FILE
    if client_path.is_file():
        client = read_json(client_path, "client state")
        config = client.get("config") or {}
        lines += _config_lines("model", config.get("model"))
        lines += _config_lines("tokenizer", client.get("tokenizer"))
        engine = client.get("engine") or {}
        lines.append(
            f"engine: global_steps={engine.get('global_steps')}, global_samples={engine.get('global_samples')}, "
            f"skipped_steps={engine.get('skipped_steps')}"
        )
        scalars = {k: v for k, v in (client.get("client") or {}).items() if isinstance(v, (int, float, str, bool))}
        if scalars:
            lines.append("client state: " + ", ".join(f"{k}={v}" for k, v in scalars.items()))
    deepspeed_files = sorted(p for p in step_dir.iterdir() if p.is_file() and p.suffix == ".pt")
    lines.append(f"DeepSpeed files: {len(deepspeed_files)}, {_size(sum(p.stat().st_size for p in deepspeed_files))}")
    for path in deepspeed_files:
        lines.append(f"  {path.name}  {_size(path.stat().st_size)}")
    lines.append(f"total on disk: {_size(_tree_bytes(step_dir))}")
    for sub in (PORTABLE_DIR, UNIVERSAL_DIR):
        if (step_dir / sub / MANIFEST_NAME).is_file():
            lines.append("")
            lines += describe_portable(step_dir / sub, max_rows)
    table = info.get("tensors")
    if table and not (step_dir / PORTABLE_DIR / MANIFEST_NAME).is_file():
        lines.append(f"tensors (from {INFO_FILE}): {len(table)}")
        for name, spec in list(table.items())[:max_rows]:
            split = "replicated" if spec["partition_dim"] is None else f"split dim {spec['partition_dim']}"
            lines.append(
                f"  {name}  {'x'.join(map(str, spec['full_shape']))}  {spec['dtype']}  {split}"
                f"{'' if spec['trainable'] else '  frozen'}"
            )
    return lines


def inspect_checkpoint(path: str | Path, max_rows: int | None = None) -> str:
    """A human-readable summary of a portable directory, a training checkpoint, or a checkpoints
    directory (its ``latest``)."""
    path = Path(path)
    if (path / MANIFEST_NAME).is_file():
        return "\n".join(describe_portable(path, max_rows))
    return "\n".join(describe_training(resolve_checkpoint(path), max_rows))
