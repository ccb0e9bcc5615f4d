"""The transformers releases this package was written for (:data:`SUPPORTED`, the range
``pyproject.toml`` pins) and every use of transformers' internals, in one place.

The feature model runs transformers' own decoder layers, and sharding them reaches past the public
API. Each of these is transformers' implementation, not its contract, and was written against the
releases in :data:`SUPPORTED`:

- ``PretrainedConfig._attn_implementation``: set to ``"sdpa"`` on a cut decoder's config
  (:func:`use_sdpa`), so attention is SDPA with ``is_causal`` and no mask from the inputs;
- ``transformers.pytorch_utils.Conv1D``: GPT-2's projections (weight [in, out]), split in that
  orientation by the sharded decoder (:data:`Conv1D`);
- GPT-2 attention's ``num_heads``, ``embed_dim`` and ``split_size``: the sizes it cuts ``c_attn``'s
  output by, set to one rank's share (:func:`set_local_gpt2_attention`);
- a decoder layer called as ``layer(hidden, position_ids=..., position_embeddings=...)`` with the
  rotary embeddings of the base model's ``rotary_emb`` (:func:`run_rotary_layers`), and
  ``rotary_emb`` rebuilt from the config when its non-persistent buffers were never loaded
  (:func:`rebuild_rotary`).

Outside the range :func:`require_supported_transformers` is one line (exit status 2) before a
decoder is built. The version is read from the installed distribution's metadata.
"""

from __future__ import annotations

import functools
from importlib import metadata

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.pytorch_utils import Conv1D

from parallel_latent.errors import BadInput, in_release_range, release_range_words

__all__ = [
    "SUPPORTED",
    "Conv1D",
    "TransformersVersionError",
    "rebuild_rotary",
    "require_supported_transformers",
    "run_rotary_layers",
    "set_local_gpt2_attention",
    "supported",
    "use_sdpa",
]

# [first, end): the releases whose internals (above) this code was written against and tested with
# (5.17.0 and 5.25.0).
SUPPORTED = ((5, 17, 0), (5, 26, 0))


class TransformersVersionError(BadInput):
    """The installed transformers is outside the releases whose internals the feature model uses."""


@functools.cache
def installed_version() -> str:
    return metadata.version("transformers")


def supported(version: str | None = None) -> bool:
    """Whether ``version`` (default: the installed transformers') is in :data:`SUPPORTED`."""
    return in_release_range(installed_version() if version is None else version, SUPPORTED)


def require_supported_transformers(version: str | None = None) -> None:
    """Refuse (one line, exit status 2) a transformers whose internals may have changed."""
    version = installed_version() if version is None else version
    if not supported(version):
        words = release_range_words(SUPPORTED)
        raise TransformersVersionError(
            f"transformers {version} is installed; the feature model runs and shards transformers' decoder "
            f"layers through internals written for transformers{words} "
            f"(parallel_latent/feature_model/transformers_api.py): pip install 'transformers{words}'"
        )


def use_sdpa(config: PretrainedConfig) -> None:
    config._attn_implementation = "sdpa"


def set_local_gpt2_attention(attention: nn.Module, heads: int, width: int) -> None:
    """GPT-2's attention cuts ``c_attn``'s output into q, k and v by ``split_size`` (its width):
    on a rank holding ``heads`` of the heads, ``width`` of it."""
    attention.num_heads = heads
    attention.embed_dim = attention.split_size = width


def run_rotary_layers(decoder: nn.Module, layers: nn.ModuleList, hidden: torch.Tensor, positions: torch.Tensor):
    """``hidden`` through ``layers`` of a rotary decoder (Llama, NeoX), with the base model's
    rotary embeddings of ``positions``."""
    position_ids = positions[None]
    rotary = decoder.rotary_emb(hidden, position_ids=position_ids)
    for layer in layers:
        hidden = layer(hidden, position_ids=position_ids, position_embeddings=rotary)
    return hidden


def rebuild_rotary(decoder: nn.Module) -> None:
    """Non-persistent buffers (rotary inverse frequencies) are in no weight file: rebuilt from the
    config (GPT-2 has none)."""
    if hasattr(decoder, "rotary_emb"):
        decoder.rotary_emb = type(decoder.rotary_emb)(config=decoder.config)
