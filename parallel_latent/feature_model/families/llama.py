"""Llama and the decoders laid out as it is (Mistral, Qwen2, Qwen3): rotary positions, RMSNorm, a
gated MLP, grouped-query attention (``embed_tokens``, ``layers``, ``norm``).

Split over the TP group: q, k and v by (kv) head, so ``tensor_parallel`` must divide the kv heads too;
transformers' attention reshapes with ``view(..., -1, head_dim)`` and ``num_key_value_groups`` (heads
per kv head, the same on every rank), so the local head counts need no other change.
"""

from __future__ import annotations

from typing import ClassVar

from transformers import LlamaConfig, PretrainedConfig

from .family import COLUMN, ROW, Family


class Llama(Family):
    name, title, model_types = "llama", "Llama", ("llama", "mistral", "qwen2", "qwen3")
    embedding, layers, final_norm = "embed_tokens", "layers", "norm"
    layers_key, heads_key = "num_hidden_layers", "num_attention_heads"
    width_key, positions_key = "hidden_size", "max_position_embeddings"
    config_class = LlamaConfig
    no_dropout: ClassVar[dict] = {"attention_dropout": 0.0}
    projections: ClassVar[dict] = {
        "self_attn.q_proj": COLUMN,
        "self_attn.k_proj": COLUMN,
        "self_attn.v_proj": COLUMN,
        "self_attn.o_proj": ROW,
        "mlp.gate_proj": COLUMN,
        "mlp.up_proj": COLUMN,
        "mlp.down_proj": ROW,
    }

    def grouped_query_keys(self, n_head: int, n_kv_head: int) -> dict:
        return {"num_key_value_heads": n_kv_head or n_head, "pad_token_id": None}

    def split_counts(self, config: PretrainedConfig) -> dict[str, int]:
        kv_heads = getattr(config, "num_key_value_heads", None) or getattr(config, self.heads_key)
        return {"key/value heads": kv_heads, **super().split_counts(config)}
