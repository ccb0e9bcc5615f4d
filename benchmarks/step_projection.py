"""The step of configs/gpt2.yaml (a row of benchmarks/gpu.sh's matrix) projected for one H200 with the
performance model: the model's forward and backward traced on the meta device (benchmarks/meta_trace.py),
the rest of the step from a real CPU step (benchmarks/step_trace.py), every kernel timed by the roofline."""

from __future__ import annotations

import functools
import sys
import tempfile
from pathlib import Path

from benchmarks.meta_trace import row_config, trace_model
from benchmarks.performance import MFU_GOALS, PINNED, RANGES, Kernel, cuda_only, kernels_of, projection, top_costs
from benchmarks.step_trace import Op, real_step, real_step_on_ranks, real_step_overrides


def model_flops(cfg, recorded: dict | None = None) -> float:
    """The step's model FLOPs, the feature model's from its held layers (built on meta, from ``recorded`` if given)."""
    import torch

    from parallel_latent.feature_model import FeatureModel
    from parallel_latent.feature_model.features import random_features_unannounced
    from parallel_latent.training.flops import model_flops_per_sample

    vocab = cfg.model.vocab_size
    with torch.device("meta"), random_features_unannounced():
        features = FeatureModel(cfg.feature_model, vocab, recorded and {**recorded, "vocab_size": vocab})
    counts = (features.blocks, features.width, features.matmul_weights)
    return model_flops_per_sample(cfg, *counts)["train"] * cfg.training.micro_batch_size


@functools.cache
def rest_of_step(quick: bool, data_parallel: int = 1):
    """The real step's operators outside the model's forward and backward, and its hook calls (cached per size, DP)."""
    if data_parallel > 1:
        traced = real_step_on_ranks(data_parallel, quick)
    else:
        with tempfile.TemporaryDirectory(prefix="bench-projection.") as scratch:
            traced = real_step(real_step_overrides(Path(scratch), quick))
    return traced.rest, traced.hook_calls


def step_kernels(cfg, ops: list[Op], quick: bool, rest: bool, roofline=PINNED) -> list[Kernel]:
    """The kernels of one step: the traced model's, and with ``rest`` the rest of the step's."""
    kernels = kernels_of(ops, roofline)
    if rest:
        kernels += kernels_of(rest_of_step(quick, 1)[0], roofline) + cuda_only(cfg, roofline)
    return kernels


def project(setting: dict, quick: bool = False, rest: bool = True, recorded: dict | None = None) -> dict:
    """The projection of one gpu.sh setting, with its kernels and traced FLOPs; under ``ranges`` the same trace
    timed by each of RANGES. ``recorded``: the feature model's whole transformers config (feature_model_record)."""
    cfg = row_config(setting, quick)
    ops = trace_model(cfg, "cuda", recorded=recorded)
    kernels = step_kernels(cfg, ops, quick, rest)
    flops = model_flops(cfg, recorded)
    ranges = {name: projection(step_kernels(cfg, ops, quick, rest, roofline), flops, roofline)
              for name, roofline in RANGES.items()}  # fmt: skip
    return {**projection(kernels, flops), "ranges": ranges, "model_flops": flops,
            "traced_flops": sum(op.flops for op in ops), "top": top_costs(kernels),
            "kernel_list": kernels}  # fmt: skip


def project_row(setting: dict, *, quick: bool = False) -> dict | None:
    """Projected H200 step time and MFU of a gpu.sh setting, or None if it cannot be projected. The first
    call runs DeepSpeed steps on the CPU (tens of seconds at gpt2.yaml's size): call it before CUDA is
    initialised, or where DS_ACCELERATOR=cpu."""
    try:
        result = project(setting, quick)
    except Exception as error:  # a projection must never stop the measured table
        print(f"projection of {setting}: failed: {type(error).__name__}: {error}".splitlines()[0], file=sys.stderr)
        return None
    return {key: result[key] for key in ("step_ms_overlapped", "step_ms_summed", "mfu_overlapped", "mfu_summed")}


def matrix(quick: bool) -> list[tuple[str, dict, float | None]]:
    """(name, setting, MFU goal) of gpu.sh's rows (its micro-batches when quick)."""
    big, small = ("8", "4") if quick else ("256", "32")
    rows = [("default", "0.1", big), ("compile", "0.1", big), ("micro32", "0.1", small), ("dropout0", "0.0", big),
            ("dropout0 micro32", "0.0", small)]  # fmt: skip
    return [(name, {"model.dropout": dropout, "training.micro_batch_size": micro}
                   | ({"training.compile": "true"} if name == "compile" else {}), MFU_GOALS.get(name))
            for name, dropout, micro in rows]  # fmt: skip


def setting_label(setting: dict) -> str:
    """A row's setting in words (``dropout=0.1, micro_batch_size=256``), less the dropout kernel's switch."""
    return ", ".join(f"{k.split('.')[-1]}={v}" for k, v in setting.items() if k != "training.compile_dropout")
