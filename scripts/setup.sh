#!/usr/bin/env bash
# Sets up .venv with Sluice and its dev/test dependencies. Idempotent: a second run is quick.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
if ! python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    python -m pip install -q "torch>=2.4"
  else
    # No GPU: take the CPU build (on these machines a wheel of 2.13.0 lies on disk); a plain
    # `pip install torch` would pull several GB of CUDA wheels.
    python -m pip install -q torch==2.13.0 || python -m pip install -q torch --index-url https://download.pytorch.org/whl/cpu
  fi
fi
python -m pip install -q -e '.[dev]'
echo "setup: done ($(python -c 'import torch; print("torch", torch.__version__)'))"
