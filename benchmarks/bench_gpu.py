"""The runs behind benchmarks/gpu.sh: configs/gpt2.yaml in bf16, one short training run per setting
of the matrix, each through `parallel-latent train` (so each is also a smoke test of the GPU path:
NCCL, bf16, DeepSpeed ZeRO, the compiled dropout masks), then one table.

Settings come from the environment (space-separated lists): DROPOUTS, MICRO_BATCHES, ZERO_STAGES;
NPROC processes, STEPS steps (the first logging window, warm-up, is left out of the means),
LOG_EVERY, PRETRAINED. Extra arguments are config overrides applied to every run.

With several processes and parallel.tensor_parallel > 1 among the overrides, the first setting is
also run with each TP switch flipped (the split feature pass off, sequence parallelism on, the
backward overlap off), so their effect shows side by side (TP_SWITCHES=0 leaves them out).
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def settings() -> list[dict]:
    dropouts = os.environ.get("DROPOUTS", "0.1 0.0").split()
    micro_batches = os.environ.get("MICRO_BATCHES", "32 128").split()
    stages = os.environ.get("ZERO_STAGES", "1 2").split()
    matrix = [
        {"model.dropout": d, "training.micro_batch_size": m, "parallel.zero_stage": z}
        for d, m, z in itertools.product(dropouts, micro_batches, stages)
    ]
    tensor_parallel = next(
        (int(arg.split("=", 1)[1]) for arg in sys.argv[1:] if arg.startswith("parallel.tensor_parallel=")), 1
    )
    if tensor_parallel > 1 and os.environ.get("TP_SWITCHES", "1") != "0":
        for switch in (
            {"parallel.split_feature_model": "false"},
            {"parallel.sequence_parallel": "true"},
            {"parallel.tp_overlap_comm": "false"},
        ):
            matrix.append({**matrix[0], **switch})
    return matrix


def run(setting: dict, extra: list[str], run_dir: Path) -> dict:
    nproc = os.environ.get("NPROC", "1")
    steps = os.environ.get("STEPS", "60")
    log_every = os.environ.get("LOG_EVERY", "10")
    command = [
        sys.executable, "-m", "parallel_latent", "train", "--config", "configs/gpt2.yaml", "--nproc", nproc,
        f"feature_model.pretrained={os.environ.get('PRETRAINED', 'false')}", "training.precision=bf16",
        f"training.max_steps={steps}", f"training.log_every={log_every}", "training.eval_every=0",
        "checkpoint.save_every=0", "checkpoint.export_portable=false", "checkpoint.resume=never",
        f"logging.run_dir={run_dir}", "logging.tensorboard=false", "logging.progress_bar=false",
        *[f"{key}={value}" for key, value in setting.items()], *extra,
    ]  # fmt: skip
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        return {"error": (result.stderr or result.stdout).strip().splitlines()[-1:]}
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    steady = train[1:] or train  # the first window holds warm-up (allocator, kernel selection, compile)

    def mean(key: str) -> float:
        values = [r[key] for r in steady if r.get(key) is not None]
        return statistics.mean(values) if values else float("nan")

    return {
        "steps": f"{steady[0]['step'] - steady[0]['steps_in_window'] + 1}-{steady[-1]['step']}",
        "tokens_per_s": mean("tokens_per_s"),
        "step_ms": mean("step_time_s") * 1e3,
        "mfu": mean("mfu"),
        "tflops": mean("model_tflops_per_device"),
        "peak_gib": max(r["peak_memory_gb"] for r in train),
        "loss": steady[-1]["loss"],
    }


def main() -> int:
    extra = sys.argv[1:]
    rows = []
    with tempfile.TemporaryDirectory(prefix="parallel-latent-gpu-bench.") as scratch:
        for index, setting in enumerate(settings()):
            result = run(setting, extra, Path(scratch) / f"run{index}")
            rows.append((setting, result))
            label = ", ".join(f"{k.split('.')[-1]}={v}" for k, v in setting.items())
            if "error" in result:
                print(f"gpt2.yaml, bf16, {label}: FAILED: {' '.join(result['error'])}", flush=True)
                continue
            print(
                f"gpt2.yaml, bf16, {label}, steps {result['steps']}: {result['tokens_per_s']:,.0f} tokens/s "
                f"(non-pad), step {result['step_ms']:.1f} ms, MFU {result['mfu'] * 100:.1f}%, "
                f"{result['tflops']:.1f} model TFLOP/s per device, peak memory {result['peak_gib']:.2f} GiB (rank 0)",
                flush=True,
            )
    print()
    print(
        f"{'dropout':>7} {'micro':>5} {'ZeRO':>4} {'tokens/s':>12} {'step ms':>8} {'MFU %':>6} {'peak GiB':>8}  switch"
    )
    for setting, result in rows:
        if "error" in result:
            continue
        switch = " ".join(f"{k.split('.')[-1]}={v}" for k, v in setting.items() if k.startswith("parallel.") and
                          k != "parallel.zero_stage")  # fmt: skip
        print(
            f"{setting['model.dropout']:>7} {setting['training.micro_batch_size']:>5} "
            f"{setting['parallel.zero_stage']:>4} {result['tokens_per_s']:>12,.0f} {result['step_ms']:>8.1f} "
            f"{result['mfu'] * 100:>6.1f} {result['peak_gib']:>8.2f}  {switch}".rstrip()
        )
    return 1 if any("error" in result for _, result in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
