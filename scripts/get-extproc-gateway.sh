#!/usr/bin/env bash
# Builds extproc-gateway (e2e/extproc_gateway): the test and benchmark data plane that consults the EPP over
# Envoy's ext-proc protocol as a GIE-conformant gateway does (we run no Envoy), or round-robins without one.
# Once per machine and source: the binary goes to
#   ${SLUICE_CONTROL_PLANE_CACHE:-${XDG_CACHE_HOME:-~/.cache}/sluice/control-plane}/extproc-gateway-<key>/bin/
# where <key> is the first 12 hex digits of the sha256 of the module's go.mod, go.sum and *.go, so an edit to
# the gateway builds a new binary instead of testing a stale one. A second run prints "cached" and does nothing.
# The last line of stdout is the binary's path.
#
#   get-extproc-gateway.sh         build it if missing; last line: the binary
#   get-extproc-gateway.sh --bin   build nothing; last line: the binary, or exit 1 where it is not built
#
# Env: SLUICE_CONTROL_PLANE_CACHE overrides the cache root (shared with get-control-plane.sh); GO (default: go)
# the Go command.
set -euo pipefail

SRC="$(cd "$(dirname "$0")/.." && pwd)/e2e/extproc_gateway"
GO=${GO:-go}
ROOT=${SLUICE_CONTROL_PLANE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/sluice/control-plane}

case ${1:-} in
    --bin) MODE=bin ;;
    '') MODE=build ;;
    *) echo "usage: $0 [--bin]" >&2; exit 2 ;;
esac
[[ $# -le 1 ]] || { echo "usage: $0 [--bin]" >&2; exit 2; }
[[ -f "$SRC/go.mod" ]] || { echo "extproc-gateway: no module at $SRC" >&2; exit 2; }

sha256() { if command -v sha256sum >/dev/null; then sha256sum; else shasum -a 256; fi; }
# Each file's name, then its bytes, in a fixed order: a rename or a moved line changes the key too.
key=$(cd "$SRC" && for f in go.mod go.sum $(LC_ALL=C ls -- *.go); do
    printf '%s\0' "$f"
    cat -- "$f"
done | sha256 | cut -c1-12)
DIR="$ROOT/extproc-gateway-$key"
BIN="$DIR/bin/extproc-gateway"

if [[ -x "$BIN" ]]; then
    [[ $MODE == bin ]] || echo "extproc-gateway: cached ($BIN)" >&2
    echo "$BIN"
    exit 0
fi
if [[ $MODE == bin ]]; then
    echo "extproc-gateway: not built for this source ($BIN); build it with $0" >&2
    exit 1
fi
command -v "$GO" >/dev/null || { echo "extproc-gateway: '$GO' not found; install Go >= 1.26 to build it" >&2; exit 2; }

# Static and reproducible: no cgo, no local paths, no VCS stamp (the checkout is usually dirty while others
# work in it). -mod=mod lets a go.sum that lags go.mod be completed from the module proxy instead of failing.
export CGO_ENABLED=0 GOFLAGS=-mod=mod
mkdir -p "$DIR/bin"
LOG="$DIR/build.log"
TMP="$BIN.tmp.$$" # two runs at once each build their own and rename; the last rename wins, both work
trap 'rm -f "$TMP"' EXIT
echo "extproc-gateway: building into $DIR (a minute or two on a cold Go cache) ..." >&2
START=$SECONDS
if ! (cd "$SRC" && nice -n 10 "$GO" build -trimpath -buildvcs=false -ldflags "-s -w" -o "$TMP" .) >"$LOG" 2>&1; then
    tail -n 40 "$LOG" >&2
    echo "extproc-gateway: FAILED: go build in $SRC (log: $LOG); 'cd $SRC && go build .' shows why" >&2
    exit 1
fi
mv "$TMP" "$BIN"
echo "extproc-gateway: built in $((SECONDS - START)) s" | tee -a "$LOG" >&2
echo "$BIN"
