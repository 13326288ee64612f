#!/usr/bin/env bash
# Regenerates the gateway's gRPC stubs: the KEDA external scaler (externalscaler.proto) and Envoy's ext-proc
# (ext_proc.proto, the endpoint picker).
# The generated *_pb2*.py files are committed; run this after editing the .proto (needs grpcio-tools: the dev extra).
set -euo pipefail
cd "$(dirname "$0")/../autoscaler"
PY="${PYTHON:-../.venv/bin/python}"
# -I at autoscaler/ makes the generated imports package-qualified (from sluice_autoscaler import ...).
"$PY" -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. sluice_autoscaler/externalscaler.proto sluice_autoscaler/ext_proc.proto
echo "generated: $(ls sluice_autoscaler/*_pb2*)"
