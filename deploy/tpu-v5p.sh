#!/usr/bin/env bash
# Full Kimi K3 served from a TPU v5p slice of 64 chips (topology 4x4x4, accelerator type v5p-128: 16 hosts x 4 chips),
# one process per host, the mesh `kimi-jax plan --model k3 --serve --compile tpu:v5p:4x4x4` checked: expert=8,model=8.
#
#   TPU_NAME=my-v5p ZONE=us-east5-a MODEL=/mnt/k3 bash deploy/tpu-v5p.sh
#
# MODEL must be the same path on every host (a converted or HF checkpoint on a shared filesystem, e.g. a gcsfuse
# mount): each process reads only the shards of its own chips. Process 0 (worker 0) serves HTTP on PORT; the other
# hosts follow it. Stop with SIGTERM to worker 0's `kimi-jax serve`: it drains the requests in flight and every
# process exits 0.
set -euo pipefail
: "${TPU_NAME:?set TPU_NAME}" "${ZONE:?set ZONE}" "${MODEL:?set MODEL (the checkpoint path on every host)}"
SLOTS=${SLOTS:-16}
MAX_LEN=${MAX_LEN:-32768}
PORT=${PORT:-8000}
REPO=${REPO:-git+https://github.com/kimi-jax/kimi-jax}

gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone "$ZONE" --worker=all --command "
  set -e
  pip install -q '$REPO' 'jax[tpu]'
  kimi-jax serve --model $MODEL --mesh data=1,expert=8,model=8 --coordinator auto \
    --slots $SLOTS --max-len $MAX_LEN --host 0.0.0.0 --port $PORT --dtype bfloat16 --scan-layers
"
