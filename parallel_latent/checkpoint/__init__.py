"""Checkpoints: exact-resume training checkpoints, portable safetensors shards that load at any TP
degree, consolidation, inspection, and resharded resume with the optimizer's state.

The modules import one way (layout, background, shards, integrity, portable, universal, training, saving,
describe) and reach DeepSpeed's files and ZeRO's parameters through :mod:`parallel_latent.zero`;
their commands are in :mod:`parallel_latent.cli.checkpoint`. No model is known here: a model describes
itself (``checkpoint_record``/``checkpoint_mismatch``).
"""

from parallel_latent.zero.checkpoint_files import safe_torch_load

from .describe import inspect_checkpoint as inspect
from .engine_state import load_training_checkpoint, saved_client_state, saved_run_config
from .integrity import checkpoint_damage, move_aside, require_intact, resumable
from .layout import (
    CheckpointError,
    CheckpointSaveError,
    checkpoints_dir,
    discard,
    find_latest_checkpoint,
    list_checkpoints,
    publish,
    read_newest,
    remove_unfinished_saves,
    require_empty_output,
    resolve_checkpoint,
    resolve_portable_dir,
)
from .portable import consolidate, load_portable, save_portable
from .saving import finish_background_save, save_training_checkpoint, start_background_save
from .shards import PortableCheckpoint
from .universal import convert_to_universal

__all__ = [
    "CheckpointError",
    "CheckpointSaveError",
    "PortableCheckpoint",
    "checkpoint_damage",
    "checkpoints_dir",
    "consolidate",
    "convert_to_universal",
    "discard",
    "find_latest_checkpoint",
    "finish_background_save",
    "inspect",
    "list_checkpoints",
    "load_portable",
    "load_training_checkpoint",
    "move_aside",
    "publish",
    "read_newest",
    "remove_unfinished_saves",
    "require_empty_output",
    "require_intact",
    "resolve_checkpoint",
    "resolve_portable_dir",
    "resumable",
    "safe_torch_load",
    "save_portable",
    "save_training_checkpoint",
    "saved_client_state",
    "saved_run_config",
    "start_background_save",
]
