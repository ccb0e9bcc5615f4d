"""GPT-NeoX (Pythia): rotary positions over a part of each head (``rotary_pct``), a parallel or
sequential residual as its config says (``embed_in``, ``layers``, ``final_layer_norm``).

Split over the TP group: ``query_key_value`` holds q, k, v of head 0, then of head 1, ...: a
contiguous chunk of its rows is whole heads.
"""

from __future__ import annotations

from typing import ClassVar

from transformers import GPTNeoXConfig

from .family import COLUMN, ROW, Family


class GPTNeoX(Family):
    name, title, model_types = "gpt_neox", "GPT-NeoX", ("gpt_neox",)
    embedding, layers, final_norm = "embed_in", "layers", "final_layer_norm"
    layers_key, heads_key = "num_hidden_layers", "num_attention_heads"
    width_key, positions_key = "hidden_size", "max_position_embeddings"
    config_class = GPTNeoXConfig
    no_dropout: ClassVar[dict] = {"hidden_dropout": 0.0, "attention_dropout": 0.0}
    projections: ClassVar[dict] = {
        "attention.query_key_value": COLUMN,
        "attention.dense": ROW,
        "mlp.dense_h_to_4h": COLUMN,
        "mlp.dense_4h_to_h": ROW,
    }
