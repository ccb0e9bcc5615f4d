#!/usr/bin/env bash
# A wheelhouse for a GPU node without network, built on a machine with network: the project's wheel
# and exactly the distributions the node lacks, for the node's Python and platform (what
# `benchmarks/gpu.sh --wheelhouse DIR` installs there; tools/wheelhouse.py explains how).
#
#   # on the node:  python3 -m pip freeze > node-freeze.txt   (then bring the file here)
#   tools/wheelhouse.sh --python-version 3.12 --platform manylinux_2_28_x86_64 \
#       --freeze node-freeze.txt --out wheelhouse/
#   tools/wheelhouse.sh --python-version 3.12 --platform manylinux_2_28_x86_64 \
#       --missing deepspeed datasets hjson --out wheelhouse/      # or name what it lacks
#
# The interpreter that runs pip here: $PYTHON, else python3 (any version: wheels are chosen for the
# node's). The sizes printed at the end: the goal is under 40 MiB.
set -euo pipefail
exec "${PYTHON:-python3}" "$(dirname "$0")/wheelhouse.py" "$@"
