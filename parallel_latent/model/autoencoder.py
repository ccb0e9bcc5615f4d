"""The latent autoencoder: frozen GPT-2 features -> Perceiver encoder -> latents -> latent decoder.

The same code runs in one process (``tp_group=None``) or split over a tensor-parallel group; a TP=N
model is the TP=1 model (same init, same dropout masks), up to float summation order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from parallel_latent.config import Config, FeatureModelConfig, ModelConfig
from parallel_latent.parallel import DropoutRNG, mark_replicated, vocab_parallel_argmax, vocab_parallel_cross_entropy

from .features import FeatureModel
from .perceiver import LatentDecoder, PerceiverEncoder

IGNORE_INDEX = -100


@dataclass
class AutoencoderOutput:
    loss: torch.Tensor  # mean cross-entropy over this rank's non-pad tokens
    loss_sum: torch.Tensor  # summed over them
    num_tokens: torch.Tensor  # int: non-pad tokens
    num_correct: torch.Tensor  # int: tokens whose argmax is the input token
    token_accuracy: torch.Tensor  # num_correct / num_tokens
    exact_match: torch.Tensor  # fraction of sequences with every non-pad token right
    num_exact: torch.Tensor  # int: such sequences
    latents: torch.Tensor | None = None


class LatentAutoencoder(nn.Module):
    def __init__(self, model_cfg: ModelConfig, feature_cfg: FeatureModelConfig, tp_group=None, seed: int = 1234):
        super().__init__()
        self.model_cfg, self.feature_cfg, self.tp_group = model_cfg, feature_cfg, tp_group
        self.dropout_rng = DropoutRNG(seed=seed)
        # Built on the CPU in a fixed order under fixed seeds, identical at every TP degree (layers
        # draw full master weights, then slice). The Perceiver gets its own seed so its init does not
        # depend on how the GPT-2 was obtained. Only the CPU generator is seeded, and fork_rng puts it
        # back afterwards: the caller's RNG streams (CPU and CUDA) are left as they were.
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)
            self.feature_model = FeatureModel(feature_cfg, model_cfg.vocab_size)
            if self.feature_model.width != model_cfg.d_model:
                raise ValueError(
                    f"feature_model.name_or_path={feature_cfg.name_or_path} has width "
                    f"{self.feature_model.width} but model.d_model={model_cfg.d_model}: they must match"
                )
            torch.default_generator.manual_seed(seed + 1)
            self.encoder = PerceiverEncoder(model_cfg, self.dropout_rng, tp_group)
            # The mask vector is the mask row of the feature model's resized token table. That GPT-2
            # was loaded and resized by the same code, under the same seed, so a second load for this
            # one row would give the very same table: it is not loaded twice.
            mask_vector = self.feature_model.token_table[model_cfg.mask_token_id]
            self.decoder = LatentDecoder(
                model_cfg, mask_vector, self.dropout_rng, tp_group, train_mask_vector=not feature_cfg.frozen
            )
        mark_replicated(self)

    def trainable_parameters(self) -> list[nn.Parameter]:
        """What the optimizer gets: the frozen GPT-2 and the frozen mask vector are not in it."""
        return [p for p in self.parameters() if p.requires_grad]

    def _check_length(self, length: int) -> None:
        if length > self.model_cfg.max_length:
            raise ValueError(f"sequence length {length} exceeds model.max_length={self.model_cfg.max_length}")

    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Latents [B, T, d] of ``input_ids`` [B, T] (differentiable; wrap in no_grad for inference)."""
        self._check_length(input_ids.shape[1])
        features = self.feature_model(input_ids, attention_mask)
        return self.encoder(features, attention_mask)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids [B, T]: argmax over the full vocabulary; the pad id where ``attention_mask`` is 0."""
        self._check_length(latents.shape[1])
        ids = vocab_parallel_argmax(self.decoder(latents), self.model_cfg.vocab_size, self.tp_group)
        if attention_mask is not None:
            ids = ids.masked_fill(attention_mask == 0, self.model_cfg.pad_token_id)
        return ids

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, return_latents: bool = False
    ) -> AutoencoderOutput:
        latents = self.encode(input_ids, attention_mask)
        logits = self.decoder(latents)  # this rank's vocabulary slice, never gathered
        is_token = attention_mask.bool()
        target = input_ids.masked_fill(~is_token, IGNORE_INDEX)  # every non-pad position is a target
        token_loss, correct = vocab_parallel_cross_entropy(
            logits, target, self.model_cfg.vocab_size, self.tp_group, IGNORE_INDEX
        )
        num_tokens = is_token.sum()
        loss_sum = token_loss.sum()
        num_correct = correct.sum()
        num_exact = (correct | ~is_token).all(dim=1).sum()
        denominator = num_tokens.clamp(min=1)
        return AutoencoderOutput(
            loss=loss_sum / denominator,
            loss_sum=loss_sum,
            num_tokens=num_tokens,
            num_correct=num_correct,
            token_accuracy=num_correct / denominator,
            exact_match=num_exact / max(input_ids.shape[0], 1),
            num_exact=num_exact,
            latents=latents if return_latents else None,
        )


def build_model(cfg: Config, tp_group=None) -> LatentAutoencoder:
    """The model of ``cfg`` (apply the tokenizer's facts to ``cfg`` first), seeded by training.seed."""
    return LatentAutoencoder(cfg.model, cfg.feature_model, tp_group=tp_group, seed=cfg.training.seed)
