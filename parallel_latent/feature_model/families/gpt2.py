"""GPT-2: learned positions added to the token embeddings (``wte``, ``wpe``, ``h``, ``ln_f``), and
the one family a checkpoint records by its shape alone.

Split over the TP group: the projections are ``Conv1D`` (weight [in, out]) and stay in that
orientation (:class:`~..sharded.ParallelConv1D`: a column split cuts dim 1, a row split dim 0).
``c_attn`` holds q of all heads, then k, then v: a rank's heads are its 1/tp of each (partition
stride 3), and transformers' attention splits its output into q, k, v by its width, set to the local
one (:func:`..transformers_api.set_local_gpt2_attention`).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn
from transformers import GPT2Config, PretrainedConfig
from transformers.activations import ACT2FN

from ..transformers_api import set_local_gpt2_attention
from .family import COLUMN, ROW, Family

END_OF_TEXT = 50256  # GPT-2's end of text, in its own vocabulary


class GPT2(Family):
    name, title, model_types = "gpt2", "GPT-2", ("gpt2",)
    embedding, layers, final_norm = "wte", "h", "ln_f"
    layers_key, heads_key, width_key, positions_key = "n_layer", "n_head", "n_embd", "n_positions"
    no_dropout: ClassVar[dict] = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    projections: ClassVar[dict] = {"attn.c_attn": COLUMN, "attn.c_proj": ROW, "mlp.c_fc": COLUMN, "mlp.c_proj": ROW}
    strides: ClassVar[dict] = {"attn.c_attn": 3}
    uses_gpt2_bpe = True
    records_shape_alone = True

    def random_config(self, vocab_size, n_layer, n_head, n_embd, n_positions, n_kv_head, mlp_width=0) -> GPT2Config:
        eos = END_OF_TEXT if vocab_size > END_OF_TEXT else None  # keeps transformers' checks quiet
        return GPT2Config(
            vocab_size=vocab_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd, n_positions=n_positions,
            n_inner=mlp_width or None, bos_token_id=eos, eos_token_id=eos,
        )  # fmt: skip

    def mlp_width(self, config: PretrainedConfig) -> int:
        return config.n_inner or 4 * config.n_embd  # unset: 4x the width

    def embed(self, decoder: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return decoder.drop(decoder.wte(input_ids) + decoder.wpe(positions))

    def run_layers(self, decoder: nn.Module, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        for layer in decoder.h:
            hidden = layer(hidden)
        return hidden

    def localize_attention(self, layer: nn.Module, tp: int) -> None:
        config = layer.attn.config
        set_local_gpt2_attention(layer.attn, config.num_attention_heads // tp, config.hidden_size // tp)

    def prepare(self, decoder: nn.Module) -> nn.Module:
        """``gelu_new`` is the tanh approximation written as 8 elementwise kernels over [B, T, 4f];
        ``gelu_pytorch_tanh`` is the same function in one kernel (the results differ by rounding)."""
        if decoder.config.activation_function == "gelu_new":
            decoder.config.activation_function = "gelu_pytorch_tanh"
            for block in decoder.h:
                block.mlp.act = ACT2FN["gelu_pytorch_tanh"]
        return decoder
