"""The Perceiver encoder and the latent decoder, built on the tensor-parallel layers.

A Perceiver block (pre-LayerNorm, the Perceiver-resampler form)::

    x = x + attn(ln_query(x), context=ln_context(context))   # keys/values = cat(context, stream)
    x = x + mlp(ln_mlp(x))                                   # h->4h, GELU, dropout, 4h->h, dropout

Attention and MLP are Megatron-split (two all-reduces forward, two backward per block); the
LayerNorms, latents, position tables and the query scale are replicated on every TP rank.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from parallel_latent.config import ModelConfig
from parallel_latent.parallel import (
    DropoutRNG,
    ParallelAttention,
    ParallelMLP,
    VocabParallelHead,
    normal_init,
    scaled_init,
)


def _position_table(length: int, width: int, std: float) -> nn.Parameter:
    table = nn.Parameter(torch.empty(length, width))
    normal_init(std)(table.data)
    return table


class PerceiverBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, num_layers: int, rng: DropoutRNG, tp_group=None):
        super().__init__()
        d = cfg.d_model
        init, output_init = normal_init(cfg.init_std), scaled_init(cfg.init_std, num_layers)
        self.ln_query = nn.LayerNorm(d)
        self.ln_context = nn.LayerNorm(d)
        self.attn = ParallelAttention(
            d,
            cfg.n_heads,
            dropout=cfg.dropout,
            rng=rng,
            tp_group=tp_group,
            init_method=init,
            output_init_method=output_init,
        )
        self.ln_mlp = nn.LayerNorm(d)
        self.mlp = ParallelMLP(
            d,
            cfg.mlp_ratio * d,
            dropout=cfg.dropout,
            rng=rng,
            tp_group=tp_group,
            init_method=init,
            output_init_method=output_init,
        )

    def forward(self, x: torch.Tensor, context: torch.Tensor, context_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(
            self.ln_query(x), context=self.ln_context(context), context_mask=context_mask, attend_to_self=True
        )
        return x + self.mlp(self.ln_mlp(x))


class PerceiverStack(nn.Module):
    """Blocks applied in turn, each optionally recomputed in backward (activation checkpointing).

    Recomputation is exact even with dropout: masks are a pure function of (seed, rng.step, layer,
    coordinates), so the trainer must only not advance ``rng.step`` between forward and backward.
    """

    def __init__(self, cfg: ModelConfig, num_layers: int, rng: DropoutRNG, tp_group=None):
        super().__init__()
        self.blocks = nn.ModuleList(PerceiverBlock(cfg, num_layers, rng, tp_group) for _ in range(num_layers))
        self.activation_checkpointing = cfg.activation_checkpointing

    def forward(self, x, context, context_mask=None):
        recompute = self.activation_checkpointing and self.training and torch.is_grad_enabled()
        for block in self.blocks:
            if recompute:
                x = checkpoint(block, x, context, context_mask, use_reentrant=False)
            else:
                x = block(x, context, context_mask)
        return x


class PerceiverEncoder(nn.Module):
    """T learned latents (plus their own position table) read the GPT-2 features: [B, T, d].

    Ends with a LayerNorm: the pre-LN residual stream is unnormalised and grows with depth; a final
    norm (GPT-2's ``ln_f``) gives the latents a per-position bounded scale that the decoder, and
    any model trained on the latents, can rely on.
    """

    def __init__(self, cfg: ModelConfig, rng: DropoutRNG, tp_group=None):
        super().__init__()
        self.latents = _position_table(cfg.max_length, cfg.d_model, cfg.init_std)
        self.positions = _position_table(cfg.max_length, cfg.d_model, cfg.init_std)
        self.stack = PerceiverStack(cfg, cfg.n_encoder_layers, rng, tp_group)
        self.ln_f = nn.LayerNorm(cfg.d_model)

    def forward(self, features: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        batch, length, _ = features.shape
        x = (self.latents[:length] + self.positions[:length]).expand(batch, -1, -1)
        return self.ln_f(self.stack(x, features, attention_mask))


class LatentDecoder(nn.Module):
    """Latents [B, T, d] -> this rank's slice of the vocabulary logits [B, T, V_padded / tp].

    Every position is a query made from the mask vector: mask -> query MLP -> x scale -> + positions.
    The latents get the same positions; the queries attend to cat(latents, queries) through the
    blocks; LayerNorm; vocabulary-parallel projection.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        mask_vector: torch.Tensor,
        rng: DropoutRNG,
        tp_group=None,
        train_mask_vector: bool = False,
    ):
        super().__init__()
        d = cfg.d_model
        self.positions = _position_table(cfg.max_length, d, cfg.init_std)
        mask_vector = mask_vector.detach().clone().float()
        if train_mask_vector:  # the feature model trains, so does the vector copied from it
            self.mask_vector = nn.Parameter(mask_vector)
        else:
            self.register_buffer("mask_vector", mask_vector)
        # The query MLP writes a fresh tensor, not a residual: plain init for both projections.
        self.query_mlp = ParallelMLP(
            d, cfg.mlp_ratio * d, dropout=cfg.dropout, rng=rng, tp_group=tp_group, init_method=normal_init(cfg.init_std)
        )
        # Starts as the identity. Shape [1] rather than 0-dim, so code that flattens, partitions or
        # reshards parameters (ZeRO, checkpoints) sees an ordinary 1-D tensor.
        self.query_scale = nn.Parameter(torch.ones(1))
        self.stack = PerceiverStack(cfg, cfg.n_decoder_layers, rng, tp_group)
        self.ln_f = nn.LayerNorm(d)
        self.head = VocabParallelHead(d, cfg.vocab_size, tp_group=tp_group, init_method=normal_init(cfg.init_std))

    def queries(self, batch: int, length: int) -> torch.Tensor:
        """The prepared queries [B, T, d]."""
        if self.training and self.query_mlp.hidden_dropout.p > 0:
            # Dropout draws a different mask per (sample, position): the MLP must see [B, T, d].
            queries = self.query_mlp(self.mask_vector.expand(batch, length, -1))
        else:
            # Same input everywhere and no dropout: compute once, broadcast (autograd sums the grads).
            queries = self.query_mlp(self.mask_vector.view(1, 1, -1)).expand(batch, length, -1)
        return queries * self.query_scale + self.positions[:length]

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        batch, length, _ = latents.shape
        positions = self.positions[:length]
        x = self.stack(self.queries(batch, length), latents + positions)
        return self.head(self.ln_f(x))
