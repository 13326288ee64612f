#!/usr/bin/env bash
# Builds a real Kubernetes control plane from Go modules, once per machine, for the cluster tests
# (tests/test_cluster_*.py) and scripts/dev-cluster.sh: kube-apiserver, kube-controller-manager and
# kube-scheduler from k8s.io/kubernetes, etcd from go.etcd.io/etcd/server/v3, and kwok (simulated nodes and
# pod lifecycle; its Stage files, which the kwok binary needs and does not embed, are copied from its module
# to share/kwok-stages.yaml). Binaries are cached under ${XDG_CACHE_HOME:-~/.cache}/sluice/control-plane/
# <versions>/bin; a second run prints "cached" and does nothing. Prints the bin dir as its last line.
#
# Also the LeaderWorkerSet controller manager (sigs.k8s.io/lws, as bin/lws-controller) in its own directory,
# <cache>/lws-<version>, with what dev-cluster.sh needs from the module next to it: its CRDs (share/crds) and
# its webhook kustomization (share/webhook). It is optional: where it cannot be built the script says why and
# still succeeds with the rest (the multi-node examples then stay Pending in the cluster tests).
#
# KEDA (github.com/kedacore/keda/v2: bin/keda-operator and bin/keda-adapter, its metrics API server; no admission
# webhooks) only when asked (--keda), in <cache>/keda-<version> with its CRDs in share/crds: cold, it takes
# longer than all the rest together (every cloud SDK its scalers link; docs/BENCHMARKS.md), so neither the
# default run nor scripts/test.sh builds it. dev-cluster.sh up --keda runs it.
#
#   get-control-plane.sh              build what is missing; last line: the Kubernetes bin dir
#   get-control-plane.sh --lws-bin    build nothing; last line: LWS's bin dir, or exit 1 where it is not built
#   get-control-plane.sh --keda       build KEDA only, if missing ("cached" if not); last line: KEDA's bin dir
#   get-control-plane.sh --keda-bin   build nothing; last line: KEDA's bin dir, or exit 1 where it is not built
#
# Env: SLUICE_CONTROL_PLANE_CACHE overrides the cache root; GO (default: go) the Go command.
set -euo pipefail

K8S_VERSION=v1.36.3    # k8s.io/kubernetes; staging modules are published as v0.36.3
ETCD_VERSION=v3.6.8    # go.etcd.io/etcd/server/v3
KWOK_VERSION=v0.8.0    # sigs.k8s.io/kwok
LWS_VERSION=v0.9.0     # sigs.k8s.io/lws; v0.10.x (../shared/reference-crds) is not served whole by the proxy here
KEDA_VERSION=v2.21.0   # github.com/kedacore/keda/v2; only with --keda

GO=${GO:-go}
ROOT=${SLUICE_CONTROL_PLANE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/sluice/control-plane}
DIR="$ROOT/k8s-$K8S_VERSION-etcd-$ETCD_VERSION-kwok-$KWOK_VERSION"
BIN="$DIR/bin"
LOG="$DIR/build.log"
BINARIES=(etcd kube-apiserver kube-controller-manager kube-scheduler kwok)
STAGES="$DIR/share/kwok-stages.yaml"
LWS_DIR="$ROOT/lws-$LWS_VERSION"
LWS_BIN="$LWS_DIR/bin"
KEDA_DIR="$ROOT/keda-$KEDA_VERSION"
KEDA_BIN="$KEDA_DIR/bin"

lws_built() { [[ -x "$LWS_BIN/lws-controller" && -d "$LWS_DIR/share/crds" && -f "$LWS_DIR/share/webhook/kustomization.yaml" ]]; }
keda_built() { [[ -x "$KEDA_BIN/keda-operator" && -x "$KEDA_BIN/keda-adapter" && -f "$KEDA_DIR/share/crds/keda.sh_scaledobjects.yaml" ]]; }

case ${1:-} in
    --lws-bin)
        lws_built || { echo "control plane: LeaderWorkerSet $LWS_VERSION is not built ($LWS_DIR)" >&2; exit 1; }
        echo "$LWS_BIN"
        exit 0 ;;
    --keda-bin)
        keda_built || { echo "control plane: KEDA $KEDA_VERSION is not built ($KEDA_DIR; build it with $0 --keda)" >&2; exit 1; }
        echo "$KEDA_BIN"
        exit 0 ;;
    --keda) MODE=keda ;;
    '') MODE=control-plane ;;
    *) echo "usage: $0 [--keda | --lws-bin | --keda-bin]" >&2; exit 2 ;;
esac
[[ $# -le 1 ]] || { echo "usage: $0 [--keda | --lws-bin | --keda-bin]" >&2; exit 2; }

# KEDA's operator (cmd/operator, as bin/keda-operator) and its metrics API server (cmd/adapter, as
# bin/keda-adapter), no admission webhooks, from a wrapper module: keda's go.mod has a replace and an
# exclude, which apply only in the main module, so the wrapper repeats them (read from that go.mod). Its
# CRDs (config/crd/bases) are copied to share/crds. Only on request: cold, it is the longest build here.
if [[ $MODE == keda ]]; then
    if keda_built; then
        echo "control plane: cached (KEDA $KEDA_VERSION)" >&2
        echo "$KEDA_BIN"
        exit 0
    fi
    command -v "$GO" >/dev/null || { echo "control plane: '$GO' not found; install Go >= 1.26 to build KEDA" >&2; exit 2; }
    export CGO_ENABLED=0 GOFLAGS=-mod=mod
    LOG="$KEDA_DIR/build.log"
    START=$SECONDS
    mkdir -p "$KEDA_DIR/src" "$KEDA_BIN"
    : >"$LOG"
    say() { echo "control plane: $*" | tee -a "$LOG" >&2; }
    run() { nice -n 10 "$@" >>"$LOG" 2>&1 || { tail -n 40 "$LOG" >&2; say "FAILED: $* (log: $LOG)"; exit 1; }; }
    w="$KEDA_DIR/src"
    json=$(cd "$w" && GOFLAGS= "$GO" mod download -json "github.com/kedacore/keda/v2@$KEDA_VERSION")
    gomod=$(sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",\{0,1\}$/\1/p' <<<"$json")
    mod=$(sed -n 's/^[[:space:]]*"Dir": "\(.*\)",\{0,1\}$/\1/p' <<<"$json")
    [[ -f "$gomod" && -d "$mod/config/crd/bases" ]] || { say "FAILED: no go.mod or config/crd/bases for keda $KEDA_VERSION"; exit 1; }
    ! grep -qE '^(replace|exclude)[[:space:]]*\(' "$gomod" \
        || { say "FAILED: keda's go.mod has a replace/exclude block; the wrapper copies single lines only"; exit 1; }
    {
        printf 'module sluice.local/control-plane/keda\n\ngo 1.26.0\n\nrequire github.com/kedacore/keda/v2 %s\n\n' "$KEDA_VERSION"
        grep -E '^(replace|exclude) ' "$gomod"
    } >"$w/go.mod"
    say "building keda-operator and keda-adapter (KEDA $KEDA_VERSION; 15-30 min on 2 cores with a cold Go cache) ..."
    ldflags="-s -w -X github.com/kedacore/keda/v2/version.Version=${KEDA_VERSION#v}"
    for b in operator adapter; do
        (cd "$w" && run "$GO" build -trimpath -ldflags "$ldflags" -o "$KEDA_BIN/keda-$b.tmp" \
            "github.com/kedacore/keda/v2/cmd/$b")
    done
    rm -rf "$KEDA_DIR/share" && mkdir -p "$KEDA_DIR/share/crds"
    cp "$mod"/config/crd/bases/*.yaml "$KEDA_DIR/share/crds/" && chmod -R u+w "$KEDA_DIR/share"
    mv "$KEDA_BIN/keda-operator.tmp" "$KEDA_BIN/keda-operator"
    mv "$KEDA_BIN/keda-adapter.tmp" "$KEDA_BIN/keda-adapter"
    say "built keda-operator and keda-adapter $KEDA_VERSION in $((SECONDS - START)) s"
    echo "$KEDA_BIN"
    exit 0
fi

missing=()
for b in "${BINARIES[@]}"; do [[ -x "$BIN/$b" ]] || missing+=("$b"); done
[[ -f "$STAGES" ]] || [[ " ${missing[*]} " == *" kwok "* ]] || missing+=(kwok)
if [[ ${#missing[@]} -eq 0 ]] && lws_built; then
    echo "control plane: cached ($K8S_VERSION, etcd $ETCD_VERSION, kwok $KWOK_VERSION, lws $LWS_VERSION)" >&2
    echo "$BIN"
    exit 0
fi
if ! command -v "$GO" >/dev/null; then
    echo "control plane: '$GO' not found; install Go >= 1.26 to build it" >&2
    [[ ${#missing[@]} -eq 0 ]] || exit 2
    echo "control plane: LeaderWorkerSet $LWS_VERSION not built; the Kubernetes control plane runs without it" >&2
    echo "$BIN"
    exit 0
fi

export CGO_ENABLED=0 GOFLAGS=-mod=mod
START=$SECONDS
if [[ ${#missing[@]} -gt 0 ]]; then
    mkdir -p "$BIN" "$DIR/src"
    : >"$LOG"
fi
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

# LeaderWorkerSet's manager (cmd/main.go of sigs.k8s.io/lws, whose go.mod replaces nothing), built from a
# wrapper module like etcd's. Its CRDs and its webhook kustomization (the Mutating- and
# ValidatingWebhookConfigurations with the pod webhooks' objectSelector) are copied from the module.
# Runs in a subshell whose failure is reported, not fatal: the Kubernetes control plane stands without it
# (called from `||`, so errexit is off in it: each step says how it fails).
build_lws() (
    local w="$LWS_DIR/src" mod start=$SECONDS
    LOG="$LWS_DIR/build.log"
    mkdir -p "$w" "$LWS_BIN" && : >"$LOG" || exit 1
    say "building lws-controller (LeaderWorkerSet $LWS_VERSION) ..."
    printf 'module sluice.local/control-plane/lws\n\ngo 1.26.0\n\nrequire sigs.k8s.io/lws %s\n' "$LWS_VERSION" >"$w/go.mod"
    (cd "$w" && run "$GO" build -trimpath -ldflags "-s -w -X sigs.k8s.io/lws/pkg/version.GitVersion=$LWS_VERSION" \
        -o "$LWS_BIN/lws-controller.tmp" sigs.k8s.io/lws/cmd) || exit 1
    mod=$(cd "$w" && GOFLAGS= "$GO" mod download -json "sigs.k8s.io/lws@$LWS_VERSION" \
        | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",\{0,1\}$/\1/p')
    [[ -d "$mod/config/crd/bases" && -f "$mod/config/webhook/kustomization.yaml" ]] \
        || { say "FAILED: no config/crd/bases or config/webhook in $mod"; exit 1; }
    rm -rf "$LWS_DIR/share" && mkdir -p "$LWS_DIR/share/crds" "$LWS_DIR/share/webhook" \
        && cp "$mod"/config/crd/bases/*.yaml "$LWS_DIR/share/crds/" \
        && cp "$mod"/config/webhook/*.yaml "$LWS_DIR/share/webhook/" \
        && chmod -R u+w "$LWS_DIR/share" \
        && mv "$LWS_BIN/lws-controller.tmp" "$LWS_BIN/lws-controller" \
        || { say "FAILED: copying the CRDs and webhook manifests from $mod"; exit 1; }
    say "built lws-controller $LWS_VERSION in $((SECONDS - start)) s"
)

if [[ ${#missing[@]} -gt 0 ]]; then
    say "building into $BIN: ${missing[*]}"
    for b in "${missing[@]}"; do
        case $b in
            etcd) build_etcd ;;
            kube-apiserver | kube-controller-manager | kube-scheduler) [[ -x "$BIN/$b" ]] || build_kube ;;
            kwok) build_kwok ;;
        esac
    done
    say "built ${missing[*]} in $((SECONDS - START)) s"
fi
if ! lws_built; then
    build_lws || echo "control plane: LeaderWorkerSet $LWS_VERSION not built (log: $LWS_DIR/build.log); the" \
        "Kubernetes control plane runs without an LWS controller" >&2
fi
echo "$BIN"
