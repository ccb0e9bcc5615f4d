"""Training metrics: the FLOP count behind MFU, peak device throughput, peak memory, the run's
metric sinks (``metrics.jsonl``, TensorBoard, the progress bar) and what the trainer reports
through them: the window of steps between two log lines and its record, the start-up banner, the
closing summary, and the count of host synchronisations of one step.

Only rank 0 writes; every number it writes is already agreed on by all ranks (the trainer
reduces counts over the data-parallel group before logging).
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from parallel_latent.config import Config
from parallel_latent.model.features import random_features_notice

__all__ = [
    "PEAK_FLOPS_ENV",
    "MetricsLogger",
    "Window",
    "banner_lines",
    "counting_syncs",
    "finite_or_none",
    "model_flops_per_sample",
    "peak_flops_per_device",
    "peak_memory_bytes",
    "read_metrics",
    "summary_text",
    "train_record",
]

PEAK_FLOPS_ENV = "PARALLEL_LATENT_PEAK_FLOPS"


# --------------------------------------------------------------------------- #
# FLOPs.
# --------------------------------------------------------------------------- #


def model_flops_per_sample(
    cfg: Config, feature_blocks: int | None = None, feature_width: int | None = None
) -> dict[str, float]:
    """Model FLOPs of one training sample (T positions), from the config.

    Conventions (those of the PaLM / Megatron "model FLOPs utilisation"):

    * a multiply-add is 2 FLOPs; only matrix products are counted (norms, GELU, softmax,
      dropout, the loss are noise at these widths);
    * training costs **3x the forward** for trainable parts (forward 2N, backward 4N per token:
      the "6N" rule) and **1x the forward** for the frozen GPT-2, which runs without an autograd
      graph; activation recomputation is *not* counted (it is overhead, not model work);
    * padding positions are counted: the model computes on all T positions.

    Per sample, with d = model.d_model, T = model.max_length, r = model.mlp_ratio, V the
    tokenizer's vocabulary, f = feature_model.n_embd, and n = feature_model.n_layer - 2 GPT-2
    blocks actually run (hidden state -3):

    * one Perceiver block of Q queries over C context rows (keys/values: the context concatenated
      with the stream, C + Q): q and output projections 2 * 2*Q*d^2, k and v projections
      2 * 2*(C + Q)*d^2, scores and weighted sum 2 * 2*Q*(C + Q)*d, MLP 2 * 2*Q*d*(r*d); an
      encoder block has Q = N latents (``model.num_latents``, T by default) and C = T, a decoder
      block Q = T and C = N; at N = T that is (12 + 4r) * T * d^2 + 8 * T^2 * d;
    * the bottleneck (``model.latent_dim`` = k < d): 2 * N*d*k on each side;
    * the query MLP (d -> r*d -> d): 4r * T * d^2 when it runs per position (training with
      dropout: each query draws its own mask); otherwise it runs once per micro-batch on the one
      mask vector, 4r * d^2 / micro_batch_size per sample;
    * the vocabulary head: 2 * T * d * V;
    * one GPT-2 block (width f, MLP ratio 4, causal attention counted in full):
      24 * T * f^2 + 4 * T^2 * f.

    ``feature_blocks`` and ``feature_width`` are the GPT-2 actually loaded (a pretrained one has the
    hub's widths, whatever the YAML says); by default ``n_layer - 2`` and ``n_embd`` of the config.

    ``train = 3 * trainable_forward + frozen_forward`` (if the feature model is configured
    trainable, it moves to the first term), less one head forward when the head is tied to the
    frozen token table: its backward computes the input's gradient only (2x, not 3x).  The
    returned dict also holds the parts.
    """
    model, feature = cfg.model, cfg.feature_model
    d, t, r = model.d_model, model.max_length, model.mlp_ratio
    n, k = model.latent_count, model.latent_width
    f = feature.n_embd if feature_width is None else feature_width
    gpt2_blocks = max(0, feature.n_layer - 2) if feature_blocks is None else feature_blocks
    query_rows = t if model.dropout > 0 else 1 / max(1, cfg.training.micro_batch_size)

    def block_linear(queries: int, context: int) -> int:
        return (4 + 4 * r) * queries * d * d + 4 * (context + queries) * d * d

    linear = model.n_encoder_layers * block_linear(n, t) + model.n_decoder_layers * block_linear(t, n)
    attention = (model.n_encoder_layers * n + model.n_decoder_layers * t) * 4 * (t + n) * d
    parts = {
        "perceiver_linear": float(linear),
        "perceiver_attention": float(attention),
        "bottleneck": float(4 * n * d * k if model.has_bottleneck else 0),
        "query_mlp": float(4 * r * query_rows * d * d),
        "head": float(2 * t * d * model.vocab_size),
        "gpt2_linear": float(gpt2_blocks * 24 * t * f * f),
        "gpt2_attention": float(gpt2_blocks * 4 * t * t * f),
    }
    perceiver = parts["perceiver_linear"] + parts["perceiver_attention"] + parts["bottleneck"]
    perceiver += parts["query_mlp"] + parts["head"]
    gpt2 = parts["gpt2_linear"] + parts["gpt2_attention"]
    head_weight_frozen = getattr(model, "head", "normal") == "tied" and feature.frozen
    if feature.frozen:
        trainable_forward, frozen_forward = perceiver, gpt2
    else:
        trainable_forward, frozen_forward = perceiver + gpt2, 0.0
    return {
        **parts,
        "trainable_forward": trainable_forward,
        "frozen_forward": frozen_forward,
        "train": 3 * trainable_forward + frozen_forward - (parts["head"] if head_weight_frozen else 0.0),
    }


# Dense (no sparsity) peak FLOP/s per device, by dtype.  fp32 means plain fp32 (PyTorch does not
# use TF32 for matmuls by default).  Matched by substring of torch.cuda.get_device_name().
# More specific names come first: "H100 NVL" before "H100". The NVL parts (PCIe cards bridged in
# pairs) have their own, lower clocks: 1,671 TFLOP/s bf16 *with sparsity*, so 835 dense.
PEAK_FLOPS_TABLE: list[tuple[str, dict[str, float]]] = [
    ("H200 NVL", {"bf16": 835e12, "fp16": 835e12, "fp32": 60e12}),
    ("H100 NVL", {"bf16": 835e12, "fp16": 835e12, "fp32": 60e12}),
    ("H200", {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}),
    ("H100 PCIe", {"bf16": 756e12, "fp16": 756e12, "fp32": 51e12}),
    ("H100", {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}),
    ("GH200", {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}),
    ("A100", {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12}),
    ("L40S", {"bf16": 362e12, "fp16": 362e12, "fp32": 91.6e12}),
    ("A10G", {"bf16": 70e12, "fp16": 70e12, "fp32": 31.2e12}),
    ("A10", {"bf16": 125e12, "fp16": 125e12, "fp32": 31.2e12}),
    ("L4", {"bf16": 121e12, "fp16": 121e12, "fp32": 30.3e12}),
    ("V100", {"bf16": 15.7e12, "fp16": 125e12, "fp32": 15.7e12}),
    ("MI300X", {"bf16": 1307e12, "fp16": 1307e12, "fp32": 163e12}),
]
# CPU assumption: 32 fp32 FLOP per cycle per core (two 256-bit FMA units, AVX2) at 3 GHz, times
# the threads the rank computes with.  A rough upper bound for a modern x86 core, stated so the
# MFU figure can be read; set PARALLEL_LATENT_PEAK_FLOPS for a measured or vendor figure.
CPU_FLOPS_PER_CORE = 32 * 3.0e9


def peak_flops_per_device(device: str, precision: str, env: dict | None = None) -> tuple[float, str]:
    """(peak FLOP/s of one rank's device, where the number comes from).

    ``PARALLEL_LATENT_PEAK_FLOPS`` (FLOP/s per device) overrides everything.  Returns
    ``(nan, reason)`` for an unknown GPU, so MFU is reported as null rather than invented.
    """
    env = os.environ if env is None else env
    if env.get(PEAK_FLOPS_ENV):
        return float(env[PEAK_FLOPS_ENV]), f"${PEAK_FLOPS_ENV}"
    if device == "cuda" and torch.cuda.is_available():
        return gpu_peak_flops(torch.cuda.get_device_name(), precision)
    threads = torch.get_num_threads()
    per_cycle = 16 if precision == "fp64" else 32  # a 256-bit FMA holds 4 doubles or 8 floats
    return CPU_FLOPS_PER_CORE * per_cycle / 32 * threads, (
        f"CPU assumption: {threads} thread(s) x {per_cycle} FLOP/cycle x 3 GHz"
    )


def gpu_peak_flops(name: str, precision: str) -> tuple[float, str]:
    """(dense peak FLOP/s, source) of the GPU called ``name`` (torch.cuda.get_device_name())."""
    for key, by_dtype in PEAK_FLOPS_TABLE:
        if key in name:
            if precision not in by_dtype:
                return math.nan, f"table: {key} has no {precision} peak: set ${PEAK_FLOPS_ENV}"
            return by_dtype[precision], f"table: {key} {precision}"
    return math.nan, f"unknown GPU {name!r}: set ${PEAK_FLOPS_ENV}"


def peak_memory_bytes(device: str) -> tuple[int, str]:
    """(peak memory of this process so far, what was measured): the CUDA caching allocator's
    peak of allocated bytes on a GPU, the peak resident set size on CPU."""
    if device == "cuda" and torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated()), "cuda_max_allocated"
    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(max_rss if sys.platform == "darwin" else max_rss * 1024), "cpu_max_rss"


def finite_or_none(value: Any) -> Any:
    """JSON has no NaN/inf: non-finite floats (and tensors) become null."""
    if isinstance(value, torch.Tensor):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


# --------------------------------------------------------------------------- #
# Sinks.
# --------------------------------------------------------------------------- #


class MetricsLogger:
    """``<run_dir>/metrics.jsonl`` (one JSON object per line, flushed as written), TensorBoard
    events under ``<run_dir>/tensorboard`` when ``tensorboard`` is importable, and a tqdm bar.

    Lines are ``{"kind": "train", "step": ..., ...}`` and ``{"kind": "eval", "step": ..., ...}``.
    On resume, lines of steps after the resumed step (written by the interrupted run after its
    last checkpoint) are dropped, so every step appears once.
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        enabled: bool,
        total_steps: int,
        start_step: int = 0,
        tensorboard: bool = True,
        progress_bar: bool = True,
    ):
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self.tensorboard = None
        self.bar = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._truncate_after(start_step)
        # Open for the logger's lifetime (closed by close()); lines are flushed as they are written.
        self.file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # optional extra `tensorboard` not installed
                SummaryWriter = None
            if SummaryWriter is not None:
                self.tensorboard = SummaryWriter(str(Path(run_dir) / "tensorboard"), purge_step=start_step + 1)
        if progress_bar:
            from tqdm.auto import tqdm

            self.bar = tqdm(
                total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True, file=sys.stderr
            )

    def _truncate_after(self, step: int) -> None:
        """One record per step: a run resumed at ``step`` (after a crash, or from an older checkpoint
        when a newer one was damaged) moves the records past it to ``metrics.after-step_<step>.jsonl``
        (appended: kept, never deleted) before it writes its own."""
        if not self.path.exists():
            return
        records = read_metrics(self.path)
        kept = [record for record in records if record.get("step", 0) <= step]
        if len(kept) == len(records):
            return
        with open(self.path.with_name(f"metrics.after-step_{step:08d}.jsonl"), "a", encoding="utf-8") as side:
            for record in records:
                if record.get("step", 0) > step:
                    side.write(json.dumps(record) + "\n")
        temporary = self.path.with_suffix(".jsonl.tmp")
        with open(temporary, "w", encoding="utf-8") as handle:
            for record in kept:
                handle.write(json.dumps(record) + "\n")
        os.replace(temporary, self.path)

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        clean = {key: finite_or_none(value) for key, value in record.items()}
        self.file.write(json.dumps(clean) + "\n")
        self.file.flush()
        if self.tensorboard is not None:
            kind, step = record.get("kind", "train"), int(record["step"])
            for key, value in clean.items():
                if key not in ("kind", "step") and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.tensorboard.add_scalar(f"{kind}/{key}", value, step)

    def advance(self, steps: int = 1, **postfix: Any) -> None:
        if self.bar is not None:
            if postfix:
                self.bar.set_postfix(postfix, refresh=False)
            self.bar.update(steps)

    def print(self, message: str) -> None:
        """A console line that does not break the progress bar (rank 0 only)."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(message, file=sys.stderr)
        else:
            print(message, file=sys.stderr, flush=True)

    def close(self) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None
        self.file.close()
        self.enabled = False


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl (a torn last line, from a killed run, is ignored)."""
    records = []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            line = line.strip()
            if not line:
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


# --------------------------------------------------------------------------- #
# What the trainer reports.
# --------------------------------------------------------------------------- #


@dataclass
class Window:
    """Statistics accumulated between two log lines. Throughput counts every step (host numbers);
    loss, accuracy and exact match (this rank's, on the device) count only the steps that were
    applied (a skipped step's non-finite loss would turn the window's means into NaN)."""

    stats: torch.Tensor  # the statistics vector (parallel_latent.quality's layout) on the device
    steps: int = 0
    seconds: float = 0.0
    tokens_processed: float = 0.0
    samples_processed: float = 0.0

    def add(self, outcome: Any, seconds: float) -> None:
        """One step's outcome (``stats``, ``applied``, ``tokens``, ``samples``) and its time."""
        self.steps += 1
        self.seconds += seconds
        self.tokens_processed += outcome.tokens
        self.samples_processed += outcome.samples
        if outcome.applied:
            self.stats += outcome.stats


def train_record(window: Window, totals: list[float], **facts: Any) -> dict[str, Any]:
    """The ``train`` line of metrics.jsonl for a window whose statistics, summed over the world, are
    ``totals``. ``facts``: step, lr, grad_norm, skipped_steps, flops_per_sample, world_size,
    peak_flops, memory_bytes."""
    seconds = max(window.seconds, 1e-9)
    samples_per_s = window.samples_processed / seconds
    model_flops_per_s = facts["flops_per_sample"] * samples_per_s
    loss_sum, tokens, correct, exact, samples = totals
    finite = tokens > 0
    grad_norm = facts["grad_norm"]
    return {
        "kind": "train",
        "step": facts["step"],
        "loss": loss_sum / tokens if finite else math.nan,
        "token_accuracy": correct / tokens if finite else math.nan,
        "exact_match": exact / samples if finite else math.nan,
        "lr": facts["lr"],
        "grad_norm": float(grad_norm) if grad_norm is not None else None,
        "tokens": int(window.tokens_processed),  # non-pad tokens of the window, all ranks
        "samples": int(window.samples_processed),
        "tokens_per_s": window.tokens_processed / seconds,
        "samples_per_s": samples_per_s,
        "step_time_s": seconds / window.steps,
        "mfu": model_flops_per_s / (facts["world_size"] * facts["peak_flops"]),
        "model_tflops_per_device": model_flops_per_s / facts["world_size"] / 1e12,
        "peak_memory_gb": facts["memory_bytes"] / 2**30,  # this rank (rank 0)
        "skipped_steps": facts["skipped_steps"],
        "steps_in_window": window.steps,
    }


def progress_postfix(record: dict[str, Any]) -> dict[str, str]:
    return {
        "loss": f"{record['loss']:.4f}",
        "acc": f"{record['token_accuracy']:.3f}",
        "tok/s": f"{record['tokens_per_s']:.0f}",
    }


def banner_lines(run: Any, trainable: int, global_batch: int, peak_flops_source: str) -> list[str]:
    """What rank 0 prints at start-up: the layout, the data, the batch, the trainable parameters,
    how gradients are reduced, random features, the TP switches, the MFU peak on a CPU."""
    s, cfg = run.state, run.cfg
    lines = [
        f"parallel-latent: {s.world_size} rank(s) = TP {s.tp_size} x DP {s.dp_size}, ZeRO stage "
        f"{cfg.parallel.zero_stage}, {cfg.training.precision}, {run.device_kind}; "
        f"{len(run.train_set)} train / {len(run.eval_set)} held-out samples of {cfg.model.max_length} tokens; "
        f"global batch {global_batch}; {trainable:,} trainable parameters on rank 0; run dir {run.run_dir}"
    ]
    zero = run.bundle.config["zero_optimization"]
    reduce_dtype = run.bundle.config.get("communication_data_type", cfg.training.precision)
    lines.append(
        f"data parallelism: gradients reduced in {reduce_dtype}"
        + (f", overlapped with backward: {'on' if zero.get('overlap_comm') else 'off'}" if zero["stage"] else "")
    )
    if not cfg.feature_model.pretrained:
        lines.append(random_features_notice(cfg.feature_model))
    model = cfg.model
    if model.compresses_positions or model.has_bottleneck or model.predict_length:
        floats = model.latent_count * model.latent_width
        lines.append(
            f"latents: {model.latent_count} x {model.latent_width} per sample ({floats / model.max_length:g} floats "
            f"per token), length {'predicted' if model.predict_length else 'from the attention mask'}"
        )
    if s.tp_size > 1:
        lines.append(f"tensor parallelism: {tp_options_line(cfg, run.model)}")
    if run.device_kind == "cpu":
        lines.append(f"MFU peak: {peak_flops_source}")
    return lines


def tp_options_line(cfg: Config, model: Any) -> str:
    if model.split_feature_model:
        features = "frozen feature pass split over the TP group (one all-gather of the features)"
    elif not cfg.feature_model.frozen:
        features = "feature pass replicated on every TP rank (the feature model trains)"
    else:
        features = "feature pass replicated on every TP rank (parallel.split_feature_model=false)"
    sequence = "sequence parallel" if model.sequence_parallel else "no sequence parallelism"
    overlap = "backward collective overlapped" if cfg.parallel.tp_overlap_comm else "backward collective not overlapped"
    return f"{features}; {sequence}; {overlap}"


def summary_text(result: Any) -> str:
    """What rank 0 prints when training ends (``result``: a TrainResult)."""
    lines = [f"done: {result.step} steps in {result.wall_time_s:.0f} s ({result.skipped_steps} skipped)"]
    if result.final_eval:
        e = result.final_eval
        lines.append(
            f"held-out: loss {e['eval_loss']:.4f}, token accuracy {e['eval_token_accuracy']:.4f}, "
            f"exact match {e['eval_exact_match']:.4f}, BLEU {e['eval_bleu']:.2f}"
        )
    if result.reconstructions:
        lines.append("held-out samples, as the model saw them, and their reconstructions:")
    for original, reconstructed in result.reconstructions:
        lines.append(f"  input:         {original}")
        lines.append(f"  reconstructed: {reconstructed}")
    if result.checkpoint:
        lines.append(f"checkpoint: {result.checkpoint}")
    return "\n".join(lines)


@contextmanager
def counting_syncs(enabled: bool, device: torch.device, logger: MetricsLogger, step: int) -> Iterator[None]:
    """On CUDA, count the host-device synchronisations of the enclosed step (torch warns at each
    one in its sync debug mode) and log them with their first sources (kind ``syncs``)."""
    if not enabled or device.type != "cuda":
        yield
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    sources = sorted({f"{Path(w.filename).name}:{w.lineno}" for w in syncs})
    logger.write({"kind": "syncs", "step": step, "count": len(syncs), "sources": sources[:20]})
