#!/usr/bin/env bash
# One machine, N processes (one per GPU; on CPU any N that TP divides).
#
#   NPROC=8 launch/torchrun_single_node.sh configs/gpt2.yaml parallel.tensor_parallel=2
#
# Same as `parallel-latent train --config CONFIG --nproc N`, spelled out.
set -euo pipefail
CONFIG=${1:?usage: $0 CONFIG [section.key=value ...]}
shift
NPROC=${NPROC:-$(python -c "import torch; print(max(torch.cuda.device_count(), 1))")}
exec torchrun --standalone --nproc_per_node "$NPROC" \
    -m parallel_latent train --config "$CONFIG" "$@"
