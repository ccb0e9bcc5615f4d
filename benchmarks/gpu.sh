#!/usr/bin/env bash
# GPU throughput of the realistic model: configs/gpt2.yaml (6+6 Perceiver blocks of width 768 over a
# 12-layer GPT-2, T=64, micro-batch 32) in bf16 through the real trainer, a few dozen steps; prints
# tokens/s and MFU (model FLOPs: see parallel_latent/metrics.py, peak from its table or
# $PARALLEL_LATENT_PEAK_FLOPS).
#
#   benchmarks/gpu.sh                           # 1 process (NCCL, single rank), random-weight GPT-2
#   NPROC=8 benchmarks/gpu.sh parallel.tensor_parallel=2
#   PRETRAINED=true benchmarks/gpu.sh           # the hub's gpt2 weights (needs hub access)
#
# The GPT-2 weights do not change the cost, so by default it is built from its config
# (feature_model.pretrained=false) and needs no model hub.
set -euo pipefail
cd "$(dirname "$0")/.."

NPROC=${NPROC:-1}
STEPS=${STEPS:-60}
LOG_EVERY=${LOG_EVERY:-10}
PRETRAINED=${PRETRAINED:-false}
PYTHON=${PYTHON:-python}

if [ "${ALLOW_CPU:-0}" != 1 ]; then
    "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'benchmarks/gpu.sh: no CUDA device visible')"
fi

RUN_DIR=$(mktemp -d "${TMPDIR:-/tmp}/parallel-latent-gpu-bench.XXXXXX")
trap 'rm -rf "$RUN_DIR"' EXIT

"$PYTHON" -m parallel_latent train --config configs/gpt2.yaml --nproc "$NPROC" \
    feature_model.pretrained="$PRETRAINED" training.precision=bf16 \
    training.max_steps="$STEPS" training.log_every="$LOG_EVERY" training.eval_every=0 \
    checkpoint.save_every=0 checkpoint.export_portable=false checkpoint.resume=never \
    logging.run_dir="$RUN_DIR/run" logging.tensorboard=false logging.progress_bar=false \
    "$@"

"$PYTHON" - "$RUN_DIR/run" <<'PY'
import json, statistics, sys
from pathlib import Path

records = [json.loads(line) for line in (Path(sys.argv[1]) / "metrics.jsonl").read_text().splitlines()]
train = [r for r in records if r["kind"] == "train"]
steady = train[1:] or train  # the first window holds warm-up (allocator, kernel selection)
def mean(key):
    values = [r[key] for r in steady if r.get(key) is not None]
    return statistics.mean(values) if values else float("nan")
print(f"gpt2.yaml, bf16, steps {steady[0]['step'] - steady[0]['steps_in_window'] + 1}-{steady[-1]['step']}: "
      f"{mean('tokens_per_s'):,.0f} tokens/s (non-pad), {mean('samples_per_s'):,.1f} samples/s, "
      f"step {mean('step_time_s') * 1e3:.1f} ms, MFU {mean('mfu') * 100:.1f}%, "
      f"{mean('model_tflops_per_device'):.1f} model TFLOP/s per device, "
      f"peak memory {max(r['peak_memory_gb'] for r in train):.2f} GiB (rank 0)")
PY
