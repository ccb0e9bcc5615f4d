"""Checkpoints: exact-resume training checkpoints, portable safetensors shards that load at any TP
degree, consolidation, inspection, and resharded resume with the optimizer's state.

The modules import one way (layout, zero_access, shards, portable, universal, training, describe,
cli). No model is known here: a model describes itself (``checkpoint_record``/``checkpoint_mismatch``).
"""

from .describe import inspect_checkpoint
from .layout import (
    CheckpointError,
    CheckpointSaveError,
    checkpoints_dir,
    discard,
    find_latest_checkpoint,
    list_checkpoints,
    publish,
    remove_unfinished_saves,
    require_empty_output,
    resolve_checkpoint,
    resolve_portable_dir,
)
from .portable import consolidate, load_portable, save_portable
from .shards import PortableCheckpoint
from .training import (
    LoadedCheckpoint,
    capture_rng_state,
    load_training_checkpoint,
    restore_rng_state,
    save_training_checkpoint,
    saved_client_state,
)
from .universal import convert_to_universal, export_portable, load_universal_state
from .zero_access import safe_torch_load

inspect = inspect_checkpoint  # the name docs/CONTRACTS.md uses

__all__ = [
    "CheckpointError",
    "CheckpointSaveError",
    "LoadedCheckpoint",
    "PortableCheckpoint",
    "capture_rng_state",
    "checkpoints_dir",
    "consolidate",
    "convert_to_universal",
    "discard",
    "export_portable",
    "find_latest_checkpoint",
    "inspect",
    "inspect_checkpoint",
    "list_checkpoints",
    "load_portable",
    "load_training_checkpoint",
    "load_universal_state",
    "publish",
    "remove_unfinished_saves",
    "require_empty_output",
    "resolve_checkpoint",
    "resolve_portable_dir",
    "restore_rng_state",
    "safe_torch_load",
    "save_portable",
    "save_training_checkpoint",
    "saved_client_state",
]
