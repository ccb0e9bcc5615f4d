#!/usr/bin/env bash
# The deepspeed launcher over ssh/pdsh: run ONCE, on the first host of the hostfile.  It starts
# every node's ranks itself (passwordless ssh to each host, same path and environment there).
#
#   HOSTFILE=launch/hostfile.example launch/deepspeed_hostfile.sh configs/gpt2.yaml
#
# The launcher inserts --local_rank=N into each rank's command line; parallel-latent accepts and
# ignores it (ranks come from RANK / LOCAL_RANK / WORLD_SIZE, which it also sets).
set -euo pipefail
CONFIG=${1:?usage: $0 CONFIG [section.key=value ...]}
shift
HOSTFILE=${HOSTFILE:-launch/hostfile.example}
MASTER_PORT=${MASTER_PORT:-29500}
LAUNCHER=${LAUNCHER:-pdsh}   # pdsh | openmpi | mvapich | slurm (deepspeed --launcher)
exec deepspeed --hostfile "$HOSTFILE" --launcher "$LAUNCHER" --master_port "$MASTER_PORT" \
    --module parallel_latent train --config "$CONFIG" "$@"
