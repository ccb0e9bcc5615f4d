"""What the package asks of a decoder family: :class:`Family`, which each file beside this one fills in.

A family is the layout ``transformers`` gives a base decoder (where its token table, layers and final
norm live, how positions enter) and what the package needs to run it up to one hidden state and to
split it over a tensor-parallel group. The feature model (:mod:`..features`), the sharded decoder
(:mod:`..sharded`), checkpoints and model cards ask the family; none of them names one.

``hidden_states`` of an ``n``-layer decoder has ``n + 1`` entries: entry ``i < n`` is the residual
stream after the first ``i`` layers, entry ``n`` (-1) the last layer's output with the final norm
applied. Index ``i`` therefore needs only the first ``i`` layers, and the norm only for the last entry.

Its tensor-parallel plan (Megatron's layout, :mod:`..sharded`): the projections of a layer into
attention heads and into the MLP split by output features (:data:`COLUMN`), those back into the
residual stream by input features (:data:`ROW`), as slices of the transformers weight that hold whole
heads; a projection whose output is several tensors side by side, each split alike, has a partition
stride (GPT-2's ``c_attn``: q of all heads, then k, then v).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn
from transformers import PretrainedConfig

from ..transformers_api import run_rotary_layers

__all__ = ["COLUMN", "ROW", "Family"]

# How a projection is split: by output features (column) or input features (row); also the
# partition dim of an nn.Linear weight [out, in] (a Conv1D's, [in, out], is the other one).
COLUMN, ROW = 0, 1


class Family:
    """A decoder family. A subclass sets the class attributes and overrides what its layout does
    otherwise than the default (a rotary decoder whose layers ``transformers`` runs by position)."""

    name: ClassVar[str]  # the config's ``feature_model.architecture`` value and the checkpoint key prefix
    title: ClassVar[str]  # how people write it
    model_types: ClassVar[tuple[str, ...]]  # transformers' ``model_type`` values laid out this way
    embedding: ClassVar[str]  # attribute of the base model holding the token table
    layers: ClassVar[str]
    final_norm: ClassVar[str]
    layers_key: ClassVar[str]  # the config key of the depth
    heads_key: ClassVar[str]
    width_key: ClassVar[str]
    positions_key: ClassVar[str]
    mlp_key: ClassVar[str] = "intermediate_size"
    config_class: ClassVar[type[PretrainedConfig]]  # transformers' config of a random build
    # Config keys that turn the family's dropout off: it draws from torch's stateful RNG, which
    # differs across TP ranks and would make a trainable feature model drift apart across them.
    no_dropout: ClassVar[dict[str, float]]
    # Its tensor-parallel plan: the held layers' projections (paths inside a layer), each split by
    # COLUMN or ROW, and the partition stride of those that are several tensors side by side.
    projections: ClassVar[dict[str, int]]
    strides: ClassVar[dict[str, int]] = {}
    # Whether its vocabulary is the offline GPT-2 BPE's (tokenizer.name_or_path=offline fits it).
    uses_gpt2_bpe: ClassVar[bool] = False
    # Whether a checkpoint records it by its shape alone (n_layer, n_head, n_embd, n_positions): a
    # random build of that shape is the same decoder. Any other family records its whole config.
    records_shape_alone: ClassVar[bool] = False

    def random_config(
        self,
        vocab_size: int,
        n_layer: int,
        n_head: int,
        n_embd: int,
        n_positions: int,
        n_kv_head: int,
        mlp_width: int = 0,
    ) -> PretrainedConfig:
        """The transformers config of a random build from ``feature_model``'s ``n_*`` keys (``n_kv_head``
        0: one per head; ``mlp_width`` 0: 4x the width), under the family's own key names, with no
        special token ids (the tokenizer's are applied to the model, not to the decoder)."""
        keys = {
            "vocab_size": vocab_size, self.layers_key: n_layer, self.heads_key: n_head, self.width_key: n_embd,
            self.positions_key: n_positions, self.mlp_key: mlp_width or 4 * n_embd, "bos_token_id": None,
            "eos_token_id": None, **self.grouped_query_keys(n_head, n_kv_head),
        }  # fmt: skip
        return self.config_class(**keys)

    def grouped_query_keys(self, n_head: int, n_kv_head: int) -> dict:
        """Config keys of a random build's key/value heads (none: one per head, nothing to say)."""
        return {}

    def depth(self, config: PretrainedConfig) -> int:
        return getattr(config, self.layers_key)

    def mlp_width(self, config: PretrainedConfig) -> int:
        return getattr(config, self.mlp_key)

    def split_counts(self, config: PretrainedConfig) -> dict[str, int]:
        """What ``tensor_parallel`` must divide for each rank to hold whole heads and an equal part
        of the MLP, by what it is called in the one line that refuses it."""
        return {"attention heads": getattr(config, self.heads_key), "MLP width": self.mlp_width(config)}

    def unreproduced(self, config: PretrainedConfig, length: int) -> str | None:
        """A field of ``config`` that changes the decoder's computation over ``length`` tokens in a
        way :meth:`run_layers` does not reproduce, said as the one line's reason, or None. Any family
        may have a sliding window (Mistral's, Qwen's): the layers here run full causal attention."""
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

    def embed(self, decoder: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The residual stream entering layer 0."""
        hidden = getattr(decoder, self.embedding)(input_ids)
        return getattr(decoder, "emb_dropout", nn.Identity())(hidden)

    def run_layers(self, decoder: nn.Module, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``hidden`` through every held layer. No attention mask: the layers are causal, so a real
        token never attends to the right padding after it (only pad positions' features change, and
        the encoder masks those out), and attention is SDPA with ``is_causal``, free to pick its
        fastest kernel, with no mask derived from the inputs on the host."""
        return run_rotary_layers(decoder, getattr(decoder, self.layers), hidden, positions)

    def localize_attention(self, layer: nn.Module, tp: int) -> None:
        """Make ``layer``'s attention run on 1/tp of its heads once its projections are split. The
        default needs nothing: transformers reshapes by head width and heads per kv head, which are
        the same on every rank."""

    def prepare(self, decoder: nn.Module) -> nn.Module:
        """``decoder`` as the feature model runs it (the same function, maybe fewer kernels)."""
        return decoder

    def __repr__(self) -> str:
        return f"<family {self.name}>"
