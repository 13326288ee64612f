#!/usr/bin/env bash
# Regenerates the gateway's KEDA external scaler stubs from autoscaler/sluice_autoscaler/externalscaler.proto.
# The generated *_pb2*.py files are committed; run this after editing the .proto (needs grpcio-tools: the dev extra).
set -euo pipefail
cd "$(dirname "$0")/../autoscaler"
PY="${PYTHON:-../.venv/bin/python}"
# -I at autoscaler/ makes the generated imports package-qualified (from sluice_autoscaler import ...).
"$PY" -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. sluice_autoscaler/externalscaler.proto
echo "generated: $(ls sluice_autoscaler/externalscaler_pb2*)"
