"""Training metrics: the run's metric sinks (``metrics.jsonl``, TensorBoard, the progress bar), the
window of steps between two log lines and its record, and the count of host synchronisations of
one step.

Only rank 0 writes; every number it writes is already agreed on by all ranks (the trainer
reduces counts over the data-parallel group before logging).
"""

from __future__ import annotations

import json
import math
import os
import sys
import warnings
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from parallel_latent.files import read_jsonl

__all__ = [
    "MetricsLogger",
    "Window",
    "counting_syncs",
    "finite_or_none",
    "progress_postfix",
    "train_record",
]


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
        records = read_jsonl(self.path)
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


# --------------------------------------------------------------------------- #
# What the trainer reports.
# --------------------------------------------------------------------------- #


@dataclass
class Window:
    """Statistics accumulated between two log lines. Throughput counts every step (host numbers);
    loss, accuracy and exact match (this rank's, on the device) count only the steps that were
    applied (a skipped step's non-finite loss would turn the window's means into NaN)."""

    stats: torch.Tensor  # the statistics vector (parallel_latent.evaluation.totals) on the device
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


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on the device (CUDA): a time taken after it counts what the GPU did."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


ATTENTION_KERNEL_WORDS = ("fmha", "flash", "attention", "attn", "cudnn")


@contextmanager
def profiling_kernels(enabled: bool, device: torch.device, logger: MetricsLogger, step: int) -> Iterator[None]:
    """On CUDA, the kernels the enclosed step ran (torch.profiler's CUDA activity): how many, the
    most frequent, and the attention kernels by name (which SDPA backend torch chose), logged as
    kind ``kernels``."""
    if not enabled or device.type != "cuda":
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as profiler:
        yield
        torch.cuda.synchronize(device)
    names = Counter(e.name for e in profiler.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    attention = {
        name[:120]: count for name, count in names.items() if any(w in name.lower() for w in ATTENTION_KERNEL_WORDS)
    }
    logger.write({"kind": "kernels", "step": step, "count": sum(names.values()), "attention": attention,
                  "most_frequent": [[name[:120], count] for name, count in names.most_common(10)]})  # fmt: skip
