#!/usr/bin/env bash
# A real Kubernetes control plane on this machine, no containers: etcd, kube-apiserver (TLS, RBAC, a
# service-account issuer), kube-controller-manager, kube-scheduler and kwok, whose simulated nodes (two CPU
# nodes; four with 8 nvidia.com/gpu each, two H100, an L40S and an A100, the products the examples ask for)
# run pods as Running and Ready. Everything listens on 127.0.0.1 only, on free ports (but for the /metrics port
# of KEDA's metrics server, which binds every interface). Where scripts/get-control-plane.sh built it, also the
# LeaderWorkerSet controller (sigs.k8s.io/lws): its CRDs, its admission webhooks (reached by URL on 127.0.0.1,
# served with a cert from this cluster's CA), and its manager. Where scripts/get-gateway-crds.sh can fetch them
# (Go and the module proxy, or its cache), also the Gateway API (standard) and Inference Extension CRDs
# (GatewayClass, Gateway, HTTPRoute, InferencePool, InferenceObjective; no controller: an endpoint's
# spec.routing objects are stored and validated, nothing routes) ($STATE/gateway-crds: their directory).
# The apiserver's aggregation layer is on (a front-proxy CA and client cert; aggregator routing to endpoints,
# so an APIService can name a selector-less Service whose EndpointSlice points at 127.0.0.1:<port>). With
# --keda, also KEDA (built only by `scripts/get-control-plane.sh --keda`): its CRDs, keda-operator and its
# metrics API server behind the APIService v1beta1.external.metrics.k8s.io ($STATE/keda: ports, ready).
# Binaries come from scripts/get-control-plane.sh (built on first use; KEDA's only on request).
#
#   scripts/dev-cluster.sh up [--keda]  start it (waits for /readyz, Ready nodes and the default ServiceAccount;
#                                       with --keda, for the external metrics API to answer)
#   scripts/dev-cluster.sh env     print `export KUBECONFIG=...` (eval "$(scripts/dev-cluster.sh env)")
#   scripts/dev-cluster.sh status  which processes run, and the nodes
#   scripts/dev-cluster.sh down    stop everything and remove the state dir
#
# State (certs, etcd data, logs, pids, kubeconfigs) lives in SLUICE_DEV_CLUSTER_DIR, by default
# ${XDG_CACHE_HOME:-~/.cache}/sluice/dev-cluster; the admin kubeconfig is $STATE/admin.kubeconfig.
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
STATE=${SLUICE_DEV_CLUSTER_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/sluice/dev-cluster}
KUBECONFIG_FILE="$STATE/admin.kubeconfig"
# shellcheck source=dev-engines.sh
source "$HERE/dev-engines.sh"  # up --engines: the Sluice stack, its engine pods run for real
COMPONENTS=("${ENGINE_COMPONENTS[@]}" keda-metrics-apiserver keda-operator lws-controller kwok kube-scheduler kube-controller-manager kube-apiserver etcd)  # stop order
# The project's kubectl (scripts/get-helm.sh) where it is there, else the one on PATH.
KUBECTL=${KUBECTL:-$( [[ -x "$HERE/../.tools/bin/kubectl" ]] && echo "$HERE/../.tools/bin/kubectl" || echo kubectl)}

say() { echo "dev-cluster: $*" >&2; }
die() { say "$*"; exit 1; }

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

running() { [[ -f "$STATE/pids/$1" ]] && kill -0 "$(cat "$STATE/pids/$1")" 2>/dev/null; }

start() {  # name, argv...: in its own session, logging to $STATE/logs/<name>.log
    local name=$1; shift
    setsid "$@" >"$STATE/logs/$name.log" 2>&1 </dev/null &
    echo $! >"$STATE/pids/$name"
}

# The limits below are what each wait takes on an idle machine, times PATIENCE: on a loaded 2-core CI machine
# the apiserver's CRD establishing controller once took over 30 s to mark LWS's CRDs Established, and a wait
# that gives up early fails a whole test module, while a generous one costs time only when something is broken.
PATIENCE=${SLUICE_DEV_CLUSTER_PATIENCE:-4}
wait_for() {  # what, seconds, command...: polls every 0.2 s; on timeout names the log to read
    local what=$1 limit=$(($2 * PATIENCE)) deadline; shift 2
    deadline=$((SECONDS + limit))
    until "$@" >/dev/null 2>&1; do
        ((SECONDS < deadline)) || die "timed out after ${limit}s waiting for $what (logs: $STATE/logs)"
        sleep 0.2
    done
}

# --- certificates: one CA signs the apiserver's serving cert and every client cert -------------------
# (and a second one, the front-proxy CA, signs only the client cert the apiserver's aggregator shows to the
# API servers it proxies to: they trust the X-Remote-User/-Group headers of a client that CA signed)
cert() {  # name, subject, extensions[, CA name (default ca)]
    local ca=${4:-ca}
    openssl req -new -newkey rsa:2048 -nodes -keyout "$STATE/pki/$1.key" -subj "$2" 2>/dev/null \
        | openssl x509 -req -CA "$STATE/pki/$ca.crt" -CAkey "$STATE/pki/$ca.key" -CAcreateserial -days 30 \
            -extfile <(printf '%s\n' "$3") -out "$STATE/pki/$1.crt" 2>/dev/null
}

make_pki() {
    mkdir -p "$STATE/pki"
    openssl req -x509 -newkey rsa:2048 -nodes -days 30 -subj "/CN=sluice-dev-ca" \
        -keyout "$STATE/pki/ca.key" -out "$STATE/pki/ca.crt" 2>/dev/null
    openssl req -x509 -newkey rsa:2048 -nodes -days 30 -subj "/CN=sluice-dev-front-proxy-ca" \
        -keyout "$STATE/pki/front-proxy-ca.key" -out "$STATE/pki/front-proxy-ca.crt" 2>/dev/null
    cert apiserver "/CN=kube-apiserver" "$(printf '%s\n' \
        "subjectAltName=IP:127.0.0.1,IP:10.96.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local" \
        "extendedKeyUsage=serverAuth" "keyUsage=digitalSignature,keyEncipherment")"
    local client="extendedKeyUsage=clientAuth
keyUsage=digitalSignature,keyEncipherment"
    cert admin "/O=system:masters/CN=sluice-admin" "$client"
    cert controller-manager "/CN=system:kube-controller-manager" "$client"
    cert scheduler "/CN=system:kube-scheduler" "$client"
    cert front-proxy-client "/CN=front-proxy-client" "$client" front-proxy-ca
    # Service-account tokens: signed by the controller-manager and the apiserver, verified by the apiserver.
    openssl genrsa -out "$STATE/pki/sa.key" 2048 2>/dev/null
    openssl rsa -in "$STATE/pki/sa.key" -pubout -out "$STATE/pki/sa.pub" 2>/dev/null
}

kubeconfig() {  # file, client cert name, user
    local f=$1
    "$KUBECTL" config --kubeconfig="$f" set-cluster sluice-dev --server="https://127.0.0.1:$API_PORT" \
        --certificate-authority="$STATE/pki/ca.crt" --embed-certs >/dev/null
    "$KUBECTL" config --kubeconfig="$f" set-credentials "$3" --client-certificate="$STATE/pki/$2.crt" \
        --client-key="$STATE/pki/$2.key" --embed-certs >/dev/null
    "$KUBECTL" config --kubeconfig="$f" set-context sluice-dev --cluster=sluice-dev --user="$3" >/dev/null
    "$KUBECTL" config --kubeconfig="$f" use-context sluice-dev >/dev/null
}

# Simulated nodes: kwok manages nodes annotated kwok.x-k8s.io/node=fake. The GPU nodes say what a real
# GPU node says (nvidia.com/gpu allocatable, the GPU operator's product label).
node() {  # name, cpu, memory, gpus, product
    local gpu_labels="" gpu_alloc=""
    if [[ $4 -gt 0 ]]; then
        gpu_labels="    nvidia.com/gpu.present: \"true\"
    nvidia.com/gpu.product: $5
    nvidia.com/gpu.count: \"$4\""
        gpu_alloc="    nvidia.com/gpu: \"$4\""
    fi
    cat <<EOF
---
apiVersion: v1
kind: Node
metadata:
  name: $1
  annotations:
    kwok.x-k8s.io/node: fake
    node.alpha.kubernetes.io/ttl: "0"
  labels:
    kubernetes.io/hostname: $1
    kubernetes.io/os: linux
    kubernetes.io/arch: amd64
    type: kwok
$gpu_labels
spec: {}
status:
  allocatable: &capacity
    cpu: "$2"
    memory: $3
    pods: "110"
$gpu_alloc
  capacity: *capacity
  nodeInfo:
    architecture: amd64
    operatingSystem: linux
    kubeletVersion: fake
EOF
}

nodes() {
    # GPU nodes the size of an 8-GPU server (a DGX H100: 224 CPUs, 2 TiB): a pod of
    # examples/multinode-70b.yaml asks for 32 CPUs and 512Gi next to 8 GPUs.
    node kwok-cpu-0 16 64Gi 0 ""
    node kwok-cpu-1 16 64Gi 0 ""
    node kwok-gpu-0 224 2Ti 8 NVIDIA-H100-80GB-HBM3
    node kwok-gpu-1 224 2Ti 8 NVIDIA-H100-80GB-HBM3
    node kwok-gpu-2 224 2Ti 8 NVIDIA-L40S
    node kwok-gpu-3 224 2Ti 8 NVIDIA-A100-SXM4-80GB
}

untainted() {
    [[ -z $("$KUBECTL" --kubeconfig="$KUBECONFIG_FILE" get nodes -o jsonpath='{.items[*].spec.taints}') ]]
}

# --- LeaderWorkerSet: CRDs, webhooks, manager -------------------------------------------------------------
# The module's own CRDs and webhook kustomization (copied by get-control-plane.sh to <lws>/share), so they match
# the binary. In a cluster LWS reaches its webhooks through a Service and makes its own certs
# (internalCertManagement); here the apiserver calls https://127.0.0.1:<port>/<path> and the manager serves a
# cert from this cluster's CA, so its cert management and leader election are off.
lws_webhooks() {  # port: the module's webhook configurations, clientConfig a URL with the CA bundle (JSON)
    "$KUBECTL" --kubeconfig="$KUBECONFIG_FILE" apply -k "$LWS_SHARE/webhook" --dry-run=client -o json \
        | python3 -c '
import base64, json, sys
port, ca = sys.argv[1], base64.b64encode(open(sys.argv[2], "rb").read()).decode()
configs = [o for o in json.load(sys.stdin)["items"] if o["kind"].endswith("WebhookConfiguration")]
for o in configs:
    o["metadata"] = {"name": "lws-" + o["metadata"]["name"]}  # the names LWS install manifests give them
    for hook in o["webhooks"]:
        path = hook["clientConfig"]["service"]["path"]
        hook["clientConfig"] = {"url": f"https://127.0.0.1:{port}{path}", "caBundle": ca}
assert {o["kind"] for o in configs} == {"MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"}, configs
print(json.dumps({"apiVersion": "v1", "kind": "List", "items": configs}))
' "$1" "$STATE/pki/ca.crt"
}

lws_probe() {  # a LeaderWorkerSet through the apiserver, not stored: both LWS webhooks must answer
    "$KUBECTL" --kubeconfig="$KUBECONFIG_FILE" create --dry-run=server -o jsonpath='{.spec.networkConfig}' -f - <<'EOF' \
        | grep -q Shared  # set by LWS's defaulting webhook
{"apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet",
 "metadata": {"name": "dev-cluster-probe", "namespace": "default"},
 "spec": {"leaderWorkerTemplate": {"size": 2, "workerTemplate": {"spec": {"containers": [{"name": "c", "image": "x"}]}}}}}
EOF
}

start_lws() {
    local port metrics health
    mkdir -p "$STATE/lws/certs"
    "$KUBECTL" --kubeconfig="$KUBECONFIG_FILE" apply --server-side -f "$LWS_SHARE/crds" >/dev/null
    cert lws-webhook "/CN=lws-webhook" "$(printf '%s\n' "subjectAltName=IP:127.0.0.1" \
        "extendedKeyUsage=serverAuth" "keyUsage=digitalSignature,keyEncipherment")"
    cp "$STATE/pki/lws-webhook.crt" "$STATE/lws/certs/tls.crt"  # controller-runtime's file names
    cp "$STATE/pki/lws-webhook.key" "$STATE/lws/certs/tls.key"
    port=$(free_port); metrics=$(free_port); health=$(free_port)
    echo "$port" >"$STATE/lws/webhook-port"
    cat >"$STATE/lws/config.yaml" <<EOF
apiVersion: config.lws.x-k8s.io/v1alpha1
kind: Configuration
leaderElection:
  leaderElect: false
internalCertManagement:
  enable: false
webhook:
  host: 127.0.0.1
  port: $port
  certDir: $STATE/lws/certs
metrics:
  bindAddress: 127.0.0.1:$metrics
health:
  healthProbeBindAddress: 127.0.0.1:$health
EOF
    wait_for "LWS's CRDs to be Established" 30 "$KUBECTL" --kubeconfig="$KUBECONFIG_FILE" wait -f "$LWS_SHARE/crds" \
        --for=condition=Established --timeout=1s
    start lws-controller "$LWS_BIN/lws-controller" --kubeconfig="$KUBECONFIG_FILE" --config="$STATE/lws/config.yaml"
    wait_for "lws-controller /readyz" 30 curl -sf "http://127.0.0.1:$health/readyz"
    "$KUBECTL" --kubeconfig="$KUBECONFIG_FILE" apply -f - >/dev/null <<<"$(lws_webhooks "$port")"
    wait_for "LWS's webhooks to answer the apiserver" 30 lws_probe
}

# --- Gateway API and Inference Extension CRDs (scripts/get-gateway-crds.sh) ------------------------------------
# The projects' own CRDs, as an install of Envoy Gateway or Istio with the Inference Extension would put them.
start_gateway_crds() {  # dir
    "$KUBECTL" --kubeconfig="$KUBECONFIG_FILE" apply --server-side -f "$1" >/dev/null
    wait_for "the Gateway API CRDs to be Established" 60 "$KUBECTL" --kubeconfig="$KUBECONFIG_FILE" wait -f "$1" \
        --for=condition=Established --timeout=1s
    echo "$1" >"$STATE/gateway-crds"
}

# --- KEDA: CRDs, operator, metrics API server ----------------------------------------------------------------
# Its CRDs from the module (get-control-plane.sh --keda copied them to <keda>/share/crds). In a cluster the
# operator makes a CA and certs for itself and for the metrics server (--enable-cert-rotation) and patches the
# APIService; here both use one cert from this cluster's CA, in the layout KEDA reads from its --cert-dir
# (ca.crt, tls.crt, tls.key): the operator's gRPC metrics service asks for a client cert that CA signed, and
# the metrics server shows that cert, trusting the operator's by the same ca.crt. The apiserver reaches the
# metrics server through the APIService's Service, which has no selector: its one EndpointSlice names
# 127.0.0.1:<port>, and --enable-aggregator-routing makes the aggregator dial that endpoint, not the
# Service's unroutable cluster IP. NOTE: the slice's addressType is FQDN (deprecated, with a warning), whose
# address "127.0.0.1" passes as a name: IPv4 slices (and Endpoints) refuse loopback addresses, and the
# aggregator dials Addresses[0] as it is. Leader election is off; both use the admin kubeconfig.
keda_apiservice() {  # port: Service, EndpointSlice and APIService for external.metrics.k8s.io
    cat <<EOF
apiVersion: v1
kind: List
items:
- apiVersion: v1
  kind: Service
  metadata: {name: keda-metrics-apiserver, namespace: keda}
  spec:
    ports: [{name: https, port: 443, targetPort: $1, protocol: TCP}]
- apiVersion: discovery.k8s.io/v1
  kind: EndpointSlice
  metadata:
    name: keda-metrics-apiserver
    namespace: keda
    labels:
      kubernetes.io/service-name: keda-metrics-apiserver
      endpointslice.kubernetes.io/managed-by: dev-cluster.sluice.dev
  addressType: FQDN
  endpoints: [{addresses: ["127.0.0.1"], conditions: {ready: true}}]
  ports: [{name: https, port: $1, protocol: TCP}]
- apiVersion: apiregistration.k8s.io/v1
  kind: APIService
  metadata: {name: v1beta1.external.metrics.k8s.io}
  spec:
    group: external.metrics.k8s.io
    version: v1beta1
    groupPriorityMinimum: 100
    versionPriority: 100
    service: {name: keda-metrics-apiserver, namespace: keda, port: 443}
    caBundle: $(base64 -w0 "$STATE/pki/ca.crt")
EOF
}

start_keda() {
    local k=("$KUBECTL" --kubeconfig="$KUBECONFIG_FILE") grpc metrics health api api_metrics
    local env=(env KUBECONFIG="$KUBECONFIG_FILE" WATCH_NAMESPACE= POD_NAMESPACE=keda KEDA_CLUSTER_OBJECT_NAMESPACE=keda)
    mkdir -p "$STATE/keda/certs"
    "${k[@]}" apply --server-side -f "$KEDA_SHARE/crds" >/dev/null
    "${k[@]}" create namespace keda >/dev/null
    cert keda "/CN=keda" "$(printf '%s\n' \
        "subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:keda-operator.keda.svc,DNS:keda-metrics-apiserver.keda.svc" \
        "extendedKeyUsage=serverAuth,clientAuth" "keyUsage=digitalSignature,keyEncipherment")"
    cp "$STATE/pki/keda.crt" "$STATE/keda/certs/tls.crt"
    cp "$STATE/pki/keda.key" "$STATE/keda/certs/tls.key"
    cp "$STATE/pki/ca.crt" "$STATE/keda/certs/ca.crt"
    grpc=$(free_port); metrics=$(free_port); health=$(free_port); api=$(free_port); api_metrics=$(free_port)
    printf 'grpc=%s\noperator-metrics=%s\noperator-health=%s\nmetrics-apiserver=%s\nmetrics-apiserver-metrics=%s\n' \
        "$grpc" "$metrics" "$health" "$api" "$api_metrics" >"$STATE/keda/ports"
    wait_for "KEDA's CRDs to be Established" 30 "${k[@]}" wait -f "$KEDA_SHARE/crds" --for=condition=Established --timeout=1s
    start keda-operator "${env[@]}" "$KEDA_BIN/keda-operator" --kubeconfig="$KUBECONFIG_FILE" --leader-elect=false \
        --metrics-bind-address="127.0.0.1:$metrics" --health-probe-bind-address="127.0.0.1:$health" \
        --metrics-service-bind-address="127.0.0.1:$grpc" --enable-cert-rotation=false --cert-dir="$STATE/keda/certs" \
        --ca-dir="$STATE/keda/certs" --zap-log-level=info --zap-encoder=console
    wait_for "keda-operator /readyz" 60 curl -sf "http://127.0.0.1:$health/readyz"
    # --port: its own /metrics listener, which binds every interface (KEDA has no flag for the address).
    start keda-metrics-apiserver "${env[@]}" "$KEDA_BIN/keda-adapter" --kubeconfig="$KUBECONFIG_FILE" \
        --lister-kubeconfig="$KUBECONFIG_FILE" --authentication-kubeconfig="$KUBECONFIG_FILE" \
        --authorization-kubeconfig="$KUBECONFIG_FILE" --bind-address=127.0.0.1 --secure-port="$api" \
        --cert-dir="$STATE/keda/certs" --tls-cert-file="$STATE/keda/certs/tls.crt" \
        --tls-private-key-file="$STATE/keda/certs/tls.key" --client-ca-file="$STATE/pki/ca.crt" \
        --metrics-service-address="127.0.0.1:$grpc" --port="$api_metrics" --zap-log-level=info --zap-encoder=console
    "${k[@]}" apply -f - >/dev/null <<<"$(keda_apiservice "$api")" 2> >(grep -v 'FQDN endpoints are deprecated' >&2)
    wait_for "the external metrics API (KEDA's metrics server behind the aggregator)" 60 \
        "${k[@]}" get --raw /apis/external.metrics.k8s.io/v1beta1
    touch "$STATE/keda/ready"
}

up() {  # [--keda] [--engines]
    local with_keda="" with_engines=""
    while [[ $# -gt 0 ]]; do
        case $1 in
            --keda) with_keda=1 ;;
            --engines) with_keda=1; with_engines=1 ;;
            *) echo "usage: $0 up [--keda] [--engines]" >&2; exit 2 ;;
        esac
        shift
    done
    if running kube-apiserver; then
        say "already up ($STATE)"; return 0
    fi
    local start=$SECONDS bin k8s
    if [[ -n $with_keda ]]; then
        KEDA_BIN=$(bash "$HERE/get-control-plane.sh" --keda-bin | tail -n 1) \
            || die "up --keda: KEDA is not built (bash scripts/get-control-plane.sh --keda)"
        KEDA_SHARE=$KEDA_BIN/../share
    fi
    [[ -z $with_engines ]] || engines_preflight
    bin=$(bash "$HERE/get-control-plane.sh" | tail -n 1)
    LWS_BIN=$(bash "$HERE/get-control-plane.sh" --lws-bin 2>/dev/null | tail -n 1) || LWS_BIN=""
    LWS_SHARE=${LWS_BIN:+$LWS_BIN/../share}
    k8s=$("$bin/kube-apiserver" --version | awk '{print $2}')
    rm -rf "$STATE"
    mkdir -p "$STATE/logs" "$STATE/pids" "$STATE/etcd"
    ETCD_PORT=$(free_port); local peer; peer=$(free_port); API_PORT=$(free_port)
    echo "$API_PORT" >"$STATE/api-port"
    make_pki

    start etcd "$bin/etcd" --name=dev --data-dir="$STATE/etcd" --unsafe-no-fsync \
        --listen-client-urls="http://127.0.0.1:$ETCD_PORT" --advertise-client-urls="http://127.0.0.1:$ETCD_PORT" \
        --listen-peer-urls="http://127.0.0.1:$peer" --initial-advertise-peer-urls="http://127.0.0.1:$peer" \
        --initial-cluster="dev=http://127.0.0.1:$peer" --listen-metrics-urls="" --log-level=warn
    wait_for "etcd" 20 curl -sf "http://127.0.0.1:$ETCD_PORT/health"

    start kube-apiserver "$bin/kube-apiserver" \
        --etcd-servers="http://127.0.0.1:$ETCD_PORT" \
        --bind-address=127.0.0.1 --advertise-address=127.0.0.1 --secure-port="$API_PORT" \
        --cert-dir="$STATE/pki" --tls-cert-file="$STATE/pki/apiserver.crt" --tls-private-key-file="$STATE/pki/apiserver.key" \
        --client-ca-file="$STATE/pki/ca.crt" \
        --service-account-issuer=https://kubernetes.default.svc.cluster.local \
        --service-account-key-file="$STATE/pki/sa.pub" --service-account-signing-key-file="$STATE/pki/sa.key" \
        --authorization-mode=Node,RBAC --anonymous-auth=false \
        --service-cluster-ip-range=10.96.0.0/16 --allow-privileged=true \
        --endpoint-reconciler-type=none --profiling=false \
        --requestheader-client-ca-file="$STATE/pki/front-proxy-ca.crt" --requestheader-allowed-names=front-proxy-client \
        --requestheader-username-headers=X-Remote-User --requestheader-group-headers=X-Remote-Group \
        --requestheader-extra-headers-prefix=X-Remote-Extra- \
        --proxy-client-cert-file="$STATE/pki/front-proxy-client.crt" --proxy-client-key-file="$STATE/pki/front-proxy-client.key" \
        --enable-aggregator-routing=true
    kubeconfig "$KUBECONFIG_FILE" admin sluice-admin
    kubeconfig "$STATE/controller-manager.kubeconfig" controller-manager system:kube-controller-manager
    kubeconfig "$STATE/scheduler.kubeconfig" scheduler system:kube-scheduler
    wait_for "kube-apiserver /readyz" 60 "$KUBECTL" --kubeconfig="$KUBECONFIG_FILE" get --raw=/readyz

    # Controllers that make a Deployment into pods and clean up after it; the binder that binds
    # PersistentVolumeClaims to pre-made PersistentVolumes (no cloud, no provisioner); and the node lifecycle
    # controller: it lifts the not-ready taint the apiserver puts on a new Node once kwok reports it Ready.
    # kwok must then keep each node's Lease fresh (--node-lease-duration-seconds): its Stage patches node
    # status only now and then, and without Leases the controller finds every node silent after its grace
    # period (~40 s) and marks every pod NotReady.
    start kube-controller-manager "$bin/kube-controller-manager" \
        --kubeconfig="$STATE/controller-manager.kubeconfig" --secure-port=0 --leader-elect=false \
        --use-service-account-credentials=true --service-account-private-key-file="$STATE/pki/sa.key" \
        --root-ca-file="$STATE/pki/ca.crt" \
        --controllers=serviceaccount-token-controller,serviceaccount-controller,root-ca-certificate-publisher-controller,garbage-collector-controller,namespace-controller,deployment-controller,replicaset-controller,statefulset-controller,job-controller,disruption-controller,endpointslice-controller,horizontal-pod-autoscaler-controller,clusterrole-aggregation-controller,node-lifecycle-controller,persistentvolume-binder-controller
    start kube-scheduler "$bin/kube-scheduler" --kubeconfig="$STATE/scheduler.kubeconfig" \
        --authentication-kubeconfig="$STATE/scheduler.kubeconfig" --authorization-kubeconfig="$STATE/scheduler.kubeconfig" \
        --secure-port=0 --leader-elect=false
    "$KUBECTL" --kubeconfig="$KUBECONFIG_FILE" apply -f - >/dev/null <<<"$(nodes)"
    # SLUICE_KWOK_CIDR: the pods' addresses (10.244.0.0/16, unreachable, unless pods are run for real: then a
    # 127.x range, every address of which is this machine's loopback). SLUICE_KWOK_STAGES: the Stage file.
    start kwok "$bin/kwok" --kubeconfig="$KUBECONFIG_FILE" --config="${SLUICE_KWOK_STAGES:-$bin/../share/kwok-stages.yaml}" \
        --manage-all-nodes=false --manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake \
        --node-ip=127.0.0.1 --cidr="${SLUICE_KWOK_CIDR:-10.244.0.0/16}" --node-lease-duration-seconds=40

    wait_for "kwok's nodes to be Ready" 30 "$KUBECTL" --kubeconfig="$KUBECONFIG_FILE" wait node \
        --all --for=condition=Ready --timeout=1s
    wait_for "the nodes' not-ready taints to be lifted" 30 untainted
    wait_for "the default ServiceAccount" 30 "$KUBECTL" --kubeconfig="$KUBECONFIG_FILE" get serviceaccount default
    local gateway_crds gateway="no Gateway API CRDs (scripts/get-gateway-crds.sh: $STATE/logs/gateway-crds.log)"
    if gateway_crds=$(bash "$HERE/get-gateway-crds.sh" 2>"$STATE/logs/gateway-crds.log" | tail -n 1) \
            && [[ -d $gateway_crds ]]; then
        start_gateway_crds "$gateway_crds"
        gateway="Gateway API and Inference Extension CRDs"
    else
        say "skipping the Gateway API CRDs: $(tail -n 1 "$STATE/logs/gateway-crds.log")"
    fi
    local lws="no LeaderWorkerSet controller (not built: see scripts/get-control-plane.sh)"
    if [[ -n $LWS_BIN ]]; then
        start_lws
        lws="LeaderWorkerSet $("$LWS_BIN/lws-controller" --version | awk '/^Version/{print $2}') (webhooks on 127.0.0.1:$(cat "$STATE/lws/webhook-port"))"
    fi
    local keda=""
    if [[ -n $with_keda ]]; then
        start_keda
        keda=", KEDA (external metrics API on 127.0.0.1:$(sed -n 's/^metrics-apiserver=//p' "$STATE/keda/ports"))"
    fi
    if [[ -n $with_engines ]]; then
        start_engines
        keda+=$(engines_summary)
    fi
    say "up in $((SECONDS - start)) s: Kubernetes $k8s at https://127.0.0.1:$API_PORT, 6 kwok nodes (4 with 8 GPUs), $lws, $gateway$keda"
    say "state and logs: $STATE"
    echo "export KUBECONFIG=$KUBECONFIG_FILE"
    [[ ! -f $STATE/engines/env ]] || cat "$STATE/engines/env"
}

alive() { local pid; for pid; do kill -0 "$pid" 2>/dev/null && return 0; done; return 1; }

stop_components() {  # tenths of a second to wait, names...: SIGTERM to all of them, then SIGKILL what is left
    local wait=$1 name pids=(); shift
    for name; do
        running "$name" && pids+=("$(cat "$STATE/pids/$name")")
    done
    [[ ${#pids[@]} -gt 0 ]] || return 0
    kill "${pids[@]}" 2>/dev/null || true
    for _ in $(seq "$wait"); do alive "${pids[@]}" || break; sleep 0.1; done
    kill -9 "${pids[@]}" 2>/dev/null || true
}

down() {  # SIGTERM to all, then SIGKILL what is left after 5 s: the state is thrown away anyway
    engines_down  # first, while the API server still answers: the pod runner stops its engines, drops its routes
    stop_components 50 "${COMPONENTS[@]}"
    rm -rf "$STATE"
    say "down"
}

status() {
    local name rc=0
    for name in "${COMPONENTS[@]}"; do
        if running "$name"; then echo "$name: running (pid $(cat "$STATE/pids/$name"))"
        elif [[ $name == lws-controller && ! -d $STATE/lws ]]; then echo "$name: not started (not built)"
        elif [[ $name == keda-* && ! -d $STATE/keda ]]; then echo "$name: not started (up without --keda)"
        elif [[ " ${ENGINE_COMPONENTS[*]} " == *" $name "* && ! -d $STATE/engines ]]; then
            echo "$name: not started (up without --engines)"
        else echo "$name: not running"; rc=1; fi
    done
    [[ $rc -eq 0 ]] && "$KUBECTL" --kubeconfig="$KUBECONFIG_FILE" get nodes -L nvidia.com/gpu.product
    return $rc
}

case ${1:-} in
    up) shift; up "$@" ;;
    down) down ;;
    env) [[ -f "$KUBECONFIG_FILE" ]] || die "not up (no $KUBECONFIG_FILE): run scripts/dev-cluster.sh up"
         echo "export KUBECONFIG=$KUBECONFIG_FILE"
         [[ ! -f $STATE/engines/env ]] || cat "$STATE/engines/env" ;;
    status) status ;;
    *) echo "usage: $0 up [--keda] [--engines] | down | env | status" >&2; exit 2 ;;
esac
