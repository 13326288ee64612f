#!/usr/bin/env bash
# Sets up the project and runs lint and the whole test suite (slow tests included), as CI does.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/get-helm.sh
bash scripts/get-promtool.sh
# The cluster tests' control plane, built from Go modules once per machine; if it cannot be built, those tests
# skip and say why, and the rest still run.
bash scripts/get-control-plane.sh || echo "test.sh: control plane not built; the cluster tests will skip" >&2
bash scripts/get-extproc-gateway.sh || echo "test.sh: extproc-gateway not built; the ext-proc tests will skip" >&2
. .venv/bin/activate
ruff check .
lint-imports
python -m pytest "$@"
