"""The plain PyTorch twins the benchmarks time ours against: the autoencoder written with nn.Linear,
SDPA attention, nn.LayerNorm and F.cross_entropy (bench_model.py; module names mirror ours so that one
state_dict loads into both), and an nn.Sequential MLP (bench_parallel.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from parallel_latent.config import ModelConfig
from parallel_latent.feature_model import FeatureModel
from parallel_latent.model import LatentAutoencoder


class PlainAttention(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.query, self.key, self.value = nn.Linear(d, d), nn.Linear(d, d, bias=False), nn.Linear(d, d)
        self.dense = nn.Linear(d, d)

    def forward(self, x, context, context_mask=None):
        kv = torch.cat([context, x], dim=1)
        split = lambda t: t.view(t.shape[0], t.shape[1], self.heads, -1).transpose(1, 2)  # noqa: E731
        q, k, v = split(self.query(x)), split(self.key(kv)), split(self.value(kv))
        mask = None
        if context_mask is not None:
            mask = torch.cat([context_mask.bool(), context_mask.new_ones(x.shape[:2], dtype=torch.bool)], dim=1)
            mask = mask[:, None, None, :]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).flatten(2)
        return F.dropout(self.dense(out), self.dropout, self.training)


class PlainMLP(nn.Module):
    def __init__(self, d: int, hidden: int, dropout: float):
        super().__init__()
        self.dropout = dropout
        self.dense_h_to_4h, self.dense_4h_to_h = nn.Linear(d, hidden), nn.Linear(hidden, d)

    def forward(self, x):
        hidden = F.dropout(F.gelu(self.dense_h_to_4h(x)), self.dropout, self.training)
        return F.dropout(self.dense_4h_to_h(hidden), self.dropout, self.training)


class PlainBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d = cfg.d_model
        self.ln_query, self.ln_context, self.ln_mlp = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn, self.mlp = PlainAttention(d, cfg.n_heads, cfg.dropout), PlainMLP(d, cfg.mlp_ratio * d, cfg.dropout)

    def forward(self, x, context, context_mask=None):
        x = x + self.attn(self.ln_query(x), self.ln_context(context), context_mask)
        return x + self.mlp(self.ln_mlp(x))


class PlainStack(nn.Module):
    def __init__(self, cfg: ModelConfig, layers: int):
        super().__init__()
        self.blocks = nn.ModuleList(PlainBlock(cfg) for _ in range(layers))

    def forward(self, x, context, context_mask=None):
        for block in self.blocks:
            x = block(x, context, context_mask)
        return x


class PlainEncoder(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.latents = nn.Parameter(torch.empty(cfg.max_length, cfg.d_model))
        self.positions = nn.Parameter(torch.empty(cfg.max_length, cfg.d_model))
        self.stack, self.ln_f = PlainStack(cfg, cfg.n_encoder_layers), nn.LayerNorm(cfg.d_model)

    def forward(self, features, mask):
        x = (self.latents + self.positions).expand(features.shape[0], -1, -1)
        return self.ln_f(self.stack(x, features, mask))


class PlainDecoder(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d = cfg.d_model
        self.positions = nn.Parameter(torch.empty(cfg.max_length, d))
        self.register_buffer("mask_vector", torch.empty(d))
        self.query_mlp, self.query_scale = PlainMLP(d, cfg.mlp_ratio * d, cfg.dropout), nn.Parameter(torch.ones(1))
        self.stack, self.ln_f = PlainStack(cfg, cfg.n_decoder_layers), nn.LayerNorm(d)
        self.head = nn.Linear(d, cfg.vocab_size, bias=False)

    def forward(self, latents):
        b, t, d = latents.shape
        queries = (self.query_mlp(self.mask_vector.expand(b, t, d)) if self.training and self.query_mlp.dropout > 0
                   else self.query_mlp(self.mask_vector.view(1, 1, d)).expand(b, t, d))  # fmt: skip
        queries = queries * self.query_scale + self.positions
        return self.head(self.ln_f(self.stack(queries, latents + self.positions)))


class PlainAutoencoder(nn.Module):
    def __init__(self, cfg: ModelConfig, feature_model: FeatureModel):
        super().__init__()
        self.feature_model = feature_model  # the very same frozen module as ours
        self.encoder, self.decoder = PlainEncoder(cfg), PlainDecoder(cfg)

    def forward(self, ids, mask):
        with torch.no_grad():
            features = self.feature_model.gpt2(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
        logits = self.decoder(self.encoder(features, mask))
        return F.cross_entropy(logits.flatten(0, 1), ids.masked_fill(mask == 0, -100).flatten())


def plain_twin(ours: LatentAutoencoder) -> PlainAutoencoder:
    plain = PlainAutoencoder(ours.model_cfg, ours.feature_model)
    state = {k: v for k, v in ours.state_dict().items() if not k.startswith("feature_model.")}
    state["decoder.head.weight"] = state["decoder.head.weight"][: ours.model_cfg.vocab_size]  # drop padding
    missing, unexpected = plain.load_state_dict(state, strict=False)
    assert not unexpected and all(k.startswith("feature_model.") for k in missing), (missing, unexpected)
    return plain


def plain_mlp(hidden: int, dropout: float) -> nn.Module:
    layers = [nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Dropout(dropout), nn.Linear(4 * hidden, hidden)]
    return nn.Sequential(*layers, nn.Dropout(dropout))
