#!/usr/bin/env bash
# The main job on this machine: build nrun, make the Python venv with torch if there is none,
# and run a small DDP training on 4 workers (NCCL on GPUs, gloo on CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --quiet
venv=$(scripts/venv.sh)
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
set -x
exec target/release/nrun --nproc "${NPROC:-4}" --python "$venv/bin/python" examples/train.py "$@"
