"""What rank 0 prints about a run: the start-up banner (the layout, the data, the batch, how gradients
are reduced, the TP switches) and the closing summary.
"""

from __future__ import annotations

from typing import Any

from parallel_latent.config import Config
from parallel_latent.feature_model.features import random_features_notice

__all__ = ["banner_lines", "summary_text", "tp_options_line"]


def banner_lines(
    run: Any, trainable: int, global_batch: int, peak_flops_source: str, frozen_share: float = 0.0
) -> list[str]:
    """What rank 0 prints at start-up: the layout, the data, the batch, the trainable parameters,
    how gradients are reduced, random features, what the encoder reads (the feature statistics and
    the frozen pass's share of a step's FLOPs), the TP switches, the MFU peak on a CPU."""
    s, cfg = run.state, run.cfg
    lines = [
        f"parallel-latent: {s.world_size} rank(s) = TP {s.tp_size} x DP {s.dp_size}, ZeRO stage "
        f"{cfg.parallel.zero_stage}, {cfg.training.precision}, {run.device_kind}; "
        f"{len(run.train_set)} train / {len(run.eval_set)} held-out samples of {cfg.model.max_length} tokens; "
        f"global batch {global_batch}; {trainable:,} trainable parameters on rank 0; run dir {run.run_dir}"
    ]
    zero = run.bundle.config["zero_optimization"]
    reduce_dtype = run.bundle.config.get("communication_data_type", cfg.training.precision)
    if hasattr(run.bundle.optimizer, "bulk_gradients"):  # zero.patches.bulk_zero_gradients applied
        how = ", in bulk after backward (one multi-tensor copy, one all-reduce)"
    elif zero["stage"]:
        how = f", overlapped with backward: {'on' if zero.get('overlap_comm') else 'off'}"
    else:
        how = ""
    lines.append(f"data parallelism: gradients reduced in {reduce_dtype}{how}")
    if not cfg.feature_model.pretrained:
        lines.append(random_features_notice(cfg.feature_model))
    lines.append(features_line(run, frozen_share))
    model = cfg.model
    if model.compresses_positions or model.has_bottleneck or model.predict_length:
        floats = model.latent_count * model.latent_width
        lines.append(
            f"latents: {model.latent_count} x {model.latent_width} per sample ({floats / model.max_length:g} floats "
            f"per token), length {'predicted' if model.predict_length else 'from the attention mask'}"
        )
    if s.tp_size > 1:
        cached = getattr(run.train_set, "features", None) is not None
        lines.append(f"tensor parallelism: {tp_options_line(cfg, run.model, cached)}")
    if run.device_kind == "cpu":
        lines.append(f"MFU peak: {peak_flops_source}")
    return lines


def features_line(run: Any, frozen_share: float) -> str:
    """How the encoder's input is made, and what the frozen pass costs of a training step."""
    cfg, norm = run.cfg, run.model.feature_norm
    where = cfg.feature_model.name_or_path if cfg.feature_model.pretrained else "a random build"
    line = f"features: hidden state {cfg.feature_model.hidden_state} of {where}"
    if norm is not None:
        source = "read from the checkpoint" if run.resume_path is not None else "measured at the start"
        line += f", standardised per feature (statistics of {int(norm.tokens):,} tokens, {source})"
    cache = getattr(run.train_set, "features", None)
    if cache is not None:
        line += (
            f"; read from the feature cache ({cache.spec.directory}), not computed: {100 * frozen_share:.0f}% of a "
            "training step's FLOPs saved"
        )
    elif cfg.feature_model.frozen:
        line += f"; the frozen feature pass is {100 * frozen_share:.0f}% of a training step's FLOPs"
    return line


def tp_options_line(cfg: Config, model: Any, cached: bool = False) -> str:
    if cached:
        features = "features read from the feature cache on every TP rank (no frozen pass, no collective)"
    elif model.feature_model.sharded:
        features = (
            "frozen decoder sharded over the TP group (feature_model.parallel=shard: 1/tp of each layer per rank, "
            "2 all-reduces per layer)"
        )
    elif model.split_feature_model:
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
