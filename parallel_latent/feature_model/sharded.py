"""The frozen decoder sharded over the tensor-parallel group (``feature_model.parallel=shard``).

Every TP rank runs the whole micro-batch through its 1/tp of each held layer, in Megatron's layout:
the projections into attention heads and into the MLP are split by output features
(:class:`~parallel_latent.parallel.ColumnParallelLinear`), the projections back into the residual
stream by input features (:class:`~parallel_latent.parallel.RowParallelLinear`, one all-reduce each,
its bias added once after it). A layer costs two all-reduces of [B, T, width]. The token table,
positions, norms and rotary buffers stay whole on every rank.

Only the attention and MLP projections of the held layers are split, as slices of the transformers
weight that hold whole heads, as the family's tensor-parallel plan says (:class:`.families.Family`:
``projections``, ``strides``, ``split_counts``, ``localize_attention``; each family's file says why
its plan holds whole heads).

The parameter names and the full (reassembled) shapes are those of the replicated decoder, with the
TP flags of the parallel layers (partition dim and stride), so a portable checkpoint holds the same
full tensors whatever the layout and loads into either.

Under ZeRO-3 the slices are partitioned over the data-parallel group like every parameter of the
model (the replicated decoder's too) and gathered around the forward of the module that owns them:
every projection here owns its slice, and transformers' layers are modules like any other.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoModel, PretrainedConfig

from parallel_latent.config import ConfigError, FeatureModelConfig
from parallel_latent.files import load_json_file
from parallel_latent.parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    group_rank,
    group_size,
    reduce_from_tp_region,
)
from parallel_latent.parallel.projection import Projection, column_parallel_projections
from parallel_latent.parallel.utils import partition_ranges, set_tensor_parallel_attributes

from .families import COLUMN, Family
from .hub import cached_snapshot
from .packaged import local_decoder
from .transformers_api import Conv1D, rebuild_rotary

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
    heads = getattr(config, family.heads_key)
    for what, count in family.split_counts(config).items():
        if count % tp:
            raise ConfigError(
                f"parallel.tensor_parallel={tp} does not divide the {count} {what} of the feature model "
                f"({family.title}, {heads} heads): {SHARD} gives each rank whole heads and an equal part of the MLP"
            )


def _hold(layer: nn.Module, weight: torch.Tensor, bias: torch.Tensor | None, dim: int, kind: int, stride: int):
    """``layer`` holding this rank's ``weight`` slice (split along ``dim``) and ``bias`` (sliced
    alike for a column split; whole for a row split, added once after the all-reduce), frozen, with
    their TP flags."""
    layer.weight = nn.Parameter(weight, requires_grad=False)
    set_tensor_parallel_attributes(layer.weight, True, dim, stride)
    if bias is not None:
        layer.bias = nn.Parameter(bias, requires_grad=False)
        set_tensor_parallel_attributes(layer.bias, kind == COLUMN, 0 if kind == COLUMN else None, stride)
    return layer


def _parallel_linear(weight, bias, full_shape, kind: int, stride: int, group) -> nn.Module:
    """A column- or row-parallel layer of the full [out, in] ``full_shape`` (see :func:`_hold`).
    Built on the meta device: its master-weight init would draw a full weight this rank never uses."""
    out_features, in_features = full_shape
    layer_class = ColumnParallelLinear if kind == COLUMN else RowParallelLinear
    with torch.device("meta"):
        layer = layer_class(in_features, out_features, bias=bias is not None, tp_group=group)
    return _hold(layer, weight, bias, kind, kind, stride)


class ParallelConv1D(nn.Module):
    """GPT-2's ``Conv1D`` (``x @ weight + bias``, weight [in, out]) split over the TP group in its own
    orientation, so that names and full shapes stay Conv1D's: by columns (output features, weight
    dim 1), entering the region as :class:`~parallel_latent.parallel.ColumnParallelLinear` does, or
    by rows (input features, dim 0), leaving it with one all-reduce as
    :class:`~parallel_latent.parallel.RowParallelLinear` does."""

    def __init__(self, weight, bias, kind: int, stride: int, group):
        super().__init__()
        self.kind, self.tp_group = kind, group
        _hold(self, weight, bias, 1 - kind, kind, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == COLUMN:
            (y,) = column_parallel_projections(x, [Projection(self.weight.t(), self.bias)], self.tp_group)
            return y
        y = reduce_from_tp_region(x @ self.weight, self.tp_group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        split = "columns" if self.kind == COLUMN else "rows"
        return f"weight {list(self.weight.shape)} per rank (by {split}, stride {self.weight.partition_stride})"


def _rank_slice(tensor, dim: int, stride: int, group):
    """This rank's 1/tp of ``tensor`` (a tensor or a safetensors slice, never read whole) along
    ``dim``: one range, or its part of each of ``stride`` parts, concatenated."""
    full = tensor.shape[dim] if isinstance(tensor, torch.Tensor) else tensor.get_shape()[dim]
    ranges = partition_ranges(full, full // group_size(group), group_rank(group), stride)
    parts = [tensor[(slice(None),) * dim + (slice(start, stop),)] for start, stop, _ in ranges]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def _projections(decoder: nn.Module, family: Family):
    """(layer, path in it, the module there, how it is split, its stride) for each projection of the
    held layers."""
    for layer in getattr(decoder, family.layers):
        for path, kind in family.projections.items():
            yield layer, path, layer.get_submodule(path), kind, family.strides.get(path, 1)


def _replace(layer: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(layer.get_submodule(parent) if parent else layer, name, module)


def _split(module: nn.Linear | Conv1D, kind: int, stride: int, group) -> nn.Module:
    """The parallel layer holding this rank's slice of ``module`` (copied, so the whole can be freed;
    on the meta device, shapes only)."""
    conv = isinstance(module, Conv1D)
    weight = _rank_slice(module.weight, 1 - kind if conv else kind, stride, group)
    bias = module.bias
    if bias is not None and kind == COLUMN:
        bias = _rank_slice(bias, 0, stride, group)
    with torch.no_grad():
        weight, bias = weight.clone(), None if bias is None else bias.clone()
    if conv:
        return ParallelConv1D(weight, bias, kind, stride, group)
    return _parallel_linear(weight, bias, tuple(module.weight.shape), kind, stride, group)


def shard_layers(decoder: nn.Module, family: Family, group) -> nn.Module:
    """``decoder`` (built whole in memory: a random build, or a checkpoint's rebuild) with each held
    layer's projections replaced by this rank's slices of the same weights: the sharded decoder
    computes what the whole one does (up to summation order). Layers read slice by slice are left."""
    for layer, path, module, kind, stride in _projections(decoder, family):
        if isinstance(module, (nn.Linear, Conv1D)):
            _replace(layer, path, _split(module, kind, stride, group))
    for layer in getattr(decoder, family.layers):
        family.localize_attention(layer, group_size(group))
    return decoder


# ----------------------------------------------------------------------------- pretrained, slice by slice


def _weights_directory(name_or_path: str) -> Path:
    """The local directory of ``name_or_path``'s weights: itself, or its snapshot in the hub cache
    (never downloaded here). A snapshot without the weights is refused here too: reading the
    decoder's ``config.json`` online (:func:`~.features.check_feature_model`) leaves a snapshot
    holding that file alone."""
    if os.path.isdir(name_or_path):
        return Path(name_or_path)
    where = f"feature_model.name_or_path={name_or_path}: {SHARD} reads the weights slice by slice from local "
    where += "safetensors files"
    snapshot = cached_snapshot(name_or_path)
    if snapshot is None:
        raise ConfigError(f"{where}, and it is neither a local directory nor in the hub cache: download it first")
    if not any((snapshot / name).is_file() for name in (WEIGHTS_FILE, WEIGHTS_INDEX)):
        raise ConfigError(
            f"{where}, and its snapshot in the hub cache ({snapshot}) holds no {WEIGHTS_FILE} (or {WEIGHTS_INDEX}): "
            "download its safetensors weights first"
        )
    return snapshot


class _SafetensorsWeights:
    """The tensors of a model directory's ``model.safetensors`` (or its index's shards), by the base
    model's names: the CausalLM prefix (``model.``, ``gpt_neox.``, ``transformer.`` or none) is found
    from the token table's key."""

    def __init__(self, directory: Path, family: Family, where: str):
        if (directory / WEIGHTS_INDEX).is_file():
            weight_map = load_json_file(directory / WEIGHTS_INDEX)["weight_map"]
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

    def rank_slice(self, name: str, dim: int, stride: int, group) -> torch.Tensor:
        return _rank_slice(self._open(name), dim, stride, group).to(torch.float32)


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
    weights = _SafetensorsWeights(_weights_directory(local_decoder(name_or_path)), family, where)
    with torch.device("meta"):
        decoder = AutoModel.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
        shard_layers(decoder, family, group)
    for name, param in list(decoder.named_parameters()):
        if getattr(param, "tensor_model_parallel", False):
            value = weights.rank_slice(name, param.partition_dim, param.partition_stride, group)
        else:
            value = weights.whole(name)
        _materialize(decoder, name, value)
    rebuild_rotary(decoder)
    left = [name for name, buffer in decoder.named_buffers() if buffer.is_meta]  # every parameter was read
    if left:
        raise ConfigError(f"{where}: {SHARD} found no weights for {left[0]} in {weights.directory}")
    return decoder.eval()


def sharded_projection_weights(decoder: nn.Module, family: Family) -> int:
    """Elements this rank holds of the held layers' split projections (weights and sliced biases)."""
    return sum(
        p.numel()
        for _, _, module, _, _ in _projections(decoder, family)
        for p in module.parameters()
        if p.tensor_model_parallel
    )
