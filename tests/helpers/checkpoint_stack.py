"""A small model made of the core tensor-parallel layers, for checkpoint tests that need no
Perceiver: attention, MLP (dropout on), LayerNorms, a buffer and the padded vocabulary head."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn

from parallel_latent.parallel import DropoutRNG, ParallelAttention, ParallelMLP, VocabParallelHead, mark_replicated
from parallel_latent.parallel.utils import group_size

D, HEADS, VOCAB, T = 32, 4, 300, 6


class Stack(nn.Module):
    def __init__(self, tp_group=None, seed: int = 0, dropout: float = 0.1, d: int = D, vocab: int = VOCAB):
        super().__init__()
        self.tp_group = tp_group
        self.dropout_rng = DropoutRNG(seed=seed + 7)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.ln1 = nn.LayerNorm(d)
            self.attn = ParallelAttention(d, HEADS, dropout=dropout, rng=self.dropout_rng, tp_group=tp_group)
            self.ln2 = nn.LayerNorm(d)
            self.mlp = ParallelMLP(d, 4 * d, dropout=dropout, rng=self.dropout_rng, tp_group=tp_group)
            self.head = VocabParallelHead(d, vocab, tp_group=tp_group)
            self.frozen_scale = nn.Parameter(torch.full((d,), 1.5), requires_grad=False)
            self.register_buffer("offset", torch.linspace(-1, 1, d))
        mark_replicated(self)
        self.vocab = vocab

    # A test may set a ModelConfig: checkpoints then record it, and check it on loading.
    model_cfg = None

    def checkpoint_record(self) -> dict:
        return {"model_config": dataclasses.asdict(self.model_cfg)} if self.model_cfg is not None else {}

    def checkpoint_mismatch(self, record: dict) -> str | None:
        return self.model_cfg.difference(record.get("model_config")) if self.model_cfg is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's vocabulary slice of the logits [B, T, V/tp]."""
        x = x * self.frozen_scale + self.offset
        x = x + self.attn(self.ln1(x))
        x = x + self.mlp(self.ln2(x))
        return self.head(x)

    @torch.no_grad()
    def full_logits(self, x: torch.Tensor) -> torch.Tensor:
        logits = self(x)
        if group_size(self.tp_group) > 1:
            parts = [torch.empty_like(logits) for _ in range(group_size(self.tp_group))]
            dist.all_gather(parts, logits.contiguous(), group=self.tp_group)
            logits = torch.cat(parts, dim=-1)
        return logits[..., : self.vocab]


def batch(step: int, samples: int, first_sample: int = 0, d: int = D) -> torch.Tensor:
    """Samples ``first_sample .. first_sample + samples`` of a fixed global batch of ``step``."""
    gen = torch.Generator().manual_seed(1000 + step)
    full = torch.randn(first_sample + samples, T, d, generator=gen)
    return full[first_sample:]


def gathered_state(model: nn.Module, tp_group, tensors: dict | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of ``model`` made whole over TP (padding rows cut), on every rank."""
    from parallel_latent.checkpoint.shards import module_tensors, placement_of

    out = {}
    source, _ = module_tensors(model)
    for name, tensor in (tensors or source).items():
        ref = source.get(name, tensor)
        value = tensor.detach().clone()
        place = placement_of(ref, group_size(tp_group), name)
        if place.partition_dim is not None and group_size(tp_group) > 1:
            parts = [torch.empty_like(value) for _ in range(group_size(tp_group))]
            dist.all_gather(parts, value.contiguous(), group=tp_group)
            # A strided split (GPT-2's q, k, v side by side): each rank holds its 1/tp of each part.
            stride, dim = place.partition_stride, place.partition_dim
            pieces = [part.chunk(stride, dim) for part in parts]
            value = torch.cat([rank[j] for j in range(stride) for rank in pieces], dim=dim)
        if place.partition_dim is not None:
            value = value.narrow(place.partition_dim, 0, place.full_shape[place.partition_dim])
        out[name] = value
    return out
