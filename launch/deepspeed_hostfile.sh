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
# DeepSpeed's launcher restarts nothing by itself: this script reruns it when a rank fails, up to
# MAX_RESTARTS times (default 3; bad input, status 2, is not retried), and each rerun resumes from
# the newest complete checkpoint (checkpoint.resume=auto).
attempt=0
while true; do
    status=0
    deepspeed --hostfile "$HOSTFILE" --launcher "$LAUNCHER" --master_port "$MASTER_PORT" \
        --module parallel_latent train --config "$CONFIG" "$@" || status=$?
    if ((status == 0 || status == 2 || attempt >= ${MAX_RESTARTS:-3})); then
        exit "$status"
    fi
    attempt=$((attempt + 1))
    echo "$(basename "$0"): the launcher ended with status $status; restart $attempt of ${MAX_RESTARTS:-3}" >&2
done

