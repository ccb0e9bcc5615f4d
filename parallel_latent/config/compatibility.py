"""What a checkpoint's recorded model config means today, and whether a model can load it.

A checkpoint records the ``model`` section it was trained with. Keys that came to the schema after
some checkpoints were written mean, in those checkpoints, the value the code behaved as before the
key existed (:data:`KEYS_ADDED_LATER`), not today's default; keys that do not shape the weights
(:data:`RUNTIME_ONLY_KEYS`) may differ freely; and a key set to the value its 0 stands for is the
same model as 0.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["KEYS_ADDED_LATER", "RUNTIME_ONLY_KEYS", "model_difference", "saved_model_config"]

# Keys that do not change the weights: a checkpoint loads whatever they are set to.
RUNTIME_ONLY_KEYS: frozenset[str] = frozenset({"dropout", "activation_checkpointing", "init_std", "latent_noise"})
# Keys added after checkpoints were already written, with the value such a checkpoint means.
KEYS_ADDED_LATER: dict[str, Any] = {
    "head": "normal",
    "encoder_context_positions": False,
    "num_latents": 0,
    "latent_dim": 0,
    "predict_length": False,
    "latent_noise": 0.0,
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
