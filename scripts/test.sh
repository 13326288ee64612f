#!/usr/bin/env bash
# Sets up the project and runs lint and the whole test suite (slow tests included), as CI does.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/get-helm.sh
bash scripts/get-promtool.sh
. .venv/bin/activate
ruff check .
python -m pytest "$@"
