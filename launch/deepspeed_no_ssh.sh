#!/usr/bin/env bash
# The deepspeed launcher without ssh: run this on EVERY node, each with its own NODE_RANK
# (0 .. NNODES-1), the same MASTER_ADDR / MASTER_PORT and the same hostfile (it tells every node
# the world layout: slots per host).
#
#   # on each node:
#   NODE_RANK=0 MASTER_ADDR=10.0.0.1 HOSTFILE=launch/hostfile.example launch/deepspeed_no_ssh.sh configs/gpt2.yaml
#
# One machine, no hostfile, GPUs or CPU (set DS_ACCELERATOR=cpu without GPUs):
#   deepspeed --num_nodes 1 --num_gpus 2 --module parallel_latent train --config configs/tiny.yaml
set -euo pipefail
CONFIG=${1:?usage: $0 CONFIG [section.key=value ...]}
shift
: "${NODE_RANK:?set NODE_RANK}" "${MASTER_ADDR:?set MASTER_ADDR}"
HOSTFILE=${HOSTFILE:-launch/hostfile.example}
MASTER_PORT=${MASTER_PORT:-29500}
# DeepSpeed's launcher restarts nothing by itself: this script reruns it when a rank fails, up to
# MAX_RESTARTS times (default 3; bad input, status 2, is not retried), and each rerun resumes from
# the newest complete checkpoint (checkpoint.resume=auto).
attempt=0
while true; do
    status=0
    deepspeed --hostfile "$HOSTFILE" --no_ssh --node_rank "$NODE_RANK" \
        --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
        --module parallel_latent train --config "$CONFIG" "$@" || status=$?
    if ((status == 0 || status == 2 || attempt >= ${MAX_RESTARTS:-3})); then
        exit "$status"
    fi
    attempt=$((attempt + 1))
    echo "$(basename "$0"): the launcher ended with status $status; restart $attempt of ${MAX_RESTARTS:-3}" >&2
done

