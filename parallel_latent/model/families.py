"""The decoder families a feature model can come from, and how each runs up to one hidden state.

A family is the layout ``transformers`` gives a base decoder (where its token table, layers and final
norm live, how positions enter). Three cover the decoders people use as encoders today:

- ``gpt2``: learned positions added to the token embeddings (``wte``, ``wpe``, ``h``, ``ln_f``);
- ``gpt_neox`` (Pythia): rotary positions (``embed_in``, ``layers``, ``final_layer_norm``);
- ``llama`` (Llama, Mistral, Qwen2, Qwen3): rotary positions, RMSNorm, gated MLP, grouped-query
  attention (``embed_tokens``, ``layers``, ``norm``).

``hidden_states`` of an ``n``-layer decoder has ``n + 1`` entries: entry ``i < n`` is the residual
stream after the first ``i`` layers, entry ``n`` (-1) the last layer's output with the final norm
applied. Index ``i`` therefore needs only the first ``i`` layers (``held_layers``), and the norm only
for the last entry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AutoConfig, GPT2Config, GPTNeoXConfig, LlamaConfig, PretrainedConfig

from .packaged import local_decoder
from .tokenizer import from_directory_or_hub
from .transformers_api import run_rotary_layers

__all__ = ["FAMILIES", "Family", "family_of", "held_layers", "supported_families"]


@dataclass(frozen=True)
class Family:
    name: str
    title: str  # how people write it
    model_types: tuple[str, ...]  # transformers' ``model_type`` values laid out this way
    embedding: str  # attribute of the base model holding the token table
    layers: str
    final_norm: str
    layers_key: str  # the config key of the depth
    heads_key: str
    width_key: str
    positions_key: str
    no_dropout: dict  # config keys that turn the family's dropout off
    random_config: Callable[..., PretrainedConfig]

    def depth(self, config: PretrainedConfig) -> int:
        return getattr(config, self.layers_key)

    def unreproduced(self, config: PretrainedConfig, length: int) -> str | None:
        """A field of ``config`` that changes the decoder's computation over ``length`` tokens in a
        way :meth:`run_layers` does not reproduce, said as the one line's reason, or None."""
        window = getattr(config, "sliding_window", None)
        layer_types = getattr(config, "layer_types", None) or ()
        slides = window is not None and (not layer_types or "sliding_attention" in layer_types)
        if slides and window < length:
            return (
                f"has sliding_window={window} (each token attends to the last {window} only), shorter than "
                f"model.max_length={length}: the feature model runs full causal attention, which would give "
                f"other features from position {window} on"
            )
        return None

    def mlp_width(self, config: PretrainedConfig) -> int:
        """The MLP's inner width (GPT-2: ``n_inner``, unset for 4x the width)."""
        if self.name == "gpt2":
            return config.n_inner or 4 * config.n_embd
        return config.intermediate_size

    def embed(self, decoder: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The residual stream entering layer 0."""
        hidden = getattr(decoder, self.embedding)(input_ids)
        if self.name == "gpt2":
            return decoder.drop(hidden + decoder.wpe(positions))
        return getattr(decoder, "emb_dropout", nn.Identity())(hidden)

    def run_layers(self, decoder: nn.Module, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``hidden`` through every held layer. No attention mask: the layers are causal, so a real
        token never attends to the right padding after it (only pad positions' features change, and
        the encoder masks those out), and attention is SDPA with ``is_causal``, free to pick its
        fastest kernel, with no mask derived from the inputs on the host."""
        layers = getattr(decoder, self.layers)
        if self.name == "gpt2":
            for layer in layers:
                hidden = layer(hidden)
            return hidden
        return run_rotary_layers(decoder, layers, hidden, positions)


def _gpt2_config(vocab_size, n_layer, n_head, n_embd, n_positions, n_kv_head) -> GPT2Config:
    eos = 50256 if vocab_size > 50256 else None  # GPT-2's end of text; keeps transformers' checks quiet
    return GPT2Config(
        vocab_size=vocab_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd, n_positions=n_positions,
        bos_token_id=eos, eos_token_id=eos,
    )  # fmt: skip


def _gpt_neox_config(vocab_size, n_layer, n_head, n_embd, n_positions, n_kv_head) -> GPTNeoXConfig:
    return GPTNeoXConfig(
        vocab_size=vocab_size, num_hidden_layers=n_layer, num_attention_heads=n_head, hidden_size=n_embd,
        intermediate_size=4 * n_embd, max_position_embeddings=n_positions, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip


def _llama_config(vocab_size, n_layer, n_head, n_embd, n_positions, n_kv_head) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size, num_hidden_layers=n_layer, num_attention_heads=n_head, hidden_size=n_embd,
        num_key_value_heads=n_kv_head or n_head, intermediate_size=4 * n_embd, max_position_embeddings=n_positions,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip


# GPT-2's own dropout (and the others') draws from torch's stateful RNG, which differs across TP ranks
# and would make a trainable feature model drift apart across them; our dropout lives in the Perceiver.
FAMILIES = {
    family.name: family
    for family in (
        Family(
            "gpt2", "GPT-2", ("gpt2",), "wte", "h", "ln_f", "n_layer", "n_head", "n_embd", "n_positions",
            {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}, _gpt2_config,
        ),
        Family(
            "gpt_neox", "GPT-NeoX", ("gpt_neox",), "embed_in", "layers", "final_layer_norm", "num_hidden_layers",
            "num_attention_heads", "hidden_size", "max_position_embeddings",
            {"hidden_dropout": 0.0, "attention_dropout": 0.0}, _gpt_neox_config,
        ),
        Family(
            "llama", "Llama", ("llama", "mistral", "qwen2", "qwen3"), "embed_tokens", "layers", "norm",
            "num_hidden_layers", "num_attention_heads", "hidden_size", "max_position_embeddings",
            {"attention_dropout": 0.0}, _llama_config,
        ),
    )
}  # fmt: skip


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
    """How many layers hidden state ``index`` of a ``depth``-layer decoder needs (see the module's
    docstring); one line naming ``where`` the index came from when that hidden state does not exist."""
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
