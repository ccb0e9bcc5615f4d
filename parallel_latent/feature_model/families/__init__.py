"""The decoder families a feature model can come from: one file each (its config mapping, its layers,
how they run, its tensor-parallel plan, what it refuses), registered here.

- ``gpt2`` (:mod:`.gpt2`): learned positions added to the token embeddings;
- ``gpt_neox`` (:mod:`.gpt_neox`, Pythia): rotary positions over part of each head;
- ``llama`` (:mod:`.llama`: Llama, Mistral, Qwen2, Qwen3): rotary positions, RMSNorm, gated MLP,
  grouped-query attention.

What a family is, and what the rest of the package asks of it: :mod:`.family`. Adding one is a file
here with a :class:`Family` subclass, its name in :data:`FAMILIES` and in ``feature_model.architecture``'s
choices, and its tests (docs/feature_models.md, "Adding a family").
"""

from __future__ import annotations

from transformers import AutoConfig, PretrainedConfig

from ..hub import from_directory_or_hub
from ..packaged import local_decoder
from .family import COLUMN, ROW, Family
from .gpt2 import GPT2
from .gpt_neox import GPTNeoX
from .llama import Llama

__all__ = [
    "COLUMN",
    "FAMILIES",
    "ROW",
    "SHAPE_RECORDED",
    "Family",
    "family_of",
    "held_layers",
    "load_config",
    "supported_families",
]

FAMILIES: dict[str, Family] = {family.name: family for family in (GPT2(), GPTNeoX(), Llama())}
# The family of a checkpoint record that names none: the one recorded by its shape alone.
(SHAPE_RECORDED,) = [family for family in FAMILIES.values() if family.records_shape_alone]


def supported_families() -> str:
    return "; ".join(f"{name} ({', '.join(family.model_types)})" for name, family in FAMILIES.items())


def family_of(config: PretrainedConfig, where: str) -> Family:
    """The family whose layout ``config`` (a loaded ``config.json``) has; one line naming ``where``
    it came from and the supported ones otherwise (an encoder-decoder, an encoder, another decoder)."""
    model_type = getattr(config, "model_type", "")
    for family in FAMILIES.values():
        if model_type in family.model_types:
            if getattr(config, "is_encoder_decoder", False):
                break
            return family
    kind = "an encoder-decoder model" if getattr(config, "is_encoder_decoder", False) else f"model_type {model_type!r}"
    raise ValueError(
        f"{where} is {kind}, not a supported decoder family: the feature model is a decoder-only causal LM "
        f"of one of {supported_families()}"
    )


def held_layers(depth: int, index: int, family: Family, where: str) -> int:
    """How many layers hidden state ``index`` of a ``depth``-layer decoder needs (see :mod:`.family`);
    one line naming ``where`` the index came from when that hidden state does not exist."""
    if not -(depth + 1) <= index <= depth:
        raise ValueError(
            f"{where}: hidden state {index} does not exist in a {depth}-layer {family.title} "
            f"(its {depth + 1} hidden states are 0 to {depth}, or {-(depth + 1)} to -1)"
        )
    return index % (depth + 1)


def load_config(name_or_path: str, where: str) -> PretrainedConfig:
    """A decoder's ``config.json`` by hub name or local directory (no weights read); one line
    starting with ``where`` when it cannot be had."""
    local = local_decoder(name_or_path, where)
    return from_directory_or_hub(
        lambda: AutoConfig.from_pretrained(local, trust_remote_code=False), local, where,
        "its config.json does not load",
    )  # fmt: skip
