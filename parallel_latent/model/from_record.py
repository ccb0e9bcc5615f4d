"""A saved autoencoder's feature model and tokenizer, rebuilt from its checkpoint alone.

A checkpoint (portable, training or save-pretrained directory) holds every weight of the model, the
frozen GPT-2's included, and its record (``LatentAutoencoder.checkpoint_record``): the GPT-2's shape
(``feature_model_architecture``), the tokenizer's facts, and the training config. The record also
says where the GPT-2 and the tokenizer were first loaded from (``feature_model_config.name_or_path``
with ``pretrained: true``, ``config.tokenizer.name_or_path``): a hub id or a path on the machine
that trained it. That is history, not an instruction. A checkpoint received from someone else must
load from itself alone, so nothing here opens what a record names: the GPT-2 is built from its
recorded shape (its weights come from the checkpoint's files), and the tokenizer comes from files
saved in the directory or is the built-in offline GPT-2 BPE. What cannot be had that way is refused
in one line naming the manifest and the key, before anything outside the directory is read; only a
tokenizer the caller names itself (``--tokenizer``, ``tokenizer=``) may come from a path or the hub.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from parallel_latent.config import FeatureModelConfig, TokenizerConfig, build_dataclass, check_section
from parallel_latent.errors import BadInput, CheckpointError, first_line

from .tokenizer import OFFLINE, TOKENIZER_CONFIG_FILE, load_saved_tokenizer, load_tokenizer, tokenizer_facts

__all__ = ["ARCHITECTURE_KEYS", "feature_config_from_record", "tokenizer_from_record"]

ARCHITECTURE_KEYS = ("n_layer", "n_head", "n_embd", "n_positions")
ARCHITECTURE = "feature_model_architecture"


def _recorded_shape(architecture, source: str) -> dict:
    """The GPT-2 shape a record holds, each key checked (one line naming it)."""
    if not isinstance(architecture, dict):
        raise CheckpointError(f"{source}: {ARCHITECTURE}: expected an object of {', '.join(ARCHITECTURE_KEYS)}")
    if unknown := sorted(set(architecture) - set(ARCHITECTURE_KEYS)):
        raise CheckpointError(f"{source}: {ARCHITECTURE}.{unknown[0]}: unknown key")
    if missing := [key for key in ARCHITECTURE_KEYS if key not in architecture]:
        raise CheckpointError(f"{source}: {ARCHITECTURE}.{missing[0]}: missing")
    shape = build_dataclass(FeatureModelConfig, architecture, source, ARCHITECTURE)
    check_section(shape, source, ARCHITECTURE)
    return {key: getattr(shape, key) for key in ARCHITECTURE_KEYS}


def feature_config_from_record(record: dict, source: str) -> FeatureModelConfig:
    """The feature model's config for rebuilding it from ``record`` (a manifest; ``source``: its
    path, for the errors): never ``pretrained``, so that building it reads no path and no hub.

    With the recorded shape, a GPT-2 of that shape (whatever ``feature_model_config`` says it was
    first loaded from: every weight is overwritten by the checkpoint's). Without it (a manifest
    older than the shape, or edited), the ``n_*`` keys of a ``pretrained: false`` config; a
    ``pretrained: true`` one is refused: its shape (the attention heads) is known only to the model
    it names outside the checkpoint."""
    feature_cfg = build_dataclass(FeatureModelConfig, record["feature_model_config"], source, "feature_model_config")
    architecture = record.get(ARCHITECTURE)
    if architecture:
        return dataclasses.replace(feature_cfg, pretrained=False, **_recorded_shape(architecture, source))
    if feature_cfg.pretrained:
        raise CheckpointError(
            f"{source}: feature_model_config.pretrained is true and {ARCHITECTURE} is missing: the GPT-2's "
            f"shape is known only to {feature_cfg.name_or_path!r}, outside this checkpoint, which is not read; "
            f"add {ARCHITECTURE} ({', '.join(ARCHITECTURE_KEYS)}) to the manifest"
        )
    check_section(feature_cfg, source, "feature_model_config")
    return feature_cfg


def _refuse_outside_tokenizer(name: str, source: str) -> CheckpointError:
    return CheckpointError(
        f"{source}: config.tokenizer.name_or_path={name!r} is outside this checkpoint (no tokenizer files in "
        f"it) and is not read; pass a tokenizer (--tokenizer {name}, or tokenizer= in Python), or re-save "
        f"with `parallel-latent save-pretrained --tokenizer {name}`, which stores its files"
    )


def _load(load, what: str, error_type: type[BadInput]):
    """``load()``; a tokenizer that does not load is one line saying ``what`` it is."""
    try:
        return load()
    except BadInput:
        raise
    except (OSError, ValueError, TypeError, KeyError) as error:  # transformers' ways of saying "cannot"
        raise error_type(f"{what}: the tokenizer does not load: {first_line(error)}") from None


def _choose_tokenizer(directory: Path, record: dict, source: str, tokenizer: str | None):
    """(the tokenizer, where it came from)."""
    if tokenizer is not None:  # the caller's own choice: a path or a hub id is theirs to name
        cfg = TokenizerConfig(name_or_path=str(tokenizer))
        return _load(lambda: load_tokenizer(cfg), f"tokenizer {tokenizer}", BadInput), repr(str(tokenizer))
    saved = directory / TOKENIZER_CONFIG_FILE
    if saved.is_file():  # save-pretrained stores the tokenizer's files beside the weights
        loaded = _load(lambda: load_saved_tokenizer(directory), str(saved), CheckpointError)
        return loaded, f"the tokenizer in {directory}"
    section = (record.get("config") or {}).get("tokenizer") or {}
    cfg = build_dataclass(TokenizerConfig, section, source, "config.tokenizer")
    if cfg.name_or_path != OFFLINE:
        raise _refuse_outside_tokenizer(cfg.name_or_path, source)
    return load_tokenizer(cfg), OFFLINE


def tokenizer_from_record(directory: Path, record: dict, source: str, tokenizer: str | None = None):
    """The tokenizer of the checkpoint in ``directory`` whose manifest ``source`` holds ``record``:
    ``tokenizer`` (a name or path the caller gives) if given; else the one saved in the directory
    (``tokenizer_config.json``: save-pretrained); else the built-in offline GPT-2 BPE when the record
    says it was trained with it. A record naming any other tokenizer is refused (see the module's
    docstring). Whichever it is must give the vocabulary size and mask and pad ids recorded."""
    loaded, origin = _choose_tokenizer(Path(directory), record, source, tokenizer)
    saved, facts = record.get("tokenizer") or {}, tokenizer_facts(loaded)
    for key in ("vocab_size", "mask_token_id", "pad_token_id"):
        if key in saved and saved[key] != facts[key]:
            raise CheckpointError(
                f"{source}: tokenizer.{key}={saved[key]} (the tokenizer it was trained with), "
                f"but {origin} gives {facts[key]}"
            )
    return loaded
