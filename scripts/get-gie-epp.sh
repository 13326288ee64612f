#!/usr/bin/env bash
# Builds the Gateway API Inference Extension's reference endpoint picker (sigs.k8s.io/gateway-api-inference-
# extension cmd/epp, as bin/epp) from its Go module, once per machine, for the side-by-side benchmark and the
# interop test (GIE's picker choosing among Sluice engines from their vllm:* metrics; docs/gateway-api.md).
# v1.5.0 is the last release whose module carries the full picker (v1.6 ships only the round-robin
# "lightweight" one, cmd/lwepp). Cached under ${SLUICE_CONTROL_PLANE_CACHE:-~/.cache/sluice/control-plane}/
# gie-epp-<version>/bin; a second run prints "cached". Like KEDA it links client-go and controller-runtime and
# takes many minutes cold, so neither scripts/test.sh nor CI builds it: the tests that need it skip and say so.
#
#   get-gie-epp.sh         build if missing; last line: the bin dir
#   get-gie-epp.sh --bin   build nothing; last line: the bin dir, or exit 1 where it is not built
#
# Env: SLUICE_CONTROL_PLANE_CACHE overrides the cache root; GO (default: go) the Go command.
set -euo pipefail

GIE_VERSION=v1.5.0
GO=${GO:-go}
ROOT=${SLUICE_CONTROL_PLANE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/sluice/control-plane}
DIR="$ROOT/gie-epp-$GIE_VERSION"
BIN="$DIR/bin"
LOG="$DIR/build.log"

built() { [[ -x "$BIN/epp" ]]; }

case ${1:-} in
    --bin)
        built || { echo "gie-epp: GIE's endpoint picker $GIE_VERSION is not built ($DIR; build it with $0)" >&2; exit 1; }
        echo "$BIN"
        exit 0 ;;
    '') ;;
    *) echo "usage: $0 [--bin]" >&2; exit 2 ;;
esac
if built; then
    echo "gie-epp: cached ($GIE_VERSION)" >&2
    echo "$BIN"
    exit 0
fi
command -v "$GO" >/dev/null || { echo "gie-epp: '$GO' not found; install Go >= 1.26 to build it" >&2; exit 2; }
export CGO_ENABLED=0 GOFLAGS=-mod=mod
START=$SECONDS
mkdir -p "$DIR/src" "$BIN"
: >"$LOG"
say() { echo "gie-epp: $*" | tee -a "$LOG" >&2; }
run() { nice -n 10 "$@" >>"$LOG" 2>&1 || { tail -n 40 "$LOG" >&2; say "FAILED: $* (log: $LOG)"; exit 1; }; }
# A wrapper module (GIE's go.mod has no replace or exclude to repeat): its own go.sum, the shared module cache.
printf 'module sluice.local/control-plane/gie-epp\n\ngo 1.26.0\n\nrequire sigs.k8s.io/gateway-api-inference-extension %s\n' \
    "$GIE_VERSION" >"$DIR/src/go.mod"
say "building epp (GIE $GIE_VERSION; many minutes on 2 cores with a cold Go cache) ..."
(cd "$DIR/src" && run "$GO" build -trimpath -ldflags "-s -w" -o "$BIN/epp.tmp" \
    sigs.k8s.io/gateway-api-inference-extension/cmd/epp)
mv "$BIN/epp.tmp" "$BIN/epp"
say "built epp $GIE_VERSION in $((SECONDS - START)) s"
echo "$BIN"
