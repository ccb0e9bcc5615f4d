#!/usr/bin/env bash
# GPU throughput of the realistic model, configs/gpt2.yaml (6+6 Perceiver blocks of width 768 over a
# 12-layer GPT-2, T=64), in bf16 through the real trainer, safe to run blind on a machine lent for
# minutes: every row measured within a deadline (DEADLINE_S, default 480 s from here: the install and
# the GPU tests included), each row within its own timeout, and a table of whatever finished
# (benchmarks/bench_gpu.py does the rows; its docstring lists the knobs).
#
#   benchmarks/gpu.sh                                  # 1 process: NCCL, bf16, every row
#   NPROC=8 benchmarks/gpu.sh parallel.tensor_parallel=2
#   ROWS=default,compile benchmarks/gpu.sh             # some rows
#   benchmarks/gpu.sh --json docs/benchmarks/gpu.json  # the figures for docs/benchmarks.md
#   benchmarks/gpu.sh --wheelhouse DIR                 # a node without network (tools/wheelhouse.sh)
#   benchmarks/gpu.sh --wheelhouse DIR --check-only    # install it and check the imports, run nothing
#   ALLOW_CPU=1 benchmarks/gpu.sh --quick              # the CPU test of this script
#
# In order: the interpreter (the first of $PYTHON, python3, python in which torch imports); its
# `pip freeze`, saved in GPU_OUT (default $OUT where the machine's runner sets it, else ./gpu-run)
# before anything is installed, so that the next wheelhouse for this node is exact
# (tools/wheelhouse.sh --freeze); with --wheelhouse DIR, the packages the interpreter lacks from DIR
# alone (pip --isolated --no-index into a fresh prefix, put on the path of the runs); the import
# check (tools/check_imports.py: what is missing is named in one line, and nothing runs); the GPU
# tests (`pytest -m gpu`, GPU_TESTS_S at most, their junit file in GPU_OUT: a failed dropout-kernel
# test makes the rows run eager dropout); then the rows.
set -euo pipefail
cd "$(dirname "$0")/.."
# DEADLINE_S counts from here: choosing the interpreter, a wheelhouse's install, the import check and
# the GPU tests are part of the minutes the machine is lent for.
export GPU_SH_STARTED_AT=$(date +%s.%N)

interpreter() {
    local candidate
    for candidate in ${PYTHON:+"$PYTHON"} python3 python; do
        if command -v "$candidate" >/dev/null && "$candidate" -c "import torch" 2>/dev/null; then
            command -v "$candidate"
            return
        fi
    done
    echo "gpu.sh: no interpreter in which torch imports (tried: ${PYTHON:+$PYTHON, }python3, python)" >&2
    exit 1
}

# pip's own output stays in a log: the one line says what went wrong. No configuration file either
# (--isolated alone still reads the machine-wide ones): their find-links would be a second source.
install_wheelhouse() {
    local wheelhouse=$1 log
    [[ -d "$wheelhouse" ]] || { echo "gpu.sh: --wheelhouse $wheelhouse: not a directory" >&2; exit 1; }
    prefix=$(mktemp -d "${TMPDIR:-/tmp}/parallel-latent-prefix.XXXXXX")
    log="$prefix.pip.log"
    if ! PIP_CONFIG_FILE=/dev/null "$PYTHON" -m pip --isolated install --no-index --find-links "$wheelhouse" --prefix "$prefix" \
        --no-warn-script-location 'parallel-latent[gpu]' >"$log" 2>&1; then
        echo "gpu.sh: installing from $wheelhouse with $PYTHON failed: $(grep -m1 ERROR "$log" || tail -n1 "$log") (log: $log)" >&2
        exit 1
    fi
    rm -f "$log"
    local site
    site=$(find "$prefix" -maxdepth 5 -type d -name 'parallel_latent-*.dist-info' -printf '%h\n' | head -n1)
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" PATH="$prefix/bin:$PATH"
}

# The GPU tests, before the rows: on a CPU they are collected and skipped with their reason.
gpu_tests() {
    local junit="$GPU_OUT/gpu-tests.xml" status=0
    if ! "$PYTHON" -c "import pytest" 2>/dev/null; then
        echo "GPU tests: not run (pytest is not installed for $PYTHON; a wheelhouse installs it)"
        return
    fi
    timeout "${GPU_TESTS_S:-60}" "$PYTHON" -m pytest -m gpu -q -p no:cacheprovider -o addopts="" -rs \
        --junitxml "$junit" tests/parallel/test_dropout.py tests/parallel/test_cross_entropy.py \
        tests/training/test_train_syncs.py tests/zero/test_patches.py >"$GPU_OUT/gpu-tests.log" 2>&1 || status=$?
    echo "GPU tests (pytest -m gpu, exit $status): $(tail -n1 "$GPU_OUT/gpu-tests.log")"
    export GPU_TESTS_XML="$junit"
}

wheelhouse="" check_only="" args=()
while (($#)); do
    case $1 in
    --wheelhouse) [[ $# -ge 2 ]] || { echo "gpu.sh: --wheelhouse needs a directory" >&2; exit 1; }
        wheelhouse=$2; shift 2 ;;
    --check-only) check_only=1; shift ;;
    *) args+=("$1"); shift ;;
    esac
done

PYTHON=$(interpreter)
GPU_OUT=${GPU_OUT:-${OUT:-gpu-run}}
mkdir -p "$GPU_OUT"
"$PYTHON" -m pip --isolated freeze >"$GPU_OUT/pip-freeze.txt" 2>/dev/null || true
prefix=""
trap '[[ -z "$prefix" ]] || rm -rf "$prefix"' EXIT
[[ -z "$wheelhouse" ]] || install_wheelhouse "$wheelhouse"
"$PYTHON" tools/check_imports.py
if [[ -n "$check_only" ]]; then  # a wheelhouse tried on the node before the minutes of the rows
    echo "gpu.sh: every import a run needs is there for $PYTHON${wheelhouse:+ with $wheelhouse}; nothing run (--check-only)"
    exit 0
fi
gpu_tests
"$PYTHON" -m benchmarks.bench_gpu ${args[@]+"${args[@]}"}
