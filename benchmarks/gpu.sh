#!/usr/bin/env bash
# GPU throughput of the realistic model, configs/gpt2.yaml (6+6 Perceiver blocks of width 768 over a
# 12-layer GPT-2, T=64), in bf16 through the real trainer: one short run per setting, then a table of
# tokens/s, MFU and peak memory side by side (benchmarks/bench_gpu.py does the runs).
#
#   benchmarks/gpu.sh                               # 1 process: NCCL, bf16; the default matrix
#   NPROC=8 benchmarks/gpu.sh parallel.tensor_parallel=2
#   MICRO_BATCHES="32" ZERO_STAGES="2" DROPOUTS="0.1" benchmarks/gpu.sh   # one setting
#   PRETRAINED=true benchmarks/gpu.sh               # the hub's gpt2 weights (needs hub access)
#
# The default matrix: dropout 0.1 / 0.0 x micro-batch 32 / 128 x ZeRO 1 / 2 (8 runs of STEPS steps).
# The GPT-2 weights do not change the cost, so by default it is built from its config (no hub).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}

if [ "${ALLOW_CPU:-0}" != 1 ]; then
    "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'benchmarks/gpu.sh: no CUDA device visible')"
fi
exec "$PYTHON" benchmarks/bench_gpu.py "$@"
