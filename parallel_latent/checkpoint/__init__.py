"""Checkpoints: exact-resume training checkpoints (DeepSpeed + client state, atomic publish),
portable safetensors shards that load at any TP degree, consolidation, inspection, and resharded
resume with the optimizer's moments. See the module docstrings for the on-disk layouts."""

from .describe import inspect_checkpoint, resolve_portable_dir
from .errors import CheckpointError
from .portable import PortableCheckpoint, consolidate, load_autoencoder, load_portable, save_portable
from .reshard import convert_to_universal, load_universal_state, save_universal_state
from .training import (
    LoadedCheckpoint,
    capture_rng_state,
    find_latest_checkpoint,
    list_checkpoints,
    load_training_checkpoint,
    resolve_checkpoint,
    restore_rng_state,
    safe_torch_load,
    save_training_checkpoint,
)

inspect = inspect_checkpoint  # the name docs/CONTRACTS.md uses

__all__ = [
    "CheckpointError",
    "LoadedCheckpoint",
    "PortableCheckpoint",
    "capture_rng_state",
    "consolidate",
    "convert_to_universal",
    "find_latest_checkpoint",
    "inspect",
    "inspect_checkpoint",
    "list_checkpoints",
    "load_autoencoder",
    "load_portable",
    "load_training_checkpoint",
    "load_universal_state",
    "resolve_checkpoint",
    "resolve_portable_dir",
    "restore_rng_state",
    "safe_torch_load",
    "save_portable",
    "save_training_checkpoint",
    "save_universal_state",
]
