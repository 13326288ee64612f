#!/usr/bin/env bash
# The Gateway API and Gateway API Inference Extension CRDs, from the projects' own Go modules (the module proxy
# serves both; no cluster, no kubectl): the Inference Extension's InferencePool (inference.networking.k8s.io/v1)
# and InferenceObjective (inference.networking.x-k8s.io/v1alpha2), and the Gateway API's standard-channel
# GatewayClass, Gateway and HTTPRoute. What an endpoint's spec.routing.inferencePool renders is validated against
# them (tests/operator/test_operator_routing.py offline, test_cluster_routing.py in a real API server), and
# scripts/dev-cluster.sh up installs them. Copied into
# ${SLUICE_CONTROL_PLANE_CACHE:-${XDG_CACHE_HOME:-~/.cache}/sluice/control-plane}/gateway-crds-<versions>/; a second
# run prints "cached" and copies nothing. Prints that directory as its last line.
#
# Env: SLUICE_CONTROL_PLANE_CACHE overrides the cache root; GO (default: go) the Go command.
set -euo pipefail

GIE_VERSION=v1.5.0       # sigs.k8s.io/gateway-api-inference-extension
GATEWAY_API_VERSION=v1.6.3  # sigs.k8s.io/gateway-api (standard channel)

GO=${GO:-go}
ROOT=${SLUICE_CONTROL_PLANE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/sluice/control-plane}
DIR="$ROOT/gateway-crds-gie-$GIE_VERSION-gateway-api-$GATEWAY_API_VERSION"
GIE_CRDS=(inference.networking.k8s.io_inferencepools.yaml inference.networking.x-k8s.io_inferenceobjectives.yaml)
GATEWAY_CRDS=(gateway.networking.k8s.io_gatewayclasses.yaml gateway.networking.k8s.io_gateways.yaml
              gateway.networking.k8s.io_httproutes.yaml)

say() { echo "gateway-crds: $*" >&2; }

complete() {
    local f
    for f in "${GIE_CRDS[@]}" "${GATEWAY_CRDS[@]}"; do [[ -s "$DIR/$f" ]] || return 1; done
}

if complete; then
    say "cached ($DIR)"
    echo "$DIR"
    exit 0
fi
command -v "$GO" >/dev/null || { say "'$GO' not found; install Go to fetch the Gateway API CRDs"; exit 2; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# A throwaway module: `go mod download` of a module@version needs one to run in, and writes only its caches.
printf 'module sluice.local/gateway-crds\n\ngo 1.22\n' >"$work/go.mod"
json=$(cd "$work" && GOFLAGS=-mod=mod "$GO" mod download -json \
    "sigs.k8s.io/gateway-api-inference-extension@$GIE_VERSION" "sigs.k8s.io/gateway-api@$GATEWAY_API_VERSION") \
    || { say "FAILED: go mod download (is the module proxy reachable?)"; exit 1; }
dir_of() {  # module path -> its extracted directory (the "Dir" of its JSON object)
    python3 -c 'import json, sys
dec, text, i = json.JSONDecoder(), sys.stdin.read(), 0
while i < len(text):
    if text[i].isspace():
        i += 1
        continue
    obj, i = dec.raw_decode(text, i)
    if obj.get("Path") == sys.argv[1]:
        if obj.get("Error"):
            sys.exit("gateway-crds: " + obj["Error"])
        print(obj["Dir"])' "$1" <<<"$json"
}
gie=$(dir_of sigs.k8s.io/gateway-api-inference-extension)
gateway=$(dir_of sigs.k8s.io/gateway-api)

tmp="$DIR.tmp.$$"
rm -rf "$tmp" && mkdir -p "$tmp"
for f in "${GIE_CRDS[@]}"; do
    [[ -f "$gie/config/crd/bases/$f" ]] || { say "FAILED: no config/crd/bases/$f in $gie"; exit 1; }
    cp "$gie/config/crd/bases/$f" "$tmp/"
done
for f in "${GATEWAY_CRDS[@]}"; do
    [[ -f "$gateway/config/crd/standard/$f" ]] || { say "FAILED: no config/crd/standard/$f in $gateway"; exit 1; }
    cp "$gateway/config/crd/standard/$f" "$tmp/"
done
chmod -R u+w "$tmp"  # the module cache is read-only
rm -rf "$DIR" && mv "$tmp" "$DIR"
say "copied ${#GIE_CRDS[@]} Inference Extension ($GIE_VERSION) and ${#GATEWAY_CRDS[@]} Gateway API ($GATEWAY_API_VERSION, standard) CRDs"
echo "$DIR"
