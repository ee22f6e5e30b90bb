#!/usr/bin/env bash
# Full Kimi K3 served from a TPU7x slice of 32 chips (topology 4x4x2; each chip is two devices, 64 in all), one process
# per host, the mesh `kimi-jax plan --model k3 --serve --compile tpu:tpu7x:4x4x2` checked: expert=8,model=8, with the
# layers scanned (the programs that check compiled, within 5% of the plan; deploy/README.md).
#
#   TPU_NAME=my-tpu7x ZONE=us-central1-c MODEL=/mnt/k3 bash deploy/tpu7x.sh
#
# As deploy/tpu-v5p.sh: MODEL is the same path on every host, worker 0 serves HTTP, SIGTERM to it drains and stops all.
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
