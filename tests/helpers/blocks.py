"""A pre-LayerNorm transformer block built from the tensor-parallel layers, and the sizes the
collective and dropout tests share."""

from __future__ import annotations

from torch import nn

from parallel_latent.parallel import (
    DropoutRNG,
    ParallelAttention,
    ParallelMLP,
    TensorParallelOptions,
)

B, T, S, D, HEADS, VOCAB = 2, 8, 6, 32, 4, 500


class Block(nn.Module):
    def __init__(self, tp_group, sequence_parallel: bool = False):
        super().__init__()
        rng = DropoutRNG(seed=1)
        self.ln_attn, self.ln_context, self.ln_mlp = nn.LayerNorm(D), nn.LayerNorm(D), nn.LayerNorm(D)
        sp = {"options": TensorParallelOptions(sequence_parallel=sequence_parallel).active(tp_group)}
        self.attention = ParallelAttention(D, HEADS, dropout=0.1, rng=rng, tp_group=tp_group, **sp)
        self.mlp = ParallelMLP(D, 4 * D, dropout=0.1, rng=rng, tp_group=tp_group, **sp)

    def forward(self, x, context=None):
        if context is not None and context.requires_grad:
            context = self.ln_context(context)  # a trained norm makes the context need a gradient
        x = x + self.attention(self.ln_attn(x), context=context)
        return x + self.mlp(self.ln_mlp(x))
