"""What an export does, checked before anything is built: :func:`plan_export` (the checkpoint's
model, the corpus, the parallel layout and the ``export.*`` settings), and what an output directory
holds (:func:`output_state`: nothing yet, this export partly or wholly, or something else).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from parallel_latent import pretrained
from parallel_latent.checkpoint import PortableCheckpoint, resolve_portable_dir
from parallel_latent.checkpoint.layout import MANIFEST_NAME
from parallel_latent.config import (
    EXPORT_SECTION,
    Config,
    ExportConfig,
    ModelConfig,
    apply_overrides,
    config_from_dict,
    export_config_from_dict,
)
from parallel_latent.errors import require_writable

from .format import FORMAT, IDENTITY_WORDS, INDEX_FILE, RUN_FILE, WORK_DIR, ExportError, read_json

__all__ = ["ExportPlan", "identity_difference", "output_state", "plan_export"]

# The keys of a training config that an export reads; everything else comes from the checkpoint.
OVERRIDABLE = (
    "data.", "parallel.tensor_parallel", "parallel.backend", "training.device", "training.hang_timeout_s",
    "training.hang_long_phase_s", "logging.progress_bar",
)  # fmt: skip


@dataclass
class ExportPlan:
    """An export's settings: the config (the checkpoint's model, the corpus, the parallel layout),
    the ``export.*`` settings, and the checkpoint's portable directory and manifest digest."""

    cfg: Config
    export: ExportConfig
    checkpoint: str  # as given (a path or a hub id)
    directory: Path  # its portable directory
    manifest: dict
    manifest_sha256: str

    @property
    def tensor_parallel(self) -> int:
        return self.cfg.parallel.tensor_parallel


def _split_overrides(overrides: Sequence[str], source: str) -> tuple[list[str], dict]:
    """(training-config overrides, the ``export.*`` values), refusing keys an export does not read."""
    config_overrides, export_values = [], {}
    for override in overrides:
        key, separator, raw = override.partition("=")
        key = key.strip()
        if separator and key.startswith(f"{EXPORT_SECTION}."):
            try:
                export_values[key.removeprefix(f"{EXPORT_SECTION}.")] = yaml.safe_load(raw) if raw.strip() else ""
            except yaml.YAMLError:
                export_values[key.removeprefix(f"{EXPORT_SECTION}.")] = raw
        elif separator and (key.startswith(OVERRIDABLE[0]) or key in OVERRIDABLE[1:]):
            config_overrides.append(override)
        else:
            raise ExportError(
                f"{source}: override {override!r}: an export takes export.*, data.*, "
                + ", ".join(OVERRIDABLE[1:])
                + " (the model comes from the checkpoint)"
            )
    return config_overrides, export_values


def plan_export(
    checkpoint: str | Path, data: str | Path, overrides: Sequence[str] = (), source: str = ""
) -> ExportPlan:
    """The settings of an export of ``data`` through ``checkpoint`` with ``key=value`` overrides;
    ExportError / ConfigError / CheckpointError (one line) when they cannot work. Writes nothing.
    Collective under a process group only when ``checkpoint`` is a hub id (it is downloaded once)."""
    source = source or "encode-corpus"
    directory = resolve_portable_dir(pretrained.pretrained_directory(checkpoint))
    manifest_path = directory / MANIFEST_NAME
    manifest = PortableCheckpoint(directory, verify_checksums=False).manifest
    if not manifest.get("model_config") or not manifest.get("feature_model_config"):
        raise ExportError(f"{directory}: not an autoencoder checkpoint (its manifest records no model config)")
    config_overrides, export_values = _split_overrides(overrides, source)
    saved = manifest.get("config") or {}
    base = {
        "model": ModelConfig.saved(manifest["model_config"]),
        "feature_model": manifest["feature_model_config"],
        "tokenizer": saved.get("tokenizer") or {},
        "data": {"path": str(data)},
    }
    cfg = config_from_dict(apply_overrides(base, config_overrides, source), source)
    export = export_config_from_dict(export_values, source)
    digest = hashlib.sha256(manifest_path.read_bytes()).hexdigest()
    return ExportPlan(cfg, export, str(checkpoint), directory, manifest, digest)


def output_state(out: Path) -> tuple[str, dict | None]:
    """``("new", None)``, ``("partial", identity)`` or ``("complete", identity)`` for an export
    directory; ExportError when ``out`` is a file or a directory holding anything else."""
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out}: --out is a file, expected a directory")
    require_writable(out, "--out")
    if not out.exists():
        return "new", None
    if (out / INDEX_FILE).is_file():
        index = read_json(out / INDEX_FILE)
        if index.get("format") != FORMAT:
            raise ExportError(f"{out}: holds a {INDEX_FILE} that is not a {FORMAT} index; choose another --out")
        return "complete", index.get("identity")
    if (out / WORK_DIR / RUN_FILE).is_file():
        return "partial", read_json(out / WORK_DIR / RUN_FILE)
    others = sorted(p.name for p in out.iterdir() if p.name != WORK_DIR)
    if others:
        raise ExportError(f"{out}: not empty and not an export (holds {others[0]}); choose a new or empty --out")
    return "new", None


def identity_difference(found: dict, wanted: dict) -> str | None:
    """What makes the export found in a directory another one than ``wanted`` (the first key), or None."""
    for key, value in wanted.items():
        if found.get(key) != value:
            return f"{IDENTITY_WORDS.get(key, key)} ({key}: {found.get(key)} there, {value} now)"
    return None
