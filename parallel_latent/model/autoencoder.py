"""The latent autoencoder: frozen GPT-2 features -> Perceiver encoder -> latents -> latent decoder.

The same code runs in one process (``tp_group=None``) or split over a tensor-parallel group; a TP=N
model is the TP=1 model (same init, same dropout masks), up to float summation order.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from parallel_latent.config import Config, ConfigError, FeatureModelConfig, ModelConfig
from parallel_latent.feature_model.features import FeatureModel, check_feature_model
from parallel_latent.parallel import (
    CompiledWithFallback,
    CompileOutcome,
    DropoutRNG,
    LossKernels,
    ParallelGaussianNoise,
    TensorParallelOptions,
    gather_from_sequence_parallel_region,
    group_size,
    mark_replicated,
    split_along_sequence,
    split_batch_and_gather,
    vocab_parallel_argmax,
    vocab_parallel_cross_entropy,
)

from .feature_norm import FeatureStandardizer, measure_feature_statistics
from .feature_window import FeatureWindow
from .perceiver import LatentDecoder, PerceiverEncoder

IGNORE_INDEX = -100


@dataclass
class AutoencoderOutput:
    loss: torch.Tensor  # mean cross-entropy over the positions trained (non-pad; all with predict_length)
    loss_sum: torch.Tensor  # cross-entropy summed over this rank's non-pad tokens (what is reported)
    num_tokens: torch.Tensor  # int: non-pad tokens
    num_correct: torch.Tensor  # int: tokens whose argmax is the input token
    token_accuracy: torch.Tensor  # num_correct / num_tokens
    exact_match: torch.Tensor  # fraction of sequences with every non-pad token right
    num_exact: torch.Tensor  # int: such sequences
    latents: torch.Tensor | None = None
    predictions: torch.Tensor | None = None  # [B, T] argmax ids, the pad id at pad positions
    # Summed over the positions trained: loss_sum, plus the pad positions with model.predict_length.
    trained_loss_sum: torch.Tensor | None = None
    # With model.predict_length and predictions: sequences whose predicted length (the first
    # predicted pad, see predicted_lengths) is their real length.
    num_length_exact: torch.Tensor | None = None


def predicted_lengths(ids: torch.Tensor, pad_token_id: int) -> torch.Tensor:
    """[B] where each row's text ends: the position of its first pad token, or its length if none."""
    is_pad = ids == pad_token_id
    first = is_pad.int().argmax(dim=1)
    return torch.where(is_pad.any(dim=1), first, torch.full_like(first, ids.shape[1]))


def length_mask(lengths: torch.Tensor, length: int) -> torch.Tensor:
    """[B, length] attention mask of right-padded rows of ``lengths`` tokens."""
    return (torch.arange(length, device=lengths.device) < lengths[:, None]).long()


class LatentAutoencoder(nn.Module):
    """The autoencoder of ``model_cfg`` over the feature model of ``feature_cfg``.

    At TP > 1: ``split_feature_model`` runs the frozen feature model on 1/tp of the micro-batch per
    rank (one all-gather assembles the features; a trainable feature model stays replicated), unless
    ``feature_model.parallel=shard`` splits each held layer of the frozen decoder over the TP group
    (every rank then runs the whole batch through its slices: :mod:`.sharded`);
    ``tp_options`` say how the TP regions communicate (sequence parallelism, the backward overlap).
    None of these changes a parameter: a checkpoint loads with any of them.
    ``recorded_feature_model``: the transformers config a checkpoint recorded for its feature model
    (any family but GPT-2), to rebuild it from without the hub or a path.
    ``decoder_config``: a pretrained decoder's transformers config as the job's plan read it
    (:func:`parallel_latent.feature_model.features.planned_decoder`): its weights are read, its
    config.json is not read again.
    """

    def __init__(
        self,
        model_cfg: ModelConfig,
        feature_cfg: FeatureModelConfig,
        tp_group=None,
        seed: int = 1234,
        *,
        split_feature_model: bool = True,
        tp_options: TensorParallelOptions | None = None,
        recorded_feature_model: dict | None = None,
        decoder_config: dict | None = None,
    ):
        super().__init__()
        self.model_cfg, self.feature_cfg, self.tp_group = model_cfg, feature_cfg, tp_group
        options = (tp_options or TensorParallelOptions()).active(tp_group)
        self.sequence_parallel = options.sequence_parallel
        # Split only frozen work: a trained feature model would need its gradients back from every rank.
        # A sharded decoder (feature_model.parallel=shard) runs the whole batch on every rank instead.
        self.split_feature_model = (
            split_feature_model and feature_cfg.frozen and group_size(tp_group) > 1 and feature_cfg.parallel != "shard"
        )
        self.dropout_rng = DropoutRNG(seed=seed)
        self.loss_kernels = LossKernels(compiled_on=self.dropout_rng)  # fused where the dropout mask is compiled
        # Built on the CPU in a fixed order under fixed seeds, identical at every TP degree (layers
        # draw full master weights, then slice). The Perceiver gets its own seed so its init does not
        # depend on how the feature model was obtained. Only the CPU generator is seeded, and fork_rng puts it
        # back afterwards: the caller's RNG streams (CPU and CUDA) are left as they were.
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)
            self.feature_model = FeatureModel(
                feature_cfg, model_cfg.vocab_size, recorded_feature_model, tp_group, decoder_config
            )
            if self.feature_model.width != model_cfg.d_model:
                raise ConfigError(
                    f"feature_model.name_or_path={feature_cfg.name_or_path} has width "
                    f"{self.feature_model.width} but model.d_model={model_cfg.d_model}: they must match"
                    + (f" (model.head={model_cfg.head} reads its token table)" if model_cfg.head != "normal" else "")
                )
            if self.feature_model.positions < model_cfg.max_length:
                raise ConfigError(
                    f"model.max_length={model_cfg.max_length} exceeds the {self.feature_model.positions} positions "
                    f"of feature_model.name_or_path={feature_cfg.name_or_path}"
                )
            # What the encoder reads: the features, standardised by statistics the model keeps.
            self.feature_norm = (
                FeatureStandardizer(self.feature_model.width) if model_cfg.feature_norm == "standardize" else None
            )
            # Drawn from no generator: the seed's draws below are those of a model without it.
            self.feature_window = (
                FeatureWindow(self.feature_model.width, model_cfg.feature_window)
                if model_cfg.feature_window > 1
                else None
            )
            torch.default_generator.manual_seed(seed + 1)
            self.encoder = PerceiverEncoder(model_cfg, self.dropout_rng, tp_group, options)
            # The mask vector is the mask row of the feature model's resized token table. That decoder
            # was loaded and resized by the same code, under the same seed, so a second load for this
            # one row would give the very same table: it is not loaded twice.
            mask_vector = self.feature_model.token_table[model_cfg.mask_token_id]
            self.decoder = LatentDecoder(
                model_cfg, mask_vector, self.dropout_rng, tp_group, train_mask_vector=not feature_cfg.frozen,
                token_embedding=self.feature_model.token_embedding, options=options,
            )  # fmt: skip
        # Last, so that the dropout sites built before it keep their keys.
        self.latent_noise = ParallelGaussianNoise(
            model_cfg.latent_noise, self.dropout_rng, partition_dim=1 if self.sequence_parallel else None,
            tp_group=tp_group,
        )  # fmt: skip
        mark_replicated(self)

    def checkpoint_record(self, latent_stats=None) -> dict:
        """What a checkpoint records about this model beyond its tensors: enough to rebuild it
        (the GPT-2 from its recorded shape, no hub needed) and to tell another model from it; and
        the statistics of its latents that whoever saves it measured (``latent_stats``, anything
        with ``to_dict()``: the evaluation's ``LatentStats``), for downstream models."""
        return {
            "model_class": f"{type(self).__module__}.{type(self).__qualname__}",
            "model_config": dataclasses.asdict(self.model_cfg),
            "feature_model_config": dataclasses.asdict(self.feature_cfg),
            "feature_model_architecture": self.feature_model.architecture(),
            "latent_stats": None if latent_stats is None else latent_stats.to_dict(),
        }

    def checkpoint_mismatch(self, record: dict) -> str | None:
        """Why a checkpoint's record does not fit this model (a weight-shaping config key differs), or None."""
        return self.model_cfg.difference(record.get("model_config"))

    def trainable_parameters(self) -> list[nn.Parameter]:
        """What the optimizer gets: the frozen GPT-2 and the frozen mask vector are not in it."""
        return [p for p in self.parameters() if p.requires_grad]

    def _check_length(self, length: int) -> None:
        if length > self.model_cfg.max_length:
            raise ValueError(f"sequence length {length} exceeds model.max_length={self.model_cfg.max_length}")
        if self.sequence_parallel and length % group_size(self.tp_group):
            raise ValueError(
                f"sequence length {length} is not divisible by tensor_parallel={group_size(self.tp_group)} "
                "(sequence parallelism): pad to model.max_length"
            )

    def _check_latents(self, latents: torch.Tensor, length: int) -> None:
        """Latents [B, N, k] of this model for ``length`` positions (N = length when a latent is a position)."""
        cfg = self.model_cfg
        count = length if not cfg.compresses_positions else cfg.latent_count
        if latents.dim() != 3 or tuple(latents.shape[1:]) != (count, cfg.latent_width):
            raise ValueError(
                f"latents of shape {tuple(latents.shape)} do not fit this model ([B, {count}, {cfg.latent_width}] "
                f"for {length} positions)"
            )

    def features(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, cached: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The feature model's output [B, T, f], every row on every rank (computed once per TP
        group when the pass is split). ``cached``: those features as the feature cache holds them
        (:mod:`parallel_latent.feature_model.cache`), taken instead of running the frozen decoder."""
        if cached is not None:
            expected = (*input_ids.shape, self.feature_model.width)
            if tuple(cached.shape) != expected:
                raise ValueError(f"cached features of shape {tuple(cached.shape)}, expected {expected}")
            return cached.to(self.feature_model.token_table.dtype)  # as the decoder computes them (bf16 runs: bf16)
        if self.split_feature_model:
            return split_batch_and_gather(self.feature_model, (input_ids, attention_mask), self.tp_group)
        return self.feature_model(input_ids, attention_mask)

    def encoder_input(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, cached: torch.Tensor | None = None
    ) -> torch.Tensor:
        """What the encoder reads: the features (``cached``, or computed), standardised with
        ``model.feature_norm``, mixed over ``model.feature_window`` positions."""
        features = self.features(input_ids, attention_mask, cached)
        features = features if self.feature_norm is None else self.feature_norm(features)
        return features if self.feature_window is None else self.feature_window(features, attention_mask)

    def measure_feature_norm(self, batches, dp_group=None) -> None:
        """``model.feature_norm=standardize``: measure the feature statistics on ``batches`` (this
        DP rank's share of them; every rank of a TP group the same batches) and keep them. Every rank
        ends with the same statistics. Nothing to do without a standardiser."""
        if self.feature_norm is None:
            return
        device = self.feature_norm.mean.device
        count, mean, variance = measure_feature_statistics(self.features, batches, device, dp_group)
        self.feature_norm.set_statistics(count, mean, variance)

    def _encode_local(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, cached: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Latents of this rank's positions (all of them unless sequence parallel)."""
        self._check_length(input_ids.shape[1])
        return self.encoder(self.encoder_input(input_ids, attention_mask, cached), attention_mask)

    def _whole(self, latents: torch.Tensor) -> torch.Tensor:
        return gather_from_sequence_parallel_region(latents, self.tp_group) if self.sequence_parallel else latents

    def encode(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, features: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Latents [B, N, k] of ``input_ids`` [B, T] (N = T and k = d_model by default; see
        ``model.num_latents`` and ``model.latent_dim``; differentiable: wrap in no_grad for inference)."""
        return self._whole(self._encode_local(input_ids, attention_mask, features))

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids [B, T]: argmax over the full vocabulary; the pad id where ``attention_mask`` is 0.
        T is the mask's length; without a mask (a model with ``predict_length`` only) the decoder
        reads ``max_length`` positions and each row ends at its first predicted pad."""
        cfg = self.model_cfg
        if attention_mask is None and not cfg.predict_length:
            raise ValueError("decoding without an attention mask needs a model trained with model.predict_length")
        length = cfg.max_length if attention_mask is None else attention_mask.shape[1]
        self._check_length(length)
        self._check_latents(latents, length)
        if self.sequence_parallel:
            latents = split_along_sequence(latents, self.tp_group)
        ids = vocab_parallel_argmax(self.decoder(latents, length), cfg.vocab_size, self.tp_group)
        if attention_mask is None:
            attention_mask = length_mask(predicted_lengths(ids, cfg.pad_token_id), length)
        return ids.masked_fill(attention_mask == 0, cfg.pad_token_id)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        return_latents: bool = False,
        return_predictions: bool = False,
        features: torch.Tensor | None = None,
    ) -> AutoencoderOutput:
        """``features``: the frozen decoder's features of ``input_ids`` from the feature cache (the
        decoder does not run); None computes them."""
        cfg = self.model_cfg
        latents = self._encode_local(input_ids, attention_mask, features)
        # This rank's vocabulary slice, never gathered; in training from noised latents (model.latent_noise).
        logits = self.decoder(self.latent_noise(latents), input_ids.shape[1])
        is_token = attention_mask.bool()
        if cfg.predict_length:  # every position is a target: a token, or the pad past the end
            target = input_ids.masked_fill(~is_token, cfg.pad_token_id)
        else:  # every non-pad position is a target
            target = input_ids.masked_fill(~is_token, IGNORE_INDEX)
        token_loss, correct = vocab_parallel_cross_entropy(
            logits, target, cfg.vocab_size, self.tp_group, IGNORE_INDEX, kernels=self.loss_kernels
        )
        # The reported numbers stay those of the real tokens, whatever is trained.
        num_tokens = is_token.sum()
        correct = correct & is_token
        if cfg.predict_length:
            loss_sum, trained_sum = token_loss.masked_fill(~is_token, 0.0).sum(), token_loss.sum()
            trained = torch.tensor(max(target.numel(), 1), device=target.device)
        else:
            loss_sum = trained_sum = token_loss.sum()
            trained = num_tokens.clamp(min=1)
        num_correct = correct.sum()
        num_exact = (correct | ~is_token).all(dim=1).sum()
        denominator = num_tokens.clamp(min=1)
        predictions = num_length_exact = None
        if return_predictions:  # what decode() returns, from the same logits (two [B, T] reductions)
            with torch.no_grad():
                predictions = vocab_parallel_argmax(logits.detach(), cfg.vocab_size, self.tp_group)
                if cfg.predict_length:
                    lengths = predicted_lengths(predictions, cfg.pad_token_id)
                    num_length_exact = (lengths == is_token.sum(dim=1)).sum()
            predictions = predictions.masked_fill(~is_token, cfg.pad_token_id)
        return AutoencoderOutput(
            loss=trained_sum / trained,
            loss_sum=loss_sum,
            num_tokens=num_tokens,
            num_correct=num_correct,
            token_accuracy=num_correct / denominator,
            exact_match=num_exact / max(input_ids.shape[0], 1),
            num_exact=num_exact,
            latents=self._whole(latents) if return_latents else None,
            predictions=predictions,
            trained_loss_sum=trained_sum,
            num_length_exact=num_length_exact,
        )


@contextlib.contextmanager
def eval_mode(model: nn.Module):
    """Eval mode (no dropout) inside the block; the caller's mode afterwards."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


def build_model(cfg: Config, tp_group=None, decoder_config: dict | None = None) -> LatentAutoencoder:
    """The model of ``cfg`` (apply the tokenizer's facts to ``cfg`` first), seeded by training.seed,
    with the parallel options of ``cfg.parallel``. ``decoder_config``: the pretrained decoder's
    config as a job's plan read and checked it (else read and checked here)."""
    parallel = cfg.parallel
    if decoder_config is None:
        check_feature_model(cfg)
    model = LatentAutoencoder(
        cfg.model,
        cfg.feature_model,
        tp_group=tp_group,
        seed=cfg.training.seed,
        split_feature_model=parallel.split_feature_model,
        tp_options=TensorParallelOptions(parallel.sequence_parallel, parallel.tp_overlap_comm),
        decoder_config=decoder_config,
    )
    if not cfg.training.compile_dropout:
        model.dropout_rng.compile_devices = ()
    if cfg.training.compile:
        compile_regions(model)
    return model


def compile_regions(model: LatentAutoencoder) -> LatentAutoencoder:
    """``training.compile``: torch.compile each Perceiver block and the loss's per-chunk work
    (regional compilation: every block of one shape reuses one compiled graph, so compiling costs
    one block, not the model). TP collectives stay outside the graphs; the dropout keys are device
    tensors read inside them, so a training step neither breaks a graph nor recompiles after step
    0. Evaluation (eval mode or no gradient) runs the blocks eagerly: its variants (no dropout, no
    backward, a partial last batch) would otherwise add graphs up to dynamo's recompile limit. A
    failure to compile falls back to eager with one warning, for every block at once. Parameters
    are not touched: checkpoints are the same with or without it."""
    outcome = CompileOutcome()  # one warning for the model, not one per block
    for stack in (model.encoder.stack, model.decoder.stack):
        for block in stack.blocks:
            block.forward = CompiledWithFallback(
                block.forward, "the Perceiver blocks", outcome, compile_if=_training(block), fullgraph=False
            )
    model.loss_kernels = LossKernels.compiled()
    return model


def _training(block: nn.Module) -> Callable[[], bool]:
    return lambda: block.training and torch.is_grad_enabled()
