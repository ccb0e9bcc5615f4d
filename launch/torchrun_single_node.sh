#!/usr/bin/env bash
# One machine, N processes (one per GPU; on CPU any N that TP divides).
#
#   NPROC=8 launch/torchrun_single_node.sh configs/gpt2.yaml parallel.tensor_parallel=2
#
# Same as `parallel-latent train --config CONFIG --nproc N --max-restarts R`, spelled out: a rank
# that dies makes torchrun restart every rank (up to MAX_RESTARTS times, default 3), each restart
# resuming from the newest complete checkpoint and saying so in one line.
set -euo pipefail
CONFIG=${1:?usage: $0 CONFIG [section.key=value ...]}
shift
NPROC=${NPROC:-$(python -c "import torch; print(max(torch.cuda.device_count(), 1))")}
exec torchrun --standalone --nproc_per_node "$NPROC" --max-restarts "${MAX_RESTARTS:-3}" \
    -m parallel_latent train --config "$CONFIG" "$@"
