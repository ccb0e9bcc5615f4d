"""The tiny autoencoder the model tests share: d=32, 4 heads, 2+2 Perceiver blocks, T=8, a 3-layer
random GPT-2 and a small tokenizer-free vocabulary; random right-padded batches; training to overfit."""

from __future__ import annotations

import dataclasses

import torch

from parallel_latent.config import (
    FeatureModelConfig,
    ModelConfig,
)
from parallel_latent.model import LatentAutoencoder
from tests.helpers.tp_compare import autoencoder_reduction_length

B, T, D, VOCAB, MASK, PAD = 4, 8, 32, 300, 298, 299


def tiny_configs(dropout: float = 0.1, **model_overrides) -> tuple[ModelConfig, FeatureModelConfig]:
    """The test model: d=32, 4 heads, 2+2 Perceiver blocks, T=8, a 3-layer random GPT-2, and a
    small tokenizer-free vocabulary (ids 298 and 299 play mask and pad)."""
    model_cfg = ModelConfig(
        d_model=D,
        n_heads=4,
        n_encoder_layers=2,
        n_decoder_layers=2,
        mlp_ratio=4,
        max_length=T,
        dropout=dropout,
        vocab_size=VOCAB,
        mask_token_id=MASK,
        pad_token_id=PAD,
    )
    model_cfg = dataclasses.replace(model_cfg, **model_overrides)
    return model_cfg, FeatureModelConfig(n_layer=3, n_head=4, n_embd=D, n_positions=64)


def tiny_batch(batch: int = B, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ids with right padding of varied lengths (one full row)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, MASK, (batch, T), generator=gen)
    lengths = torch.randint(2, T + 1, (batch,), generator=gen)
    lengths[0] = T
    mask = (torch.arange(T) < lengths[:, None]).long()
    return ids.masked_fill(mask == 0, PAD), mask


def dp_half_batch(step: int, dp_rank: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s batch (:func:`tiny_batch` of seed ``step``), or DP rank ``dp_rank``'s half of it (DP=2)."""
    ids, mask = tiny_batch(seed=step)
    if dp_rank is None:
        return ids, mask
    half = slice(dp_rank * (B // 2), (dp_rank + 1) * (B // 2))
    return ids[half], mask[half]


def reduction_length_of_model(tp: int = 1) -> int:
    """The test model's reduction length (see tests/helpers/tp_compare.py), for batches of up to 2B."""
    return autoencoder_reduction_length(tiny_configs()[0], 2 * B * T, tp)


def overfit(model: LatentAutoencoder, ids, mask, max_steps: int, lr: float = 3e-3) -> int:
    """Train on one batch until eval-mode token accuracy is 100%; the number of steps it took."""
    optimizer = torch.optim.AdamW(model.trainable_parameters(), lr=lr, weight_decay=0.0)
    for step in range(1, max_steps + 1):
        model.train()
        model.dropout_rng.step = step
        model(ids, mask).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % 10 == 0:
            model.eval()
            with torch.no_grad():
                if model(ids, mask).token_accuracy.item() == 1.0:
                    return step
    return -1
