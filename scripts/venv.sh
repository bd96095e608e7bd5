#!/usr/bin/env bash
# Creates (once) and prints the path of the Python venv with torch from PyPI that the demo and the
# tests use. Reused between runs: NRUN_VENV overrides the location.
set -euo pipefail
venv=${NRUN_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/nrun/venv}
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c 'import torch' >/dev/null 2>&1; then
  echo "nrun: creating Python venv with torch at $venv (first run only; large download)" >&2
  echo "nrun: venv 1/3: python3 -m venv" >&2
  python3 -m venv "$venv" >&2
  echo "nrun: venv 2/3: upgrading pip" >&2
  "$venv/bin/pip" install --quiet --upgrade pip >&2
  # Not quiet: torch is the large download, and pip's own lines show how far it is.
  echo "nrun: venv 3/3: pip install torch numpy (pip's progress below)" >&2
  "$venv/bin/pip" install --progress-bar on torch numpy >&2
fi
echo "$venv"
