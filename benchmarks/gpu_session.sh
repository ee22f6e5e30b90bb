#!/bin/bash
# The GPU checks as one prepared run: the kernels (benchmarks/gpu_kernels.py), then the model
# (benchmarks/gpu_model.py), everything logged to $OUT (default ./gpu-out).
#
#   bash benchmarks/gpu_session.sh prepare   # here (with network): the shared fixture, the benchmark config and
#                                            # wheels of flax / qwix into .gpu/ (git-ignored through .git/info/exclude)
#   bash benchmarks/gpu_session.sh run       # on the GPU machine, with .gpu/ beside the tree: installs the wheels
#                                            # into /tmp/site (no network needed), then both scripts
#
# Environment: KT / MT (seconds allowed for the kernels / the model script), SB (start no new speed variant of the
# model script after this many seconds), MODEL_ARGS (more arguments for gpu_model.py, e.g. "--only fixture").
set -u
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
case "${1:-}" in
prepare)
  mkdir -p .gpu/whl
  grep -qx "/.gpu/" "$(git rev-parse --git-dir)/info/exclude" 2>/dev/null || echo "/.gpu/" >> "$(git rev-parse --git-dir)/info/exclude"
  cp -r tests/fixtures/k3-tiny-a .gpu/ && cp benchmarks/configs/kimi-linear-bench.config.json .gpu/ || exit 1
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any -d .gpu/whl \
    "flax==0.12.12" "qwix==0.1.8" || exit 1
  du -sh .gpu
  ;;
run)
  OUT="${OUT:-$ROOT/gpu-out}"; mkdir -p "$OUT"
  export PYTHONUNBUFFERED=1
  T0=$(date +%s)
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .gpu/whl/*.whl || exit 3
  export PYTHONPATH=/tmp/site:$ROOT
  python3 -c "import jax, flax, qwix; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
  timeout "${KT:-170}" python3 benchmarks/gpu_kernels.py --json "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.log" \
    | grep -v "^    "
  echo "kernels done at $(( $(date +%s) - T0 )) s"
  timeout "${MT:-330}" python3 benchmarks/gpu_model.py --fixture .gpu/k3-tiny-a \
    --config .gpu/kimi-linear-bench.config.json --speed-budget-s "${SB:-120}" --json "$OUT/model.json" \
    ${MODEL_ARGS:-} > "$OUT/model.log" 2>&1
  echo "model rc $? at $(( $(date +%s) - T0 )) s"
  grep -v '^ *"traceback"' "$OUT/model.log" | tail -c 7000
  ;;
*)
  echo "usage: $0 prepare|run" >&2; exit 2 ;;
esac
