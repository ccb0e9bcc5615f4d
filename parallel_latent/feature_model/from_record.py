"""A saved autoencoder's feature model and tokenizer, rebuilt from its checkpoint alone.

A checkpoint (portable, training or save-pretrained directory) holds every weight of the model, the
frozen feature model's included, and its record (``LatentAutoencoder.checkpoint_record``): that
decoder's family and shape (``feature_model_architecture``), the tokenizer's facts, and the training
config. The record also says where the decoder and the tokenizer were first loaded from
(``feature_model_config.name_or_path`` with ``pretrained: true``,
``config.tokenizer.name_or_path``): a hub id or a path on the machine that trained it. That is
history, not an instruction. A checkpoint received from someone else must load from itself alone, so
nothing here opens what a record names: the decoder is built from its recorded shape or transformers
config (its weights come from the checkpoint's files), and the tokenizer comes from files saved in
the directory or is the built-in offline GPT-2 BPE. What cannot be had that way is refused in one
line naming the manifest and the key, before anything outside the directory is read; only a
tokenizer the caller names itself (``--tokenizer``, ``tokenizer=``) may come from a path or the hub.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from parallel_latent.config import FeatureModelConfig, TokenizerConfig, build_dataclass, check_section
from parallel_latent.errors import BadInput, CheckpointError

from .families import SHAPE_RECORDED
from .features import decoder_signature
from .hub import from_directory_or_hub
from .tokenizer import (
    OFFLINE,
    TOKENIZER_CONFIG_FILE,
    load_saved_tokenizer,
    load_tokenizer,
    tokenizer_facts,
)

__all__ = [
    "ARCHITECTURE_KEYS",
    "feature_config_from_record",
    "loaded_decoder_difference",
    "recorded_feature_model",
    "tokenizer_from_record",
]

ARCHITECTURE_KEYS = ("n_layer", "n_head", "n_embd", "n_positions")
# Other families than the one recorded by its shape alone (SHAPE_RECORDED) record their name and
# their whole transformers config besides the shape.
FAMILY_KEY, TRANSFORMERS_CONFIG = "architecture", "transformers_config"
ARCHITECTURE = "feature_model_architecture"


def _recorded_shape(architecture, source: str, hidden_state: int) -> dict:
    """The decoder's shape (and family) a record holds, each key checked (one line naming it)."""
    if not isinstance(architecture, dict):
        raise CheckpointError(f"{source}: {ARCHITECTURE}: expected an object of {', '.join(ARCHITECTURE_KEYS)}")
    if unknown := sorted(set(architecture) - {*ARCHITECTURE_KEYS, FAMILY_KEY, TRANSFORMERS_CONFIG}):
        raise CheckpointError(f"{source}: {ARCHITECTURE}.{unknown[0]}: unknown key")
    if missing := [key for key in ARCHITECTURE_KEYS if key not in architecture]:
        raise CheckpointError(f"{source}: {ARCHITECTURE}.{missing[0]}: missing")
    family = architecture.get(FAMILY_KEY, SHAPE_RECORDED.name)
    if family != SHAPE_RECORDED.name and not isinstance(architecture.get(TRANSFORMERS_CONFIG), dict):
        raise CheckpointError(f"{source}: {ARCHITECTURE}.{TRANSFORMERS_CONFIG}: missing (a {family} decoder)")
    shape = {key: architecture[key] for key in (*ARCHITECTURE_KEYS, FAMILY_KEY) if key in architecture}
    checked = build_dataclass(FeatureModelConfig, {**shape, "hidden_state": -1}, source, ARCHITECTURE)
    check_section(checked, source, ARCHITECTURE)
    depth = checked.n_layer
    if not -(depth + 1) <= hidden_state <= depth:
        raise CheckpointError(
            f"{source}: {ARCHITECTURE}.n_layer={depth} has no hidden state {hidden_state} "
            "(feature_model_config.hidden_state)"
        )
    return {key: getattr(checked, key) for key in shape}


def recorded_feature_model(record: dict, source: str) -> dict | None:
    """The transformers config ``record`` holds for its feature model (any family but
    :data:`.families.SHAPE_RECORDED`, whose shape alone rebuilds it), or None; one line naming
    ``source`` when it is not one."""
    architecture = record.get(ARCHITECTURE) or {}
    config = architecture.get(TRANSFORMERS_CONFIG) if isinstance(architecture, dict) else None
    if config is not None and not (isinstance(config, dict) and isinstance(config.get("model_type"), str)):
        raise CheckpointError(f"{source}: {ARCHITECTURE}.{TRANSFORMERS_CONFIG}: expected a transformers config")
    return config


def feature_config_from_record(record: dict, source: str) -> FeatureModelConfig:
    """The feature model's config for rebuilding it from ``record`` (a manifest; ``source``: its
    path, for the errors): never ``pretrained``, so that building it reads no path and no hub.

    With the recorded shape, a decoder of that shape (whatever ``feature_model_config`` says it was
    first loaded from: every weight is overwritten by the checkpoint's; a family other than
    :data:`.families.SHAPE_RECORDED` is rebuilt from its recorded transformers config,
    :func:`recorded_feature_model`). Without it (a manifest older than the shape, or edited), the
    ``n_*`` keys of a ``pretrained: false`` config; a ``pretrained: true`` one is refused: its shape
    (the attention heads) is known only to the model it names outside the checkpoint."""
    feature_cfg = build_dataclass(FeatureModelConfig, record["feature_model_config"], source, "feature_model_config")
    architecture = record.get(ARCHITECTURE)
    if architecture:
        shape = _recorded_shape(architecture, source, feature_cfg.hidden_state)
        return dataclasses.replace(feature_cfg, pretrained=False, **shape)
    if feature_cfg.pretrained:
        raise CheckpointError(
            f"{source}: feature_model_config.pretrained is true and {ARCHITECTURE} is missing: the decoder's "
            f"shape is known only to {feature_cfg.name_or_path!r}, outside this checkpoint, which is not read; "
            f"add {ARCHITECTURE} ({', '.join(ARCHITECTURE_KEYS)}) to the manifest"
        )
    check_section(feature_cfg, source, "feature_model_config")
    return feature_cfg


def loaded_decoder_difference(
    feature_cfg: FeatureModelConfig, record: dict, source: str, planned: dict | None = None
) -> str | None:
    """How the pretrained decoder ``feature_cfg`` loads differs from the one the model ``record``
    describes (a checkpoint's model record, ``source`` its file) was trained over, in what makes a
    decoder compute what it computes besides its weights (:func:`.features.decoder_signature`):
    the first difference, or None (also when the record predates the decoder's shape). Their config
    keys are compared beforehand (``FeatureModelConfig.difference``); the files a name points at may
    since hold another decoder. Neither decoder's weights are read; ``planned``: the pretrained
    decoder's config as the job's plan read it (:func:`.features.planned_decoder`)."""
    if not feature_cfg.pretrained or not record.get(ARCHITECTURE):
        return None
    saved_cfg = dataclasses.replace(feature_config_from_record(record, source), hidden_state=feature_cfg.hidden_state)
    saved = decoder_signature(saved_cfg, recorded_feature_model(record, source))
    current = decoder_signature(feature_cfg, planned=planned)
    for key in [*saved, *(key for key in current if key not in saved)]:
        if saved.get(key) != current.get(key):
            return (
                f"feature_model.name_or_path={feature_cfg.name_or_path} is another decoder than the checkpoint's: "
                f"its {key} is {current.get(key, 'absent')}, the checkpoint's {saved.get(key, 'absent')}"
            )
    return None


def _refuse_outside_tokenizer(name: str, source: str) -> CheckpointError:
    return CheckpointError(
        f"{source}: config.tokenizer.name_or_path={name!r} is outside this checkpoint (no tokenizer files in "
        f"it) and is not read; pass a tokenizer (--tokenizer {name}, or tokenizer= in Python), or re-save "
        f"with `parallel-latent save-pretrained --tokenizer {name}`, which stores its files"
    )


def _choose_tokenizer(directory: Path, record: dict, source: str, tokenizer: str | None):
    """(the tokenizer, where it came from)."""
    if tokenizer is not None:  # the caller's own choice: a path or a hub id is theirs to name
        cfg = TokenizerConfig(name_or_path=str(tokenizer))
        return load_tokenizer(cfg, f"tokenizer {tokenizer}", BadInput), repr(str(tokenizer))
    saved = directory / TOKENIZER_CONFIG_FILE
    if saved.is_file():  # save-pretrained stores the tokenizer's files beside the weights
        loaded = from_directory_or_hub(
            lambda: load_saved_tokenizer(directory),
            str(directory),
            str(saved),
            "the tokenizer does not load",
            CheckpointError,
        )
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
