#!/usr/bin/env bash
# Several machines: run this on EVERY node with the same MASTER_ADDR / MASTER_PORT / NNODES and
# that node's NODE_RANK (0 .. NNODES-1).  c10d rendezvous: the agents meet at MASTER_ADDR:MASTER_PORT
# (served by the agent on that host), agree on the membership and number the ranks node by node,
# so each tensor-parallel group (consecutive ranks) stays inside a node.
#
#   # node 0 (its address is 10.0.0.1):
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 launch/torchrun_multi_node.sh configs/gpt2.yaml
#   # node 1:
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 launch/torchrun_multi_node.sh configs/gpt2.yaml
#
# Two nodes on one machine (how the tests exercise it): MASTER_ADDR=127.0.0.1 NPROC_PER_NODE=2.
# A rank that dies makes every agent restart its ranks (up to MAX_RESTARTS times, default 3): they
# meet again and resume from the newest complete checkpoint.
set -euo pipefail
CONFIG=${1:?usage: $0 CONFIG [section.key=value ...]}
shift
: "${NNODES:?set NNODES}" "${NODE_RANK:?set NODE_RANK}" "${MASTER_ADDR:?set MASTER_ADDR}"
MASTER_PORT=${MASTER_PORT:-29500}
NPROC_PER_NODE=${NPROC_PER_NODE:-$(python -c "import torch; print(max(torch.cuda.device_count(), 1))")}
RDZV_ID=${RDZV_ID:-parallel-latent}
# On SIGTERM the agent forwards it to the ranks and gives them this long to checkpoint and exit.
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-100}
exec torchrun \
    --nnodes "$NNODES" --node_rank "$NODE_RANK" --nproc_per_node "$NPROC_PER_NODE" \
    --rdzv_backend c10d --rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv_id "$RDZV_ID" \
    --max-restarts "${MAX_RESTARTS:-3}" \
    -m parallel_latent train --config "$CONFIG" "$@"
