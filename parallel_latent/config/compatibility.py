"""What a checkpoint's recorded model config means today, and whether a model can load it.

A checkpoint records the ``model`` section it was trained with. Keys that came to the schema after
some checkpoints were written mean, in those checkpoints, the value the code behaved as before the
key existed (:data:`KEYS_ADDED_LATER`), not today's default; keys that do not shape the weights
(:data:`RUNTIME_ONLY_KEYS`) may differ freely; and a key set to the value its 0 stands for is the
same model as 0. The ``feature_model`` section is compared on the keys that choose the decoder
(:func:`feature_model_difference`): its layout over the TP group may change.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = [
    "KEYS_ADDED_LATER",
    "RUNTIME_ONLY_KEYS",
    "feature_model_difference",
    "model_difference",
    "saved_model_config",
]

# Keys that do not change the weights: a checkpoint loads whatever they are set to.
RUNTIME_ONLY_KEYS: frozenset[str] = frozenset(
    {"dropout", "activation_checkpointing", "init_std", "latent_noise", "feature_norm_samples"}
)
# Keys added after checkpoints were already written, with the value such a checkpoint means.
KEYS_ADDED_LATER: dict[str, Any] = {
    "head": "normal",
    "encoder_context_positions": False,
    "num_latents": 0,
    "latent_dim": 0,
    "predict_length": False,
    "latent_noise": 0.0,
    "feature_norm": "none",
    "feature_norm_samples": 512,
    "feature_window": 1,
}


def saved_model_config(record: dict | None) -> dict:
    """A checkpoint's model config, with the keys it predates filled in."""
    return {**KEYS_ADDED_LATER, **record} if record else {}


def _canonical(values: dict) -> dict:
    """``values`` with num_latents / latent_dim at their default written as 0: the same model."""
    values = dict(values)
    if values.get("num_latents") == values.get("max_length"):
        values["num_latents"] = 0
    if values.get("latent_dim") == values.get("d_model"):
        values["latent_dim"] = 0
    return values


def model_difference(model_cfg: Any, record: dict | None) -> str | None:
    """How the model config a checkpoint records differs from ``model_cfg`` (a ModelConfig) in a key
    that shapes the weights or what the model was trained to do (the first such key), or None."""
    if not record:
        return None
    saved = _canonical(saved_model_config(record))
    current = _canonical(dataclasses.asdict(model_cfg))
    for key in sorted(set(saved) | set(current)):
        if key not in RUNTIME_ONLY_KEYS and saved.get(key) != current.get(key):
            return f"model.{key} is {saved.get(key)!r} in the checkpoint but {current.get(key)!r} in the model"
    return None


# The feature_model keys that choose the decoder (its weights, the features read from it). A built
# decoder is its keys; a loaded one is its files, wherever they are now (``name_or_path`` may move:
# a resume takes the decoder's weights from the checkpoint). ``parallel`` only places the weights.
DECODER_KEYS = ("pretrained", "frozen", "hidden_state", "sink_token_id")
BUILT_DECODER_KEYS = ("architecture", "n_layer", "n_head", "n_embd", "n_positions", "n_kv_head")


def feature_model_difference(feature_cfg: Any, record: dict | None) -> str | None:
    """How the feature_model section a checkpoint records differs from ``feature_cfg`` (a
    FeatureModelConfig) in a key that chooses the decoder (the first such key), or None. A key the
    checkpoint predates means its default (the one decoder there was: a GPT-2, its -3 state)."""
    if not record:
        return None
    saved = {**dataclasses.asdict(type(feature_cfg)()), **record}
    current = dataclasses.asdict(feature_cfg)
    for values in (saved, current):  # 0 kv heads stands for one per head
        values["n_kv_head"] = values["n_kv_head"] or values["n_head"]
    keys = DECODER_KEYS + (() if saved["pretrained"] else BUILT_DECODER_KEYS)
    for key in keys:
        if saved[key] != current[key]:
            return f"feature_model.{key} is {saved[key]!r} in the checkpoint but {current[key]!r} in the config"
    return None
