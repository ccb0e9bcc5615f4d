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
#   benchmarks/gpu.sh --wheelhouse DIR                 # a node without network (tools/wheelhouse.sh)
#   ALLOW_CPU=1 DEADLINE_S=40 benchmarks/gpu.sh --quick    # the CPU test of this script
#
# The interpreter is the first of $PYTHON, python3, python in which torch imports. --wheelhouse DIR
# installs the packages the interpreter lacks from DIR alone (pip --isolated --no-index: no index,
# config file or PIP_* variable can add a source) into a fresh prefix, put on the path of the runs.
# Before any run, every import the runs need is checked (tools/check_imports.py): what is
# missing is named in one line, and nothing runs.
set -euo pipefail
cd "$(dirname "$0")/.."
# DEADLINE_S counts from here: choosing the interpreter, a wheelhouse's install and the import check
# are part of the minutes the machine is lent for.
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

# pip's own output stays in a log: the one line says what went wrong.
install_wheelhouse() {
    local wheelhouse=$1 log
    [[ -d "$wheelhouse" ]] || { echo "gpu.sh: --wheelhouse $wheelhouse: not a directory" >&2; exit 1; }
    prefix=$(mktemp -d "${TMPDIR:-/tmp}/parallel-latent-prefix.XXXXXX")
    log="$prefix.pip.log"
    if ! "$PYTHON" -m pip --isolated install --no-index --find-links "$wheelhouse" --prefix "$prefix" \
        --no-warn-script-location parallel-latent >"$log" 2>&1; then
        echo "gpu.sh: installing from $wheelhouse with $PYTHON failed: $(grep -m1 ERROR "$log" || tail -n1 "$log") (log: $log)" >&2
        exit 1
    fi
    rm -f "$log"
    local site
    site=$(find "$prefix" -maxdepth 5 -type d -name 'parallel_latent-*.dist-info' -printf '%h\n' | head -n1)
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" PATH="$prefix/bin:$PATH"
}

wheelhouse="" args=()
while (($#)); do
    case $1 in
    --wheelhouse) [[ $# -ge 2 ]] || { echo "gpu.sh: --wheelhouse needs a directory" >&2; exit 1; }
        wheelhouse=$2; shift 2 ;;
    *) args+=("$1"); shift ;;
    esac
done

PYTHON=$(interpreter)
prefix=""
trap '[[ -z "$prefix" ]] || rm -rf "$prefix"' EXIT
[[ -z "$wheelhouse" ]] || install_wheelhouse "$wheelhouse"
"$PYTHON" tools/check_imports.py
"$PYTHON" benchmarks/bench_gpu.py ${args[@]+"${args[@]}"}
