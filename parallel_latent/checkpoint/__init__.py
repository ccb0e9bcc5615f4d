"""Checkpoints: exact-resume training checkpoints (DeepSpeed + client state, atomic publish),
portable safetensors shards that load at any TP degree, consolidation, inspection, and resharded
resume with the optimizer's moments. See the module docstrings for the on-disk layouts."""
from .describe import inspect_checkpoint, resolve_portable_dir
from .errors import CheckpointError
from .portable import PortableCheckpoint, consolidate, load_autoencoder, load_portable, save_portable
from .reshard import convert_to_universal, load_universal_state, save_universal_state
from .training import (LoadedCheckpoint, capture_rng_state, find_latest_checkpoint, list_checkpoints,
                       load_training_checkpoint, resolve_checkpoint, restore_rng_state, safe_torch_load,
                       save_training_checkpoint)

inspect = inspect_checkpoint  # the name docs/CONTRACTS.md uses

__all__ = [
    "CheckpointError", "save_portable", "load_portable", "load_autoencoder", "consolidate", "PortableCheckpoint",
    "inspect", "inspect_checkpoint", "resolve_portable_dir", "save_training_checkpoint", "load_training_checkpoint",
    "find_latest_checkpoint", "list_checkpoints", "resolve_checkpoint", "LoadedCheckpoint", "capture_rng_state",
    "restore_rng_state", "safe_torch_load", "save_universal_state", "load_universal_state", "convert_to_universal",
]
