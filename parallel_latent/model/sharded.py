"""The frozen decoder sharded over the tensor-parallel group (``feature_model.parallel=shard``).

Every TP rank runs the whole micro-batch through its 1/tp of each held layer, in Megatron's layout:
the projections into attention heads and into the MLP are split by output features
(:class:`~parallel_latent.parallel.ColumnParallelLinear`), the projections back into the residual
stream by input features (:class:`~parallel_latent.parallel.RowParallelLinear`, one all-reduce each,
its bias added once after it). A layer costs two all-reduces of [B, T, width]. The token table,
positions, norms and rotary buffers stay whole on every rank.

Only the attention and MLP projections of the held layers are split, as contiguous slices of the
transformers weight, so that a rank holds whole heads:

- ``llama``: q/k/v split by (kv) head, so tensor_parallel must divide the kv heads; transformers'
  attention reshapes with ``view(..., -1, head_dim)`` and ``num_key_value_groups`` (heads per kv
  head, the same on every rank), so local head counts need no other change;
- ``gpt_neox``: ``query_key_value`` holds q, k, v of head 0, then of head 1, ...: a contiguous chunk
  of its rows is whole heads.

GPT-2 is refused: its ``c_attn`` (a Conv1D, [in, out]) holds q of all heads, then k, then v, so a
rank's heads are three separate column ranges, which a portable checkpoint (one contiguous slice
per rank) cannot store as the full tensor; and GPT-2's largest model fits one GPU.

The parameter names and the full (reassembled) shapes are those of the replicated decoder, with the
TP flags of the parallel layers, so a portable checkpoint holds the same full tensors whatever the
layout and loads into either.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoModel, PretrainedConfig

from parallel_latent.config import ConfigError, FeatureModelConfig
from parallel_latent.parallel import ColumnParallelLinear, RowParallelLinear, group_rank, group_size
from parallel_latent.parallel.utils import set_tensor_parallel_attributes

from .families import Family

COLUMN, ROW = 0, 1  # the partition dim of a [out, in] weight
# Per family: the held layers' projections (paths inside a layer) and how each is split.
PROJECTIONS = {
    "llama": {
        "self_attn.q_proj": COLUMN,
        "self_attn.k_proj": COLUMN,
        "self_attn.v_proj": COLUMN,
        "self_attn.o_proj": ROW,
        "mlp.gate_proj": COLUMN,
        "mlp.up_proj": COLUMN,
        "mlp.down_proj": ROW,
    },
    "gpt_neox": {
        "attention.query_key_value": COLUMN,
        "attention.dense": ROW,
        "mlp.dense_h_to_4h": COLUMN,
        "mlp.dense_4h_to_h": ROW,
    },
}
SHARD = "feature_model.parallel=shard"
WEIGHTS_FILE, WEIGHTS_INDEX = "model.safetensors", "model.safetensors.index.json"


def shards_feature_model(feature_cfg: FeatureModelConfig, tp_group) -> bool:
    """Whether the decoder is sharded: ``shard`` at TP > 1 (at TP=1 there is nothing to split)."""
    return feature_cfg.parallel == "shard" and group_size(tp_group) > 1


def check_shardable(feature_cfg: FeatureModelConfig, family: Family, config: PretrainedConfig, tp: int) -> None:
    """One line, before any weight is read, when this decoder cannot be split ``tp`` ways."""
    if not feature_cfg.frozen:
        raise ConfigError(
            f"{SHARD} needs feature_model.frozen=true: a sharded decoder runs without gradients "
            "(a trainable feature model stays replicated)"
        )
    if family.name not in PROJECTIONS:
        raise ConfigError(
            f"{SHARD} does not support {family.title} decoders: c_attn holds q, k and v of all heads side by side, "
            "so a rank's heads are not one contiguous slice a portable checkpoint could store; GPT-2's largest "
            "model fits one GPU: use feature_model.parallel=replicate"
        )
    heads = getattr(config, family.heads_key)
    counts = {"attention heads": heads, "MLP width": config.intermediate_size}
    if family.name == "llama":
        counts = {"key/value heads": getattr(config, "num_key_value_heads", None) or heads, **counts}
    for what, count in counts.items():
        if count % tp:
            raise ConfigError(
                f"parallel.tensor_parallel={tp} does not divide the {count} {what} of the feature model "
                f"({family.title}, {heads} heads): {SHARD} gives each rank whole heads and an equal part of the MLP"
            )


def _parallel_linear(weight: torch.Tensor, bias: torch.Tensor | None, full_shape, dim: int, group) -> nn.Module:
    """A column- (``dim`` 0) or row-parallel (1) layer of the full [out, in] ``full_shape`` holding
    this rank's ``weight`` slice and ``bias`` (sliced for a column layer, whole for a row layer).
    Built on the meta device: its master-weight init would draw a full weight this rank never uses."""
    out_features, in_features = full_shape
    kind = ColumnParallelLinear if dim == COLUMN else RowParallelLinear
    with torch.device("meta"):
        layer = kind(in_features, out_features, bias=bias is not None, tp_group=group)
    layer.weight = nn.Parameter(weight, requires_grad=False)
    set_tensor_parallel_attributes(layer.weight, True, dim)
    if bias is not None:
        layer.bias = nn.Parameter(bias, requires_grad=False)
        set_tensor_parallel_attributes(layer.bias, dim == COLUMN, 0 if dim == COLUMN else None)
    return layer


def _rank_slice(tensor, dim: int, group):
    """This rank's contiguous 1/tp of ``tensor`` (a tensor or a safetensors slice) along ``dim``."""
    full = tensor.shape[dim] if isinstance(tensor, torch.Tensor) else tensor.get_shape()[dim]
    per_rank = full // group_size(group)
    start = group_rank(group) * per_rank
    index = (slice(start, start + per_rank),) if dim == 0 else (slice(None), slice(start, start + per_rank))
    return tensor[index]


def _projections(decoder: nn.Module, family: Family):
    """(layer, path in it, the module there, its partition dim) for each projection of the held layers."""
    for layer in getattr(decoder, family.layers):
        for path, dim in PROJECTIONS[family.name].items():
            yield layer, path, layer.get_submodule(path), dim


def _replace(layer: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(layer.get_submodule(parent) if parent else layer, name, module)


def _split(linear: nn.Linear, dim: int, group) -> nn.Module:
    """The parallel layer holding this rank's slice of ``linear`` (copied, so the whole can be freed;
    on the meta device, shapes only)."""
    weight, bias = _rank_slice(linear.weight, dim, group), linear.bias
    if bias is not None and dim == COLUMN:
        bias = _rank_slice(bias, 0, group)
    with torch.no_grad():
        weight, bias = weight.clone(), None if bias is None else bias.clone()
    return _parallel_linear(weight, bias, tuple(linear.weight.shape), dim, group)


def shard_layers(decoder: nn.Module, family: Family, group) -> nn.Module:
    """``decoder`` (built whole in memory: a random build, or a checkpoint's rebuild) with each held
    layer's projections replaced by this rank's slices of the same weights: the sharded decoder
    computes what the whole one does (up to summation order). Layers read slice by slice are left."""
    for layer, path, linear, dim in _projections(decoder, family):
        if isinstance(linear, nn.Linear):
            _replace(layer, path, _split(linear, dim, group))
    return decoder


# ----------------------------------------------------------------------------- pretrained, slice by slice


def _weights_directory(name_or_path: str) -> Path:
    """The local directory of ``name_or_path``'s weights: itself, or its snapshot in the hub cache
    (never downloaded here)."""
    if os.path.isdir(name_or_path):
        return Path(name_or_path)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name_or_path, local_files_only=True))
    except Exception:  # not cached (or not a hub name): the one line below says what to do
        raise ConfigError(
            f"feature_model.name_or_path={name_or_path}: {SHARD} reads the weights slice by slice from local "
            "safetensors files, and it is neither a local directory nor in the hub cache: download it first"
        ) from None


class _SafetensorsWeights:
    """The tensors of a model directory's ``model.safetensors`` (or its index's shards), by the base
    model's names: the CausalLM prefix (``model.``, ``gpt_neox.``, ``transformer.`` or none) is found
    from the token table's key."""

    def __init__(self, directory: Path, family: Family, where: str):
        if (directory / WEIGHTS_INDEX).is_file():
            weight_map = json.loads((directory / WEIGHTS_INDEX).read_text())["weight_map"]
        elif (directory / WEIGHTS_FILE).is_file():
            with safe_open(directory / WEIGHTS_FILE, framework="pt") as weights:
                weight_map = dict.fromkeys(weights.keys(), WEIGHTS_FILE)
        else:
            raise ConfigError(f"{where}: {SHARD} reads {WEIGHTS_FILE} (or {WEIGHTS_INDEX}) and {directory} has neither")
        table = f"{family.embedding}.weight"
        prefixes = [key[: -len(table)] for key in weight_map if key == table or key.endswith(f".{table}")]
        if len(prefixes) != 1:
            raise ConfigError(f"{where}: {directory}'s safetensors have no single {table} key to find the layers by")
        self.directory, self.prefix, self.weight_map, self.where = directory, prefixes[0], weight_map, where
        self._files = {}

    def _open(self, name: str):
        key = self.prefix + name
        if key not in self.weight_map:
            raise ConfigError(f"{self.where}: {self.directory}'s safetensors lack {key}")
        file = self.weight_map[key]
        if file not in self._files:
            self._files[file] = safe_open(self.directory / file, framework="pt")
        return self._files[file].get_slice(key)

    def whole(self, name: str) -> torch.Tensor:
        return self._open(name)[:].to(torch.float32)

    def rank_slice(self, name: str, dim: int, group) -> torch.Tensor:
        return _rank_slice(self._open(name), dim, group).to(torch.float32)


def _materialize(module: nn.Module, name: str, value: torch.Tensor) -> None:
    """Put ``value`` in place of the meta parameter ``name`` of ``module``, keeping its TP flags."""
    owner_path, _, leaf = name.rpartition(".")
    owner = module.get_submodule(owner_path) if owner_path else module
    old = owner._parameters[leaf]
    new = nn.Parameter(value.contiguous(), requires_grad=False)
    for flag in ("tensor_model_parallel", "partition_dim", "partition_stride"):
        if hasattr(old, flag):
            setattr(new, flag, getattr(old, flag))
    owner._parameters[leaf] = new


def read_pretrained_shard(name_or_path: str, config: PretrainedConfig, family: Family, group) -> nn.Module:
    """The base decoder of ``config`` (already cut to the held layers) with this rank's slices of
    its projections and the rest whole, read from ``name_or_path``'s safetensors: the skeleton is
    built on the meta device, so no rank ever allocates a whole layer's projections."""
    where = f"feature_model.name_or_path={name_or_path}"
    weights = _SafetensorsWeights(_weights_directory(name_or_path), family, where)
    with torch.device("meta"):
        decoder = AutoModel.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
        shard_layers(decoder, family, group)
    for name, param in list(decoder.named_parameters()):
        split = getattr(param, "tensor_model_parallel", False)
        _materialize(
            decoder, name, weights.rank_slice(name, param.partition_dim, group) if split else weights.whole(name)
        )
    # Non-persistent buffers (rotary inverse frequencies) are in no file: rebuilt from the config.
    decoder.rotary_emb = type(decoder.rotary_emb)(config=decoder.config)
    left = [name for name, buffer in decoder.named_buffers() if buffer.is_meta]  # every parameter was read
    if left:
        raise ConfigError(f"{where}: {SHARD} found no weights for {left[0]} in {weights.directory}")
    return decoder.eval()


def sharded_projection_weights(decoder: nn.Module, family: Family) -> int:
    """Elements this rank holds of the held layers' split projections (weights and sliced biases)."""
    return sum(
        p.numel()
        for _, _, linear, _ in _projections(decoder, family)
        for p in linear.parameters()
        if p.tensor_model_parallel
    )
