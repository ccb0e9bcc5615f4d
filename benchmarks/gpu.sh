#!/usr/bin/env bash
# GPU throughput of the realistic model, configs/gpt2.yaml (6+6 Perceiver blocks of width 768 over a
# 12-layer GPT-2, T=64), in bf16 through the real trainer, safe to run blind on a machine lent for
# minutes: a deadline (DEADLINE_S, default 420 s), a timeout per run, and a table of whatever
# finished (benchmarks/bench_gpu.py does the runs; its docstring lists the knobs).
#
#   benchmarks/gpu.sh                                  # 1 process: NCCL, bf16, the default matrix
#   NPROC=8 benchmarks/gpu.sh parallel.tensor_parallel=2
#   MICRO_BATCHES="256" DROPOUTS="0.1" benchmarks/gpu.sh   # one setting
#   benchmarks/gpu.sh --json docs/benchmarks/gpu.json  # the figures for docs/benchmarks.md
#   ALLOW_CPU=1 DEADLINE_S=40 benchmarks/gpu.sh --quick    # the CPU test of this script
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$(command -v python || command -v python3)}
exec "$PYTHON" benchmarks/bench_gpu.py "$@"
