# Sourced by scripts/dev-cluster.sh for `up --engines`: the Sluice stack on the dev cluster, with its pods run for
# real. On top of the control plane and KEDA (which --engines implies):
#
#   pod-runner      scripts/pod_runner.py: the engine pods kwok schedules are `sluice serve` processes on their pod
#                   IPs (198.18.0.0/16, made local addresses of this machine), Ready from the engine's /ready
#   kube-proxy      `kubectl proxy` on 127.0.0.1 for the gateway, which reads in-cluster credentials only
#   gateway         `sluice gateway --kubernetes`: the OpenAI endpoint users call ($SLUICE_GATEWAY_URL), holding
#                   requests while an endpoint scales from zero, and KEDA's external scaler
#   operator        `sluice operator`, as the chart runs it, with the gateway's and Prometheus' local addresses
#   prometheus      scripts/dev_prometheus.py: Debian's prometheus, scraping what the rendered PodMonitors and
#                   ServiceMonitors select (kubernetes_sd_configs through the API server) and evaluating the
#                   rendered PrometheusRules ($PROMETHEUS_URL); the gateway and operator as static targets
#
# The operator, gateway and Prometheus run as processes here instead of the chart's pods (kwok's pods run
# nothing): what runs is the same code with the chart's arguments, reached at 127.0.0.1. Ports and URLs are in
# $STATE/engines/env (`dev-cluster.sh env` prints them).

ENGINE_CIDR=${SLUICE_ENGINE_CIDR:-198.18.0.0/16}  # RFC 2544's benchmarking range: EndpointSlices refuse loopback (127.x) addresses
ENGINE_COMPONENTS=(operator gateway kube-proxy prometheus pod-runner)  # stop order, before KEDA's

engines_python() {
    if [[ -x "$HERE/../.venv/bin/python" ]]; then echo "$HERE/../.venv/bin/python"; else command -v python3; fi
}

engines_preflight() {  # before the cluster starts: what --engines needs on this machine
    local py
    py=$(engines_python)
    "$py" -c 'import sluice_engine, sluice_operator, sluice_autoscaler' 2>/dev/null \
        || die "up --engines: the sluice package is not installed for $py (bash scripts/setup.sh)"
    bash "$HERE/get-promtool.sh" >&2 || true
    [[ -x "$HERE/../.tools/bin/prometheus" ]] || die "up --engines: no .tools/bin/prometheus (scripts/get-promtool.sh)"
    ip route show table local >/dev/null 2>&1 || die "up --engines: the ip command (iproute2) is needed for pod IPs"
    export SLUICE_KWOK_CIDR=$ENGINE_CIDR SLUICE_KWOK_STAGES="$HERE/kwok-engine-stages.yaml"
}

start_engines() {
    local py k=("$KUBECTL" --kubeconfig="$KUBECONFIG_FILE") gateway scaler peer proxy prom opmetrics ophealth
    py=$(engines_python)
    mkdir -p "$STATE/engines" "$STATE/logs/pods"
    gateway=$(free_port); scaler=$(free_port); peer=$(free_port); proxy=$(free_port); prom=$(free_port)
    opmetrics=$(free_port); ophealth=$(free_port)
    "${k[@]}" apply --server-side -f "$HERE/../crds" >/dev/null
    "${k[@]}" create namespace sluice-system >/dev/null
    "${k[@]}" wait crd --all --for=condition=Established --timeout=30s >/dev/null

    start pod-runner "$py" "$HERE/pod_runner.py" --kubeconfig "$KUBECONFIG_FILE" --log-dir "$STATE/logs/pods" \
        --max-engines "${SLUICE_DEV_MAX_ENGINES:-2}"
    start kube-proxy "${k[@]}" proxy --address=127.0.0.1 --port="$proxy"
    wait_for "kubectl proxy" 20 curl -sf "http://127.0.0.1:$proxy/readyz"
    start gateway "$py" -m sluice_engine.entrypoints.cli gateway --kubernetes --kube-api "http://127.0.0.1:$proxy" \
        --host 127.0.0.1 --port "$gateway" --scaler-port "$scaler" --peer-port "$peer"
    wait_for "the gateway's /health" 60 curl -sf "http://127.0.0.1:$gateway/health"
    # Before the operator: the monitoring CRDs must be there when it first renders an endpoint (it skips a kind
    # whose CRD is missing). Static targets: the processes that run here instead of pods.
    start prometheus "$py" "$HERE/dev_prometheus.py" --cluster-dir "$STATE" --port "$prom" --max-interval 5s \
        --static-target "gateway=127.0.0.1:$gateway" --static-target "operator=127.0.0.1:$opmetrics" \
        --static-target "keda-operator=127.0.0.1:$(sed -n 's/^operator-metrics=//p' "$STATE/keda/ports")"
    wait_for "the monitoring CRDs" 60 "${k[@]}" get crd prometheusrules.monitoring.coreos.com servicemonitors.monitoring.coreos.com
    wait_for "Prometheus' /-/ready" 60 curl -sf "http://127.0.0.1:$prom/-/ready"
    start operator env KUBECONFIG="$KUBECONFIG_FILE" PYTHONUNBUFFERED=1 POD_NAMESPACE=sluice-system \
        SLUICE_GATEWAY_SCALER_ADDRESS="127.0.0.1:$scaler" SLUICE_GATEWAY_URL="http://127.0.0.1:$gateway" \
        SLUICE_PROMETHEUS_URL="http://127.0.0.1:$prom" \
        "$py" -m sluice_engine.entrypoints.cli operator --resync-seconds 10 --metrics-port "$opmetrics" \
        --liveness "http://127.0.0.1:$ophealth/healthz"
    wait_for "the operator's liveness" 60 curl -sf "http://127.0.0.1:$ophealth/healthz"
    echo "$ENGINE_CIDR" >"$STATE/engines/cidr"
    cat >"$STATE/engines/env" <<EOF
export SLUICE_GATEWAY_URL=http://127.0.0.1:$gateway
export PROMETHEUS_URL=http://127.0.0.1:$prom
EOF
}

engines_summary() {
    [[ -f $STATE/engines/env ]] || return 0
    echo ", Sluice (operator, gateway $(sed -n 's/^export SLUICE_GATEWAY_URL=//p' "$STATE/engines/env"), Prometheus" \
        "$(sed -n 's/^export PROMETHEUS_URL=//p' "$STATE/engines/env"), engine pods on $ENGINE_CIDR)"
}

engines_down() {  # the Sluice processes (the pod runner stops its engines), then any local route left in the range
    stop_components 150 "${ENGINE_COMPONENTS[@]}"
    [[ -f $STATE/engines/cidr ]] || return 0
    # A runner killed before it cleaned up leaves `local` routes for its pod IPs: delete those in this cluster's range.
    ip route show table local | awk '$1 == "local" {print $2}' | python3 -c '
import ipaddress, sys
net = ipaddress.ip_network(sys.argv[1])
for line in sys.stdin:
    addr = line.strip().split("/")[0]
    if addr and ipaddress.ip_address(addr) in net:
        print(addr)' "$(cat "$STATE/engines/cidr")" | while read -r addr; do
        ip route del local "$addr/32" dev lo 2>/dev/null || true
    done
}
