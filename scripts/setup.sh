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
    # No GPU: PyTorch's CPU build where its index answers (a few hundred MB); else the registry's default
    # build of 2.13.0, the CUDA one (several GB with its nvidia-* wheels), which runs fine on CPU. pip's
    # cache keeps whichever it got for the next set-up.
    python -m pip install -q --timeout 5 --retries 0 torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu \
      2>/dev/null || python -m pip install -q torch==2.13.0
  fi
fi
python -m pip install -q -e '.[dev]'
echo "setup: done ($(python -c 'import torch; print("torch", torch.__version__)'))"
