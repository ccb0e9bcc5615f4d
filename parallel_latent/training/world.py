"""The world and the batch: how a job's processes split into tensor x data parallelism, the global
batch a config asks for, whether a config can run on so many processes (and so many per node), and
how a checkpoint's global batch is kept when a run resumes on another data-parallel size. Checked
before a launch (``parallel-latent train --nproc``) and at start-up (:mod:`parallel_latent.training.startup`);
the DeepSpeed config takes its batch sizes from here (:mod:`parallel_latent.training.engine_setup`)."""

from __future__ import annotations

import dataclasses

from parallel_latent.config import Config, ConfigError

__all__ = ["dp_size", "keep_global_batch", "resolved_global_batch_size", "validate_world"]


def dp_size(cfg: Config, world_size: int, source: str = "<runtime>") -> int:
    """Data-parallel degree: world = tensor_parallel x data_parallel (the one world-size check)."""
    tp = cfg.parallel.tensor_parallel
    if world_size < 1 or world_size % tp:
        raise ConfigError(f"{source}: world size {world_size} is not divisible by parallel.tensor_parallel={tp}")
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
    data_parallel = dp_size(cfg, world_size, source)
    if processes_per_node and processes_per_node % tp and not cfg.parallel.allow_tp_across_nodes:
        raise ConfigError(
            f"{source}: parallel.tensor_parallel={tp} does not divide the {processes_per_node} processes per node: "
            "tensor-parallel groups (consecutive ranks) would span nodes; choose a divisor of "
            f"{processes_per_node}, or set parallel.allow_tp_across_nodes=true"
        )
    training = cfg.training
    actual = resolved_global_batch_size(cfg, world_size)
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
