"""The feature model: a decoder of one of :mod:`.families`, cut to the layers one hidden state needs.

The features are ``hidden_states[feature_model.hidden_state]`` of the full decoder (-3 by default,
the seeds' choice: the raw residual stream after all but the last two layers). Only the layers that
entry needs are held (the rest are never loaded, or deleted after a random build), and the final
norm is replaced by the identity unless the last entry is asked for, so that the cut decoder's
output *is* that hidden state.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Iterator

import torch
import transformers
from torch import nn
from transformers import AutoConfig, AutoModel, PretrainedConfig

from parallel_latent.config import Config, ConfigError, FeatureModelConfig
from parallel_latent.parallel import group_size

from .cache import tensors_digest
from .families import FAMILIES, Family, family_of, held_layers, load_config
from .hub import from_directory_or_hub
from .packaged import local_decoder
from .sharded import check_shardable, read_pretrained_shard, shard_layers, shards_feature_model
from .tokenizer import OFFLINE
from .transformers_api import require_supported_transformers, use_sdpa
from .weight_files import check_decoder_files, decoder_files_digest

logger = logging.getLogger(__name__)

HIDDEN_STATE_KEY = "feature_model.hidden_state"


def random_features_notice(feature_cfg: FeatureModelConfig) -> str:
    title = FAMILIES[feature_cfg.architecture].title
    kv = f" with {feature_cfg.n_kv_head} kv heads" if feature_cfg.n_kv_head else ""
    return (
        f"feature_model.pretrained is false: the {title} features are RANDOM (a {feature_cfg.n_layer}-layer, "
        f"{feature_cfg.n_embd}-wide {title}{kv} built from its config; the weights of {feature_cfg.name_or_path} "
        "are not loaded)"
    )


@contextlib.contextmanager
def random_features_unannounced() -> Iterator[None]:
    """Inside the block a random decoder is built without the warning: for callers that say it once
    themselves (the trainer's banner), or to whom it does not apply (weights loaded afterwards)."""
    previous = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(previous)


@contextlib.contextmanager
def _transformers_quiet() -> Iterator[None]:
    """A cut decoder loads without the layers after it and without an LM head: transformers' notes
    on those unused weights, and its progress bar over a few tensors, say nothing the user needs."""
    previous, bars = transformers.logging.get_verbosity(), transformers.logging.is_progress_bar_enabled()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    try:
        yield
    finally:
        transformers.logging.set_verbosity(previous)
        if bars:
            transformers.logging.enable_progress_bar()


def _runnable(config: PretrainedConfig, family: Family, layers: int) -> PretrainedConfig:
    """``config`` for the cut decoder: ``layers`` layers, no dropout, SDPA attention."""
    config = copy.deepcopy(config)
    setattr(config, family.layers_key, layers)
    for key, value in family.no_dropout.items():
        setattr(config, key, value)
    use_sdpa(config)
    return config


def _decoder_from_config(config: PretrainedConfig) -> nn.Module:
    return AutoModel.from_config(config, dtype=torch.float32, attn_implementation="sdpa")


def _decoder_config(
    feature_cfg: FeatureModelConfig, vocab_size: int, recorded: dict | None, planned: dict | None = None
) -> tuple[PretrainedConfig, Family]:
    """The uncut transformers config of the decoder :func:`load_decoder` builds, and its family."""
    if recorded is not None:
        config = AutoConfig.for_model(**recorded)
        return config, family_of(config, "the recorded feature model")
    if feature_cfg.pretrained:
        where = f"feature_model.name_or_path={feature_cfg.name_or_path}"
        config = pretrained_config(feature_cfg, planned)
        return config, family_of(config, where)
    family = FAMILIES[feature_cfg.architecture]
    config = family.random_config(
        vocab_size, feature_cfg.n_layer, feature_cfg.n_head, feature_cfg.n_embd, feature_cfg.n_positions,
        feature_cfg.n_kv_head,
    )  # fmt: skip
    return config, family


def decoder_signature(
    feature_cfg: FeatureModelConfig, recorded: dict | None = None, planned: dict | None = None
) -> dict[str, object]:
    """What makes the decoder :func:`load_decoder` would hold compute what it computes, besides its
    weights: its family (``architecture``), its attention heads (``n_head``), and the shape of every
    parameter it holds, its token table aside (its rows are the tokenizer's, compared on their
    own). Built on the meta device: no weight is read or allocated. ``planned``: as
    :func:`pretrained_config`'s."""
    config, family = _decoder_config(feature_cfg, 1, recorded, planned)
    keep = held_layers(family.depth(config), feature_cfg.hidden_state, family, HIDDEN_STATE_KEY)
    runnable = _runnable(config, family, keep)
    # A one-row token table (its rows are compared apart); a padding row past it would not build
    # (SmolLM2's config names pad token 2).
    runnable.vocab_size, runnable.pad_token_id = 1, None
    with torch.device("meta"), _transformers_quiet():
        decoder = _decoder_from_config(runnable)
    table = decoder.get_input_embeddings().weight
    shapes = {name: "x".join(map(str, p.shape)) for name, p in decoder.named_parameters() if p is not table}
    return {"architecture": family.name, "n_head": getattr(config, family.heads_key), **shapes}


class BuiltDecoder:
    """A decoder as loaded or built, before it is cut: the module, its family, its uncut config."""

    def __init__(self, decoder: nn.Module, family: Family, config: PretrainedConfig):
        self.decoder, self.family, self.config = decoder, family, config


def load_decoder(
    feature_cfg: FeatureModelConfig,
    vocab_size: int,
    recorded: dict | None = None,
    shard_group=None,
    planned: dict | None = None,
) -> BuiltDecoder:
    """The decoder of ``feature_cfg``, its token table resized to ``vocab_size``, holding at most the
    layers its hidden state needs (more only for a random build, cut by :func:`truncate_to_hidden_state`):

    - ``recorded`` (a checkpoint's transformers config): built from it, random weights the checkpoint
      overwrites; no path or hub is read;
    - ``pretrained``: by hub name or local directory, only the needed layers read;
    - else random weights from the ``architecture`` and ``n_*`` keys (the whole decoder is built, so
      that its weights are those of the full random model's first layers), with a warning.

    ``shard_group``: the TP group a ``pretrained`` decoder is read into slice by slice
    (:mod:`.sharded`); the other two are built whole and sharded by the caller once cut.
    ``planned``: the pretrained decoder's config as the job's plan read it (:func:`planned_decoder`).
    Uses (and advances) the global torch RNG."""
    require_supported_transformers()
    where = f"feature_model.name_or_path={feature_cfg.name_or_path}"
    config, family = _decoder_config(feature_cfg, vocab_size, recorded, planned)
    if recorded is None and not feature_cfg.pretrained:
        logger.warning("%s", random_features_notice(feature_cfg))
        keep = family.depth(config)
    else:
        keep = held_layers(family.depth(config), feature_cfg.hidden_state, family, HIDDEN_STATE_KEY)
    if shard_group is not None:  # refused in one line before any weight is read
        check_shardable(feature_cfg, family, config, group_size(shard_group))
    runnable = _runnable(config, family, keep)
    if recorded is None and feature_cfg.pretrained:
        with _transformers_quiet():
            if shard_group is not None:
                decoder = read_pretrained_shard(feature_cfg.name_or_path, runnable, family, shard_group)
            else:
                local = local_decoder(feature_cfg.name_or_path, where)
                decoder = from_directory_or_hub(
                    lambda: AutoModel.from_pretrained(
                        local, config=runnable, dtype=torch.float32, attn_implementation="sdpa"
                    ),
                    local, where, "its weights do not load", reads_config=False,
                )  # fmt: skip
    else:
        decoder = _decoder_from_config(runnable)
    with _transformers_quiet():  # its note on how the new rows are drawn
        decoder.resize_token_embeddings(vocab_size)
    config = copy.deepcopy(config)
    config.vocab_size = vocab_size
    return BuiltDecoder(decoder, family, config)


def truncate_to_hidden_state(decoder: nn.Module, index: int, depth: int | None = None) -> nn.Module:
    """Cut ``decoder`` (a base model of one of the families) in place so that its layers' output
    equals ``hidden_states[index]`` of the full ``depth``-layer model (by default: as many layers as
    it holds): the layers after it deleted, the final norm the identity unless ``index`` is the last."""
    family = family_of(decoder.config, "the feature model")
    layers = getattr(decoder, family.layers)
    depth = len(layers) if depth is None else depth
    keep = held_layers(depth, index, family, HIDDEN_STATE_KEY)
    del layers[keep:]
    if keep < depth:
        setattr(decoder, family.final_norm, nn.Identity())
    setattr(decoder.config, family.layers_key, len(layers))  # keeps caches and repr consistent
    return decoder


def pretrained_config(feature_cfg: FeatureModelConfig, planned: dict | None = None) -> PretrainedConfig:
    """The pretrained decoder's transformers config: from ``planned`` (its ``config.json`` as the
    job's plan read it: :func:`planned_decoder`) without reading a file, else from its directory or
    the hub."""
    where = f"feature_model.name_or_path={feature_cfg.name_or_path}"
    if planned is not None:
        return AutoConfig.for_model(**planned)
    return load_config(feature_cfg.name_or_path, where)


def planned_decoder(cfg: Config) -> dict | None:
    """A job's plan of its pretrained decoder (None for a random one): its weight files read whole
    (:func:`.weight_files.check_decoder_files`), then what ``cfg`` asks of it checked against its
    ``config.json`` (:func:`check_feature_model`); the config, which the ranks build the decoder
    from without reading the file again (a hub name not yet here is fetched, config.json alone)."""
    require_supported_transformers()
    if not cfg.feature_model.pretrained:
        return None
    check_decoder_files(cfg.feature_model.name_or_path)
    config = pretrained_config(cfg.feature_model)
    check_feature_model(cfg, config)
    return config.to_dict()


def check_feature_model(cfg: Config, config: PretrainedConfig | None = None) -> None:
    """What ``cfg`` asks of a pretrained decoder, checked against its ``config.json`` alone (or
    ``config``, the one already read), before any weight is read (one line each): a supported
    decoder family, the hidden state, the positions ``model.max_length`` needs, and a tokenizer of
    its own family (the offline GPT-2 BPE's ids would index another vocabulary than a Llama's or a
    Pythia's)."""
    feature_cfg = cfg.feature_model
    require_supported_transformers()
    if not feature_cfg.pretrained:
        return
    where = f"feature_model.name_or_path={feature_cfg.name_or_path}"
    config = config if config is not None else load_config(feature_cfg.name_or_path, where)
    family = family_of(config, where)
    held_layers(family.depth(config), feature_cfg.hidden_state, family, HIDDEN_STATE_KEY)
    if (reason := family.unreproduced(config, cfg.model.max_length)) is not None:
        raise ConfigError(f"{where} {reason}")
    positions = getattr(config, family.positions_key) - (feature_cfg.sink_token_id >= 0)  # the sink takes one
    if positions < cfg.model.max_length:
        raise ConfigError(f"model.max_length={cfg.model.max_length} exceeds the {positions} positions of {where}")
    if not family.uses_gpt2_bpe and cfg.tokenizer.name_or_path == OFFLINE:
        raise ConfigError(
            f"{where} is a {family.title} decoder but tokenizer.name_or_path={OFFLINE} is GPT-2's BPE: set "
            "tokenizer.name_or_path=feature_model (its own tokenizer)"
        )


class FeatureModel(nn.Module):
    """Features [B, T, width] of ``input_ids``: hidden state ``feature_model.hidden_state`` of the
    decoder. The decoder is registered under its family's name (:data:`.families.FAMILIES`), so
    checkpoint keys say which it is.

    Frozen (the default): no parameter trains, the module stays in eval mode whatever the parent
    does, and the forward builds no autograd graph. Otherwise it trains like any replicated module.
    ``recorded``: a checkpoint's transformers config to rebuild the decoder from (no hub, no path).
    ``tp_group``: with ``feature_model.parallel=shard`` at TP > 1, each held layer's attention and MLP
    are split over it (:mod:`.sharded`); otherwise every rank holds the whole decoder.
    """

    def __init__(
        self,
        feature_cfg: FeatureModelConfig,
        vocab_size: int,
        recorded: dict | None = None,
        tp_group=None,
        planned: dict | None = None,
    ):
        super().__init__()
        self.frozen = feature_cfg.frozen
        self.hidden_state = feature_cfg.hidden_state
        self.sink_token_id = feature_cfg.sink_token_id
        self.shard_group = tp_group if shards_feature_model(feature_cfg, tp_group) else None
        built = load_decoder(feature_cfg, vocab_size, recorded, self.shard_group, planned)
        self.family, self.decoder_config = built.family, built.config
        decoder = truncate_to_hidden_state(built.decoder, self.hidden_state, built.family.depth(built.config))
        # What the feature cache's key holds of the weights (weights_digest): a loaded decoder's files;
        # a built one's tensors, read here while they are whole if they are about to be sharded.
        self.source = feature_cfg.name_or_path if recorded is None and feature_cfg.pretrained else None
        self._whole_digest = None
        if self.shard_group is not None:
            if self.source is None:
                self._whole_digest = tensors_digest(decoder.state_dict())
            shard_layers(decoder, self.family, self.shard_group)
        self.add_module(self.family.name, self.family.prepare(decoder))
        self.matmul_weights = self._count_matmul_weights()
        if self.frozen:
            self.requires_grad_(False)
            self.eval()

    @property
    def decoder(self) -> nn.Module:
        return getattr(self, self.family.name)

    @property
    def token_embedding(self) -> nn.Embedding:
        return getattr(self.decoder, self.family.embedding)

    @property
    def token_table(self) -> torch.Tensor:
        return self.token_embedding.weight

    @property
    def width(self) -> int:
        return getattr(self.decoder_config, self.family.width_key)

    @property
    def positions(self) -> int:
        """The longest sample its positions cover (one less with a sink token)."""
        return getattr(self.decoder_config, self.family.positions_key) - (self.sink_token_id >= 0)

    @property
    def blocks(self) -> int:
        """Layers that run (for hidden state -3: n_layer - 2 of the loaded model)."""
        return len(getattr(self.decoder, self.family.layers))

    @property
    def sharded(self) -> bool:
        """Whether each held layer is split over the TP group (``feature_model.parallel=shard``)."""
        return self.shard_group is not None

    def _count_matmul_weights(self) -> int:
        """Weights of the matrix products in the layers that run (a token's forward is 2 FLOPs each):
        the whole model's, however it is laid out over the TP group. Counted once, when built: ZeRO-3
        later partitions the parameters over DP, and a partitioned one holds no elements between its
        gathers. (``matmul_weights`` holds the count.)"""
        tp = group_size(self.shard_group)
        return sum(
            p.numel() * (tp if getattr(p, "tensor_model_parallel", False) else 1)
            for p in getattr(self.decoder, self.family.layers).parameters()
            if p.dim() == 2
        )

    def architecture(self) -> dict:
        """What rebuilds this decoder without the hub or a path: its shape (``n_*``; its uncut depth),
        and unless its family is recorded by its shape alone, the family's name and the whole
        transformers config (uncut, vocabulary resized)."""
        config, family = self.decoder_config, self.family
        shape = {
            "n_layer": family.depth(config),
            "n_head": getattr(config, family.heads_key),
            "n_embd": self.width,
            "n_positions": getattr(config, family.positions_key),
        }
        if family.records_shape_alone:
            return shape
        return {"architecture": family.name, **shape, "transformers_config": config.to_dict()}

    def weights_digest(self) -> str:
        """The content of the weights, whatever the layout over the TP group: a pretrained decoder's
        files (its token table's added rows, drawn per seed, are not among them), or every tensor of
        a built one (the cache's key; :mod:`.cache`)."""
        if self.source is not None:
            return decoder_files_digest(self.source)
        return self._whole_digest or tensors_digest(self.decoder.state_dict())

    def train(self, mode: bool = True) -> FeatureModel:
        return super().train(mode and not self.frozen)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Features of right-padded ``input_ids``. ``attention_mask`` is not needed: the decoder is
        causal (see :meth:`.families.Family.run_layers`). With ``feature_model.sink_token_id`` that
        token runs first, at position 0, and its features are left out: a pretrained decoder's
        attention sink (a massive activation on whatever comes first) sits on it, not on the sample's
        first token."""
        decoder, family, sink = self.decoder, self.family, self.sink_token_id >= 0
        if sink:
            input_ids = torch.cat([input_ids.new_full((input_ids.shape[0], 1), self.sink_token_id), input_ids], 1)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.frozen):
            hidden = family.embed(decoder, input_ids, positions)
            hidden = family.run_layers(decoder, hidden, positions)
            hidden = getattr(decoder, family.final_norm)(hidden)  # the identity unless the last state
        return hidden[:, 1:] if sink else hidden
