"""The whole loop on one machine (issue 40; marker `cluster`): `scripts/dev-cluster.sh up --engines` on a cluster of its
own: the control plane, real KEDA (operator and metrics API server behind the aggregator), the Sluice operator and
gateway, Debian's Prometheus discovering the engine pods through the API server, and scripts/pod_runner.py running
the engine pods kwok schedules as real `sluice serve` processes on their pod IPs.

In file order, on examples/cpu-scale-to-zero.yaml: KEDA makes the endpoint's HPA and scales it to zero; the first
request through the gateway (the real `openai` client, streamed) is held, KEDA activates 0 -> 1 on the gateway's
push, the runner starts the engine, the answer comes (time to first token from zero printed); Prometheus scrapes
the engine pod and the rules the operator rendered evaluate: the counters it holds are the engine's own, and the
recorded cost per 1M tokens is the engine's price over the token rate; with KEDA's operator killed the endpoint
keeps serving and the outage alert (SluiceAutoscalerNotWatching) fires, and when it returns it subscribes to the
gateway again and the alert resolves; after the cooldown the endpoint goes back to zero.

Skipped, saying why, where KEDA is not built (`scripts/get-control-plane.sh --keda`, ~21 min on 2 cores: CI on a
fresh machine skips this module), local routes cannot be added (root or CAP_NET_ADMIN), or Prometheus is missing.
"""

from __future__ import annotations

import copy
import os
import shlex
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from dev_cluster import ROOT, SCRIPTS, Cluster, tail, tool, wait_until

pytestmark = pytest.mark.cluster

EXAMPLE = ROOT / "examples" / "cpu-scale-to-zero.yaml"
DOC = yaml.safe_load(EXAMPLE.read_text())
NAME, NAMESPACE = DOC["metadata"]["name"], DOC["metadata"].get("namespace", "default")
MODEL = f"{NAMESPACE}/{DOC['spec']['model']['servedName']}"
PRICE_USD_H = DOC["spec"]["cost"]["gpuHourUSD"]
CIDR = f"198.19.{(os.getpid() + 125) % 250}.0/24"  # apart from the dev cluster's 198.18.0.0/16 and the runner test's
COOLDOWN_S = 15  # spec.scaling.scaleDownDelaySeconds here: KEDA's cooldownPeriod
LAST_REQUEST = 0.0  # time.monotonic() of the last answer through the gateway


@dataclass
class Loop:
    cluster: Cluster
    env: dict[str, str]
    state: Path
    script_env: dict[str, str]

    @property
    def gateway(self) -> str:
        return self.env["SLUICE_GATEWAY_URL"]

    @property
    def prometheus(self) -> str:
        return self.env["PROMETHEUS_URL"]

    def replicas(self) -> int | None:
        deploy = self.cluster.get("deployment", NAME, "-n", NAMESPACE)
        return None if deploy is None else deploy["spec"].get("replicas")

    def pods(self) -> list[dict[str, Any]]:
        return self.cluster.json("get", "pods", "-n", NAMESPACE, "-l", f"sluice.dev/endpoint={NAME}")["items"]

    def query(self, promql: str, at: float | None = None) -> list[dict[str, Any]]:
        params = {"query": promql} if at is None else {"query": promql, "time": str(at)}
        r = httpx.get(f"{self.prometheus}/api/v1/query", params=params, timeout=10)
        r.raise_for_status()
        return r.json()["data"]["result"]

    def logs(self) -> str:
        logs = self.state / "logs"
        return "\n".join(f"--- {p.name}\n{tail(p.read_text(errors='replace'), 15)}"
                         for p in sorted(logs.glob("*.log")) if p.name in (
                             "operator.log", "gateway.log", "keda-operator.log", "pod-runner.log", "prometheus.log"))


def _skip_reason() -> str | None:
    keda = subprocess.run(["bash", str(SCRIPTS / "get-control-plane.sh"), "--keda-bin"], capture_output=True, text=True)
    if keda.returncode != 0:
        return "KEDA is not built: bash scripts/get-control-plane.sh --keda (about 21 min on 2 cores, cold)"
    probe = f"{CIDR.rsplit('.', 1)[0]}.254/32"
    add = subprocess.run(["ip", "route", "add", "local", probe, "dev", "lo"], capture_output=True, text=True)
    if add.returncode != 0:
        return f"the pod runner routes pod IPs to this machine, which needs root or CAP_NET_ADMIN: {add.stderr.strip()}"
    subprocess.run(["ip", "route", "del", "local", probe, "dev", "lo"], capture_output=True)
    subprocess.run(["bash", str(SCRIPTS / "get-promtool.sh")], capture_output=True)
    if not (ROOT / ".tools" / "bin" / "prometheus").is_file():
        return "no .tools/bin/prometheus (scripts/get-promtool.sh could not fetch Debian's prometheus)"
    return None


def _exports(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        words = shlex.split(line)
        if len(words) == 2 and words[0] == "export" and "=" in words[1]:
            key, value = words[1].split("=", 1)
            out[key] = value
    return out


def start_loop(tmp_path_factory: pytest.TempPathFactory, cidr: str) -> Iterator[Loop]:
    """`dev-cluster.sh up --engines` in a state dir of its own, pod IPs from `cidr`; `down` when closed. Skips,
    saying why, where the loop cannot run here."""
    kubectl = tool("kubectl")
    if kubectl is None:
        pytest.skip("no kubectl (scripts/get-helm.sh fetches one into .tools/bin)")
    why = _skip_reason()
    if why:
        pytest.skip(why)
    state = tmp_path_factory.mktemp("loop-cluster")
    env = {**os.environ, "SLUICE_DEV_CLUSTER_DIR": str(state), "KUBECTL": kubectl, "SLUICE_ENGINE_CIDR": cidr}
    script = ["bash", str(SCRIPTS / "dev-cluster.sh")]
    started = time.monotonic()
    up = subprocess.run([*script, "up", "--engines"], capture_output=True, text=True, env=env, timeout=600)
    try:
        if up.returncode != 0:
            pytest.fail(f"scripts/dev-cluster.sh up --engines failed:\n{tail(up.stderr, 40)}")
        print(f"\nup --engines: {time.monotonic() - started:.0f} s")
        exports = _exports(subprocess.run([*script, "env"], capture_output=True, text=True, env=env,
                                          check=True).stdout)
        assert {"KUBECONFIG", "SLUICE_GATEWAY_URL", "PROMETHEUS_URL"} <= set(exports), exports
        cluster = Cluster(kubeconfig=Path(exports["KUBECONFIG"]), state=state, kubectl_path=kubectl)
        yield Loop(cluster, exports, state, env)
    finally:
        subprocess.run([*script, "down"], env=env, capture_output=True, timeout=120)


@pytest.fixture(scope="module")
def loop(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[Loop]:
    yield from start_loop(tmp_path_factory, CIDR)


@pytest.fixture(scope="module")
def endpoint(loop: Loop) -> Loop:
    doc = copy.deepcopy(DOC)
    doc["spec"]["scaling"]["scaleDownDelaySeconds"] = COOLDOWN_S
    doc["spec"]["startupGraceSeconds"] = 10  # KEDA's initialCooldownPeriod: scale to zero soon after creation
    loop.cluster.apply(doc)
    return loop


def _stream(loop: Loop, content: str, max_tokens: int = 16, model: str = MODEL) -> tuple[float, str]:
    """(time to first token, the answer) through the gateway with the real openai client, streamed."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{loop.gateway}/v1", api_key="unused", timeout=300, max_retries=0)
    global LAST_REQUEST
    start, first, parts = time.monotonic(), None, []
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}],
                                            max_tokens=max_tokens, temperature=0, stream=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.monotonic()
            parts.append(chunk.choices[0].delta.content)
    assert first is not None, "no token came"
    LAST_REQUEST = time.monotonic()
    return first - start, "".join(parts)


def test_keda_makes_the_hpa_and_scales_to_zero(endpoint: Loop) -> None:
    c = endpoint.cluster
    hpa = wait_until("KEDA's HPA for the endpoint", lambda: c.get("hpa", NAME, "-n", NAMESPACE), 60)
    assert hpa["spec"]["maxReplicas"] == DOC["spec"]["scaling"]["maxReplicas"], hpa["spec"]
    so = wait_until("the ScaledObject Ready", lambda: next(
        (s for s in (c.json("get", "scaledobject", NAME, "-n", NAMESPACE).get("status") or {}).get("conditions", [])
         if s["type"] == "Ready" and s["status"] == "True"), None), 60)
    assert so["status"] == "True"
    started = time.monotonic()
    wait_until("the endpoint at zero replicas, its pods gone", lambda: endpoint.replicas() == 0 and not endpoint.pods(),
               10 + COOLDOWN_S + 90)
    print(f"\nscaled to zero {time.monotonic() - started:.0f} s after KEDA's Ready")
    phase = wait_until("phase Idle", lambda: (c.get("inferenceendpoint", NAME, "-n", NAMESPACE) or {})
                       .get("status", {}).get("phase") == "Idle", 60)
    assert phase


def test_the_first_request_is_held_and_answered_from_zero(endpoint: Loop) -> None:
    assert endpoint.replicas() == 0
    ttft, answer = _stream(endpoint, "Say hello in five words.")
    assert answer.strip(), answer
    assert endpoint.replicas() >= 1
    print(f"\ntime to first token from zero through the gateway: {ttft:.1f} s")
    # Warm now: the next one is as fast as the engine.
    ttft_warm, _ = _stream(endpoint, "And once more.")
    print(f"time to first token, warm: {ttft_warm * 1000:.0f} ms")
    assert ttft_warm < ttft


COUNTERS = ("sluice_prompt_tokens_total", "sluice_generation_tokens_total", "sluice_request_goodput_total")


def _engines(loop: Loop) -> list[dict[str, float]]:
    """Each running engine's own counters and cost gauges, from its /metrics."""
    out = []
    for pod in loop.pods():
        if not pod["status"].get("podIP") or pod["metadata"].get("deletionTimestamp"):
            continue
        text = httpx.get(f"http://{pod['status']['podIP']}:8000/metrics", timeout=10).text
        values: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith((*COUNTERS, "sluice_gpu_hour_usd", "sluice_num_gpus")):
                name = line.split("{", 1)[0].split(" ", 1)[0]
                values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        out.append(values)
    return out


def test_prometheus_scrapes_the_engine_and_records_cost(endpoint: Loop) -> None:
    sel = f'{{namespace="{NAMESPACE}",sluice_dev_endpoint="{NAME}"}}'

    def recorded(name: str, at: float | None = None) -> float | None:
        result = endpoint.query(f"sluice_endpoint:{name}{sel}", at)
        return float(result[0]["value"][1]) if result else None

    # Traffic until the recorded token rates move (a counter needs two scrapes of different values), then quiet.
    started, i = time.monotonic(), 0
    while not (recorded("prompt_tokens:rate5m") and recorded("generation_tokens:rate5m")):
        assert time.monotonic() - started < 90, "the recorded token rates stayed 0 or absent"
        _stream(endpoint, f"Count to {i % 7 + 3}.", max_tokens=24)
        i += 1
    engines = _engines(endpoint)
    engine = {name: sum(e[name] for e in engines) for name in COUNTERS}
    assert engine["sluice_prompt_tokens_total"] > 0 and engine["sluice_generation_tokens_total"] > 0, engine
    # What the engines cost by their own gauges: each replica its GPUs (a CPU one: one unit) at its price.
    usd_s = sum(max(e["sluice_num_gpus"], 1) * e["sluice_gpu_hour_usd"] for e in engines) / 3600
    assert usd_s > 0, engines
    def scraped() -> dict[str, float] | None:
        got = {name: sum(float(r["value"][1]) for r in endpoint.query(f"{name}{sel}")) for name in engine}
        return got if all(abs(got[n] - engine[n]) <= 1e-9 for n in engine) else None

    # The counters Prometheus holds are the engine's own, once a scrape has come after the last request.
    seen = wait_until("Prometheus to hold the engine's counters", scraped, 60, interval=1)
    assert seen == pytest.approx(engine)
    ups = endpoint.query(f'up{{namespace="{NAMESPACE}",sluice_dev_endpoint="{NAME}"}}')
    assert ups and all(r["value"][1] == "1" for r in ups), ups

    rules = httpx.get(f"{endpoint.prometheus}/api/v1/rules", timeout=10).json()["data"]["groups"]
    group = next(g for g in rules if g["name"] == f"sluice.endpoint.{NAMESPACE}.{NAME}")
    assert all(r["health"] == "ok" for r in group["rules"]), [(r["name"], r.get("lastError")) for r in group["rules"]]

    cost_s = wait_until("the cost per second recorded", lambda: recorded("gpu_cost_usd_per_second:sum"), 60)
    assert cost_s == pytest.approx(usd_s, rel=0.05), (
        engines, endpoint.query(f"sluice_gpu_hour_usd{sel}"), endpoint.query(f"sluice_num_gpus{sel}"),
        [(g["file"], g["name"], r["query"]) for g in rules for r in g["rules"]
         if r["name"] == "sluice_endpoint:gpu_cost_usd_per_second:sum"])
    # One evaluation's values (the rules of a group are evaluated together, with one timestamp).
    at = time.time()
    per_1m = recorded("cost_usd_per_1m_tokens:rate5m", at)
    rates = [recorded("prompt_tokens:rate5m", at), recorded("generation_tokens:rate5m", at)]
    assert all(rates), rates
    expected = usd_s / (sum(r for r in rates if r)) * 1e6
    assert per_1m == pytest.approx(expected, rel=0.05), (per_1m, expected)
    print(f"\ncost per 1M tokens (Prometheus, rate5m): {per_1m:.4f} USD with {len(engines)} replica(s) at "
          f"{PRICE_USD_H} USD per replica-hour")


def _alert(loop: Loop, name: str) -> str | None:
    """The alert's state for this endpoint (pending, firing), or None."""
    alerts = httpx.get(f"{loop.prometheus}/api/v1/alerts", timeout=10).json()["data"]["alerts"]
    for a in alerts:
        if a["labels"].get("alertname") == name and a["labels"].get("sluice_dev_endpoint") == NAME:
            return str(a["state"])
    return None


def _streams(loop: Loop) -> float:
    text = httpx.get(f"{loop.gateway}/metrics", timeout=10).text
    line = next(x for x in text.splitlines() if x.startswith(f'sluice_gateway_scaler_streams{{endpoint="{MODEL}"}}'))
    return float(line.rsplit(" ", 1)[1])


def test_keda_killed_the_endpoint_serves_the_alert_fires_and_scaling_resumes(endpoint: Loop) -> None:
    _stream(endpoint, "Wake up.")  # at least one replica, whatever the cooldown did since the last test
    pid = int((endpoint.state / "pids" / "keda-operator").read_text())
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:-1]
    environ = dict(e.split(b"=", 1) for e in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in e)
    os.kill(pid, signal.SIGKILL)
    started = time.monotonic()
    wait_until("the gateway to see KEDA's stream end", lambda: _streams(endpoint) == 0, 30)
    # What is up keeps serving (KEDA scales; it is not on the request path), and nothing scales it in meanwhile.
    state = None
    while time.monotonic() - started < 150 and state != "firing":
        _, answer = _stream(endpoint, "Still there?", max_tokens=4)
        assert answer
        state = _alert(endpoint, "SluiceAutoscalerNotWatching")
        time.sleep(3)
    assert state == "firing", state
    assert endpoint.replicas() == 1
    print(f"\nSluiceAutoscalerNotWatching firing {time.monotonic() - started:.0f} s after KEDA's operator was killed")
    # KEDA comes back: it subscribes again, the alert resolves, and (next test) it scales the endpoint to zero.
    with open(endpoint.state / "logs" / "keda-operator.log", "ab") as log:
        proc = subprocess.Popen(argv, env={k.decode(): v.decode() for k, v in environ.items()}, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    (endpoint.state / "pids" / "keda-operator").write_text(str(proc.pid))
    wait_until("KEDA to subscribe again", lambda: _streams(endpoint) >= 1, 60)
    wait_until("the alert to resolve", lambda: _alert(endpoint, "SluiceAutoscalerNotWatching") is None, 60)


def test_back_to_zero_after_the_cooldown(endpoint: Loop) -> None:
    wait_until("the endpoint back at zero", lambda: endpoint.replicas() == 0 and not endpoint.pods(),
               COOLDOWN_S + 120)
    print(f"\nat zero, {time.monotonic() - LAST_REQUEST:.0f} s after the last request (cooldown {COOLDOWN_S} s, "
          "KEDA polls every 15 s)")
