"""The feature model: GPT-2, truncated to the blocks that hidden state -3 needs.

``output_hidden_states`` of an ``n_layer`` GPT-2 has ``n_layer + 1`` entries (the embeddings, then
each block's output, the last one with the final LayerNorm applied). Entry -3 is therefore the output
of block ``n_layer - 3`` (0-based): the raw residual stream after the first ``n_layer - 2`` blocks.
We keep exactly those blocks, delete the rest (their weights are never held) and replace ``ln_f``
by the identity, so ``last_hidden_state`` *is* hidden state -3.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
from torch import nn
from transformers import GPT2Config, GPT2Model
from transformers.activations import ACT2FN

from parallel_latent.config import FeatureModelConfig

logger = logging.getLogger(__name__)

HIDDEN_STATE_INDEX = -3
GPT2_EOS_ID = 50256
# GPT-2's own dropout draws from torch's stateful RNG, which differs across TP ranks and would make
# a trainable feature model drift apart across them; our model's dropout lives in the Perceiver.
NO_DROPOUT = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}


def random_features_notice(feature_cfg: FeatureModelConfig) -> str:
    return (
        f"feature_model.pretrained is false: the GPT-2 features are RANDOM (a {feature_cfg.n_layer}-layer, "
        f"{feature_cfg.n_embd}-wide GPT-2 built from its config; the weights of {feature_cfg.name_or_path} "
        "are not loaded)"
    )


@contextlib.contextmanager
def random_features_unannounced() -> Iterator[None]:
    """Inside the block a random GPT-2 is built without the warning: for callers that say it once
    themselves (the trainer's banner), or to whom it does not apply (weights loaded afterwards)."""
    previous = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(previous)


def load_gpt2(feature_cfg: FeatureModelConfig, vocab_size: int) -> GPT2Model:
    """GPT-2 by name or local path (``pretrained``), else built from the config with random weights
    (and a warning); either way its token table resized to ``vocab_size``. Uses (and advances) the
    global torch RNG."""
    if feature_cfg.pretrained:
        gpt2 = GPT2Model.from_pretrained(feature_cfg.name_or_path, dtype=torch.float32, **NO_DROPOUT)
    else:
        logger.warning("%s", random_features_notice(feature_cfg))
        eos = GPT2_EOS_ID if vocab_size > GPT2_EOS_ID else None  # keeps transformers' checks quiet
        config = GPT2Config(
            vocab_size=vocab_size,
            n_layer=feature_cfg.n_layer,
            n_head=feature_cfg.n_head,
            n_embd=feature_cfg.n_embd,
            n_positions=feature_cfg.n_positions,
            bos_token_id=eos,
            eos_token_id=eos,
            **NO_DROPOUT,
        )
        gpt2 = GPT2Model(config)
    gpt2.resize_token_embeddings(vocab_size)
    return gpt2


def use_fused_tanh_gelu(gpt2: GPT2Model) -> GPT2Model:
    """GPT-2's ``gelu_new`` is the tanh approximation written as 8 elementwise kernels over [B, T,
    4f]; ``gelu_pytorch_tanh`` is the same function in one kernel (the results differ by rounding)."""
    if gpt2.config.activation_function == "gelu_new":
        gpt2.config.activation_function = "gelu_pytorch_tanh"
        for block in gpt2.h:
            block.mlp.act = ACT2FN["gelu_pytorch_tanh"]
    return gpt2


def truncate_to_hidden_state(gpt2: GPT2Model, index: int = HIDDEN_STATE_INDEX) -> GPT2Model:
    """Cut ``gpt2`` in place so that its ``last_hidden_state`` equals ``hidden_states[index]`` of the
    full model (index < -1: the final LayerNorm is applied only to the last entry)."""
    n_layer = len(gpt2.h)
    keep = n_layer + 1 + index  # hidden_states[i] is the output of the first i blocks
    if not 0 <= keep < n_layer:
        raise ValueError(f"hidden state {index} does not exist in a {n_layer}-layer GPT-2")
    del gpt2.h[keep:]
    gpt2.ln_f = nn.Identity()
    gpt2.config.n_layer = keep  # keeps caches and repr consistent with the blocks that exist
    return gpt2


class FeatureModel(nn.Module):
    """GPT-2 features [B, T, n_embd] of ``input_ids`` (hidden state -3).

    Frozen (the default): no parameter trains, the module stays in eval mode whatever the parent
    does, and the forward builds no autograd graph. Otherwise it trains like any replicated module.
    """

    def __init__(self, feature_cfg: FeatureModelConfig, vocab_size: int):
        super().__init__()
        self.frozen = feature_cfg.frozen
        gpt2 = load_gpt2(feature_cfg, vocab_size)
        self.gpt2 = use_fused_tanh_gelu(truncate_to_hidden_state(gpt2))
        if self.frozen:
            self.gpt2.requires_grad_(False)
            self.eval()

    @property
    def token_table(self) -> torch.Tensor:
        return self.gpt2.wte.weight

    @property
    def width(self) -> int:
        return self.gpt2.config.n_embd

    @property
    def blocks(self) -> int:
        """GPT-2 blocks that run (n_layer - 2 of the loaded model)."""
        return len(self.gpt2.h)

    def architecture(self) -> dict[str, int]:
        """The shape of the GPT-2 these features come from (also when it came from a hub name or
        a path), so that it can be rebuilt from its config without them. The held GPT-2 was cut to
        its first n_layer - 2 blocks; the uncut depth is recorded."""
        config = self.gpt2.config
        return {
            "n_layer": len(self.gpt2.h) - 1 - HIDDEN_STATE_INDEX,
            "n_head": config.n_head,
            "n_embd": config.n_embd,
            "n_positions": config.n_positions,
        }

    def train(self, mode: bool = True) -> FeatureModel:
        return super().train(mode and not self.frozen)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Features of right-padded ``input_ids``. GPT-2 is causal, so a real token never attends
        to the padding after it: the padding mask changes only the features at pad positions,
        which the encoder masks out. The blocks therefore run without a mask: attention is SDPA
        with ``is_causal``, free to pick its fastest (flash) kernel, and nothing derives a mask from
        the inputs (transformers' mask preparation reads the device on the host)."""
        gpt2 = self.gpt2
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.frozen):
            hidden = gpt2.drop(gpt2.wte(input_ids) + gpt2.wpe(positions))
            for block in gpt2.h:
                hidden = block(hidden)
            return gpt2.ln_f(hidden)  # the identity after truncation
