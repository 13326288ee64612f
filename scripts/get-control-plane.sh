#!/usr/bin/env bash
# Builds a real Kubernetes control plane from Go modules, once per machine, for the cluster tests
# (tests/test_cluster_*.py) and scripts/dev-cluster.sh: kube-apiserver, kube-controller-manager and
# kube-scheduler from k8s.io/kubernetes, etcd from go.etcd.io/etcd/server/v3, and kwok (simulated nodes and
# pod lifecycle; its Stage files, which the kwok binary needs and does not embed, are copied from its module
# to share/kwok-stages.yaml). Binaries are cached under ${XDG_CACHE_HOME:-~/.cache}/sluice/control-plane/
# <versions>/bin; a second run prints "cached" and does nothing. Prints the bin dir as its last line.
# Not built yet (later slices of issue 24): KEDA's operator and metrics server, LeaderWorkerSet.
#
# Env: SLUICE_CONTROL_PLANE_CACHE overrides the cache root; GO (default: go) the Go command.
set -euo pipefail

K8S_VERSION=v1.36.3    # k8s.io/kubernetes; staging modules are published as v0.36.3
ETCD_VERSION=v3.6.8    # go.etcd.io/etcd/server/v3
KWOK_VERSION=v0.8.0    # sigs.k8s.io/kwok

GO=${GO:-go}
ROOT=${SLUICE_CONTROL_PLANE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/sluice/control-plane}
DIR="$ROOT/k8s-$K8S_VERSION-etcd-$ETCD_VERSION-kwok-$KWOK_VERSION"
BIN="$DIR/bin"
LOG="$DIR/build.log"
BINARIES=(etcd kube-apiserver kube-controller-manager kube-scheduler kwok)
STAGES="$DIR/share/kwok-stages.yaml"

missing=()
for b in "${BINARIES[@]}"; do [[ -x "$BIN/$b" ]] || missing+=("$b"); done
[[ -f "$STAGES" ]] || [[ " ${missing[*]} " == *" kwok "* ]] || missing+=(kwok)
if [[ ${#missing[@]} -eq 0 ]]; then
    echo "control plane: cached ($K8S_VERSION, etcd $ETCD_VERSION, kwok $KWOK_VERSION)" >&2
    echo "$BIN"
    exit 0
fi
command -v "$GO" >/dev/null || { echo "control plane: '$GO' not found; install Go >= 1.26 to build it" >&2; exit 2; }

mkdir -p "$BIN" "$DIR/src"
: >"$LOG"
export CGO_ENABLED=0 GOFLAGS=-mod=mod
START=$SECONDS
say() { echo "control plane: $*" | tee -a "$LOG" >&2; }
run() { nice -n 10 "$@" >>"$LOG" 2>&1 || { tail -n 40 "$LOG" >&2; say "FAILED: $* (log: $LOG)"; exit 1; }; }

# k8s.io/kubernetes replaces its staging modules (k8s.io/api, client-go, ...) with ./staging paths,
# which a dependent ignores: a wrapper module requires the release and maps each staging module it
# requires to the published v0.<minor>.<patch> of the same release.
build_kube() {
    local w="$DIR/src/kubernetes" staging=v0.${K8S_VERSION#v1.} gomod
    mkdir -p "$w"
    gomod=$(cd "$w" && GOFLAGS= "$GO" mod download -json "k8s.io/kubernetes@$K8S_VERSION" \
        | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",\{0,1\}$/\1/p')
    [[ -f "$gomod" ]] || { say "FAILED: no go.mod for k8s.io/kubernetes@$K8S_VERSION"; exit 1; }
    {
        echo "module sluice.local/control-plane/kubernetes"
        echo
        echo "go 1.26.0"
        echo
        echo "require k8s.io/kubernetes $K8S_VERSION"
        echo
        echo "replace ("
        # Staging modules that the release requires (v0.0.0 plus a ./staging replace in its go.mod).
        awk '/=> \.\/staging\//{print $1}' "$gomod" | while read -r m; do
            grep -qE "^[[:space:]]+$m v0\.0\.0" "$gomod" && echo "	$m => $m $staging"
        done
        echo ")"
    } >"$w/go.mod"
    local ldflags="-s -w -X k8s.io/component-base/version.gitVersion=$K8S_VERSION
        -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$(cut -d. -f2 <<<"$K8S_VERSION")
        -X k8s.io/component-base/version.gitTreeState=clean"
    for b in kube-apiserver kube-controller-manager kube-scheduler; do
        [[ -x "$BIN/$b" ]] && continue
        say "building $b $K8S_VERSION (several minutes on a cold Go cache) ..."
        (cd "$w" && run "$GO" build -trimpath -ldflags "$ldflags" -o "$BIN/$b.tmp" "k8s.io/kubernetes/cmd/$b")
        mv "$BIN/$b.tmp" "$BIN/$b"
    done
}

# etcd's server module also replaces its sibling modules with ../ paths; a wrapper module requiring it
# gets the published siblings at the versions its go.mod names.
build_etcd() {
    local w="$DIR/src/etcd"
    mkdir -p "$w"
    printf 'module sluice.local/control-plane/etcd\n\ngo 1.26.0\n\nrequire go.etcd.io/etcd/server/v3 %s\n' \
        "$ETCD_VERSION" >"$w/go.mod"
    say "building etcd $ETCD_VERSION ..."
    (cd "$w" && run "$GO" build -trimpath -ldflags "-s -w" -o "$BIN/etcd.tmp" go.etcd.io/etcd/server/v3)
    mv "$BIN/etcd.tmp" "$BIN/etcd"
}

# kwok runs nothing until it is given Stages (what happens to a node or pod, and when); kwokctl picks
# these defaults: nodes become Ready and keep a Lease, pods become Ready, complete, and go on delete.
build_kwok() {
    local mod stage
    if [[ ! -x "$BIN/kwok" ]]; then
        say "building kwok $KWOK_VERSION ..."
        (cd "$DIR/src" && GOFLAGS= GOBIN="$DIR/src/gobin" run "$GO" install -trimpath -ldflags "-s -w" \
            "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION")
        mv "$DIR/src/gobin/kwok" "$BIN/kwok"
    fi
    mod=$(cd "$DIR/src" && GOFLAGS= "$GO" mod download -json "sigs.k8s.io/kwok@$KWOK_VERSION" \
        | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",\{0,1\}$/\1/p')
    mkdir -p "$DIR/share"
    for stage in node/fast/node-initialize node/heartbeat-with-lease/node-heartbeat-with-lease \
        pod/fast/pod-ready pod/fast/pod-complete pod/fast/pod-delete; do
        echo "---"
        cat "$mod/kustomize/stage/$stage.yaml"
    done >"$STAGES.tmp"
    mv "$STAGES.tmp" "$STAGES"
}

say "building into $BIN: ${missing[*]}"
for b in "${missing[@]}"; do
    case $b in
        etcd) build_etcd ;;
        kube-apiserver | kube-controller-manager | kube-scheduler) [[ -x "$BIN/$b" ]] || build_kube ;;
        kwok) build_kwok ;;
    esac
done
say "built ${missing[*]} in $((SECONDS - START)) s"
echo "$BIN"
