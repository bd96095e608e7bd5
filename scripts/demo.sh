#!/usr/bin/env bash
# The main job on this machine: build nrun, make the Python venv with torch if there is none,
# and run a small DDP training on 4 workers (NCCL on GPUs, gloo on CPU). Arguments go to
# examples/train.py (--steps, --batch, --lr). Each stage says what it does; the build and the
# venv's install show their own progress, since the first run takes minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
stage() { echo "demo: [$1/3 at ${SECONDS} s] $2" >&2; }
stage 1 "building nrun: cargo build --release (minutes the first time, seconds after)"
cargo build --release
stage 2 "the Python venv with torch: scripts/venv.sh (made once, a large download; reused after)"
venv=$(scripts/venv.sh)
stage 3 "running a DDP training on ${NPROC:-4} workers with $venv/bin/python"
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
set -x
exec target/release/nrun --nproc "${NPROC:-4}" --python "$venv/bin/python" examples/train.py "$@"
