"""The endpoint picker on the real API server, in front of engine pods that serve for real (issue 41, acceptance
1 and 4; marker `cluster`).

A dev cluster of its own (tests/support/engine_pods.py: kwok pod addresses, scripts/pod_runner.py running each
engine pod's `sluice serve`) with the official Gateway API and Inference Extension CRDs (dev-cluster.sh up
installs them from their Go modules). Two endpoints: `pool-a` (2 replicas, spec.routing.inferencePool) and
`pool-b` (1 replica), each applied as `sluice render` makes it. Then:
- the rendered InferencePool, picker and HTTPRoute are admitted by the official CRDs;
- `sluice gateway --endpoint-picker --pool default/pool-a`, authenticated as the picker's rendered
  ServiceAccount (its Role is all it may read), driven over ext-proc by e2e/extproc_gateway, sends every
  request to a ready pod of pool-a and none to pool-b's, and the real openai client gets its answers;
- a pod whose Ready condition goes False stops being picked within a second;
- GIE's own reference picker (scripts/get-gie-epp.sh; skipped where it is not built) picks among the same Sluice
  engines from their vllm:* metrics: with one engine's queue full it sends the requests to the other.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from dev_cluster import ROOT, SCRIPTS, Cluster, tail, wait_until
from engine_pods import Runner, apply_endpoint, endpoint_pods, engines_cluster, is_ready, pod_cidr, why_not
from extproc_gateway import run_extproc_gateway
from servers import SERVED_NAME, free_port, stop_process

pytestmark = pytest.mark.cluster

NAMESPACE = "default"
CIDR = pod_cidr(offset=101)
SERVED = "x-gateway-destination-endpoint-served"
ALL_KINDS = ("ConfigMap", "Deployment", "Service", "PodDisruptionBudget", "InferencePool", "HTTPRoute",
             "ServiceAccount", "Role", "RoleBinding")


def endpoint(name: str, replicas: int, routing: bool) -> dict[str, Any]:
    ep = yaml.safe_load((ROOT / "examples" / "cpu-smollm2.yaml").read_text())
    ep["metadata"] = {"name": name, "namespace": NAMESPACE}
    ep["spec"]["replicas"] = replicas
    # one sequence at a time: a few direct requests fill an engine's queue (the GIE picker test)
    ep["spec"]["engine"]["args"] = {"kv-cache-memory": "160MiB", "max-num-seqs": 1}
    ep["spec"]["pod"] = {"env": [{"name": "OMP_NUM_THREADS", "value": "1"}],
                         "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}}}
    if routing:
        ep["spec"]["routing"] = {"inferencePool": {
            "gatewayNamespaces": ["gateway-system"],
            "httpRoute": {"parentRefs": [{"name": "shared-gw", "namespace": "gateway-system"}]}}}
    return ep


class Stack:
    def __init__(self, cluster: Cluster, workdir: Path, runner: Runner, applied: dict[str, list[dict[str, Any]]]):
        self.cluster, self.workdir, self.runner, self.applied = cluster, workdir, runner, applied

    def ready_ips(self, name: str) -> list[str]:
        return sorted(p["status"]["podIP"] for p in endpoint_pods(self.cluster, NAMESPACE, name)
                      if is_ready(p) and p["status"].get("podIP"))


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    why = why_not(CIDR)
    if why is not None:
        pytest.skip(why)
    workdir = tmp_path_factory.mktemp("picker-cluster")
    with engines_cluster(workdir / "cluster", CIDR) as c:
        if c.get("crd", "inferencepools.inference.networking.k8s.io") is None:
            pytest.skip("the Inference Extension CRDs are not installed (scripts/get-gateway-crds.sh could not "
                        f"fetch them: {c.state / 'logs' / 'gateway-crds.log'})")
        runner = Runner(c, workdir / "pods", "--max-engines", "3")
        try:
            applied = {name: apply_endpoint(c, endpoint(name, n, name == "pool-a"), workdir, ALL_KINDS)
                       for name, n in (("pool-a", 2), ("pool-b", 1))}
            s = Stack(c, workdir, runner, applied)
            wait_until("3 engine pods ready", lambda: len(s.ready_ips("pool-a")) == 2 and s.ready_ips("pool-b"),
                       300, 1)
            yield s
        finally:
            runner.stop()


@pytest.fixture(scope="module")
def picker(stack: Stack) -> Iterator[str]:
    """`sluice gateway --endpoint-picker` as the rendered picker Deployment runs it, authenticated as its
    ServiceAccount (through `kubectl proxy` with the account's token: the gateway reads in-cluster credentials
    only); yields its ext-proc address."""
    c = stack.cluster
    deploy = next(o for o in stack.applied["pool-a"] if o["kind"] == "Deployment" and o["metadata"]["name"] == "pool-a-epp")
    container = deploy["spec"]["template"]["spec"]["containers"][0]
    args = container["args"]
    assert args[:args.index("--pool") + 2][-2:] == ["--pool", f"{NAMESPACE}/pool-a"], args
    account = deploy["spec"]["template"]["spec"]["serviceAccountName"]
    kubeconfig = c.token_kubeconfig(stack.workdir / "picker.kubeconfig", NAMESPACE, account)
    proxy_port, http_port, grpc_port = free_port(), free_port(), free_port()
    logs = {n: stack.workdir / f"{n}.log" for n in ("proxy", "picker")}
    with open(logs["proxy"], "w") as proxy_log, open(logs["picker"], "w") as picker_log:
        proxy = subprocess.Popen([c.kubectl_path, f"--kubeconfig={kubeconfig}", "proxy", "--address=127.0.0.1",
                                  f"--port={proxy_port}"], stdout=proxy_log, stderr=subprocess.STDOUT)
        # The Deployment's own command line, with this machine's ports and the proxy for in-cluster credentials.
        argv = [*container.get("command", []), *args]
        assert argv[:2] == ["sluice", "gateway"], argv
        local = list(argv[2:])
        for flag, value in (("--port", http_port), ("--picker-port", grpc_port)):
            local[local.index(flag) + 1] = str(value)
        proc = subprocess.Popen([sys.executable, "-m", "sluice_engine.entrypoints.cli", "gateway", *local,
                                 "--kube-api", f"http://127.0.0.1:{proxy_port}", "--host", "127.0.0.1",
                                 "--scaler-port", str(free_port()), "--peer-port", str(free_port())],
                                stdout=picker_log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        def ready() -> bool:
            try:
                return httpx.get(f"http://127.0.0.1:{http_port}/ready", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False
        try:
            wait_until("the picker to list pool-a's pods", ready, 60, 0.2)
        except AssertionError as e:
            raise AssertionError(f"{e}\npicker log:\n{tail(logs['picker'].read_text())}\nproxy log:\n"
                                 f"{tail(logs['proxy'].read_text())}") from None
        yield f"127.0.0.1:{grpc_port}"
    finally:
        for p in (proc, proxy):
            stop_process(p)
        text = logs["picker"].read_text()
        # 403 as a number of its own (a port such as 127.0.0.1:40391 or a timestamp's ",403" is none).
        denied = [line for line in text.splitlines()
                  if re.search(r"(?<![0-9,])403(?![0-9])", line) or "forbidden" in line.lower()]
        assert not denied, tail(text)


def test_the_rendered_gie_objects_are_admitted_by_the_official_crds(stack: Stack) -> None:
    c = stack.cluster
    pool = c.json("get", "inferencepool", "pool-a", "-n", NAMESPACE)
    service = c.json("get", "service", "pool-a", "-n", NAMESPACE)
    assert pool["spec"]["selector"]["matchLabels"] == service["spec"]["selector"]
    assert pool["spec"]["endpointPickerRef"]["name"] == "pool-a-epp"
    route = c.json("get", "httproute", "pool-a", "-n", NAMESPACE)
    assert route["spec"]["rules"][0]["backendRefs"][0]["kind"] == "InferencePool"
    assert c.get("inferencepool", "pool-b", "-n", NAMESPACE) is None  # no routing, no pool


def test_requests_go_to_ready_pods_of_the_pool_and_never_to_another_endpoints(stack: Stack, picker: str) -> None:
    import openai

    a, b = stack.ready_ips("pool-a"), stack.ready_ips("pool-b")
    with run_extproc_gateway(["--epp", picker]) as url:
        served = []
        for i in range(10):
            r = httpx.post(f"{url}/v1/completions", timeout=120, json={
                "model": SERVED_NAME, "prompt": f"Prompt number {i}: once upon a time", "max_tokens": 2})
            assert r.status_code == 200, r.text
            served.append(r.headers[SERVED].rsplit(":", 1)[0])
        assert set(served) <= set(a) and not set(served) & set(b), (served, a, b)
        assert len(set(served)) == 2, served  # both of the pool's pods take requests
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        reply = client.chat.completions.create(model=SERVED_NAME, max_tokens=4,
                                               messages=[{"role": "user", "content": "Say hello."}])
        assert reply.choices[0].message.content


def test_a_pod_that_goes_unready_stops_being_picked_within_a_second(stack: Stack, picker: str) -> None:
    c = stack.cluster
    prompt = "A prompt that sticks to one pod by its prefix."
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": 1}
    with run_extproc_gateway(["--epp", picker]) as url:
        first = httpx.post(f"{url}/v1/completions", json=body, timeout=120).headers[SERVED].rsplit(":", 1)[0]
        pod = next(p for p in endpoint_pods(c, NAMESPACE, "pool-a") if p["status"].get("podIP") == first)
        name = pod["metadata"]["name"]
        patch = ('{"status":{"conditions":[{"type":"Ready","status":"False","reason":"TestUnready"},'
                 '{"type":"ContainersReady","status":"False","reason":"TestUnready"}]}}')
        t0 = time.monotonic()
        c.kubectl("patch", "pod", name, "-n", NAMESPACE, "--subresource=status", "--type=strategic", "-p", patch)
        moved = None
        while time.monotonic() - t0 < 10:
            served = httpx.post(f"{url}/v1/completions", json=body, timeout=120).headers[SERVED].rsplit(":", 1)[0]
            if served != first:
                moved = time.monotonic() - t0
                break
        assert moved is not None, f"{name} ({first}) still picked 10 s after it went unready"
        assert moved < 1.0, f"{name} was picked for {moved:.2f} s after it went unready"
        print(f"unready pod last picked {moved:.3f} s after its Ready condition went False")  # -s shows it
        # back: Ready again, picked again (the prefix's pod)
        c.kubectl("patch", "pod", name, "-n", NAMESPACE, "--subresource=status", "--type=strategic", "-p",
                  patch.replace('"False","reason":"TestUnready"', '"True","reason":null'))
        wait_until(f"{name} to be picked again", lambda: httpx.post(
            f"{url}/v1/completions", json=body, timeout=120).headers[SERVED].startswith(first + ":"), 10, 0.1)


def test_gies_reference_picker_picks_among_sluice_engines_from_their_metrics(stack: Stack) -> None:
    built = subprocess.run(["bash", str(SCRIPTS / "get-gie-epp.sh"), "--bin"], capture_output=True, text=True)
    if built.returncode != 0:
        pytest.skip(f"GIE's reference picker is not built: {built.stderr.strip()}")
    c, epp = stack.cluster, built.stdout.strip().splitlines()[-1] + "/epp"
    a = stack.ready_ips("pool-a")
    grpc_port = free_port()
    log = stack.workdir / "gie-epp.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([epp, "--pool-name", "pool-a", "--pool-namespace", NAMESPACE, "--grpc-port",
                                 str(grpc_port), "--grpc-health-port", str(free_port()), "--metrics-port",
                                 str(free_port()), "--secure-serving=false", "--tracing=false",
                                 "--refresh-metrics-interval", "50ms"], stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "KUBECONFIG": str(c.kubeconfig), "POD_NAMESPACE": NAMESPACE})
    busy, free = a[0], a[1]
    stop = threading.Event()

    def keep_busy() -> None:  # engines run one sequence at a time: these keep busy's queue non-empty
        with httpx.Client(timeout=300) as client:
            while not stop.is_set():
                client.post(f"http://{busy}:8000/v1/completions", json={
                    "model": SERVED_NAME, "prompt": "Count slowly to one hundred:", "max_tokens": 64,
                    "ignore_eos": True})

    fillers = [threading.Thread(target=keep_busy, daemon=True) for _ in range(3)]
    try:
        time.sleep(3)
        assert proc.poll() is None, tail(log.read_text())
        for t in fillers:
            t.start()

        def queued() -> bool:
            text = httpx.get(f"http://{busy}:8000/metrics", timeout=5).text
            return any(line.startswith("vllm:num_requests_waiting") and float(line.rsplit(" ", 1)[1]) >= 1
                       for line in text.splitlines())
        wait_until(f"{busy}'s queue (vllm:num_requests_waiting) to fill", queued, 60, 0.1)
        time.sleep(1)  # the picker scrapes every 50 ms; a refresh or two
        with run_extproc_gateway(["--epp", f"127.0.0.1:{grpc_port}"]) as url:
            served = [httpx.post(f"{url}/v1/completions", timeout=300, json={
                "model": SERVED_NAME, "prompt": f"Distinct prompt {i}", "max_tokens": 1}).headers[SERVED]
                for i in range(6)]
        picked = [s.rsplit(":", 1)[0] for s in served]
        assert set(picked) <= set(a), picked
        assert picked.count(free) >= 5, (picked, busy, free)  # the queue scorer read busy's vllm:* gauges
    finally:
        stop.set()
        stop_process(proc)
        for t in fillers:
            t.join(timeout=300)
