"""Pods that serve (issue 40): scripts/pod_runner.py runs, for real, the engine pods kwok schedules onto the dev
cluster's simulated nodes, and sets their readiness from the engine's own (marker `cluster`).

This module starts its own cluster (its own state dir, kwok giving pods addresses from a /24 of 198.19.0.0/16 and
the Stage file scripts/kwok-engine-stages.yaml, under which kwok leaves engine pods not Ready) and applies what
`sluice render` makes of examples/cpu-smollm2.yaml, with an API key from a Secret (no operator runs: the objects
are applied as rendered, owned by the stored InferenceEndpoint). Then, in file order: the pod is Ready only once
its engine answers; the real `openai` client gets a chat completion from http://<podIP>:8000/v1 with the key; the
Service's EndpointSlice lists the pod, ready; deleting the pod stops its engine and the Deployment's replacement
is served in turn; with --max-engines 1 a second replica waits, not Ready, saying why. The first test needs no
cluster: what the runner makes of every example's rendered pod.

The runner makes pod IPs this machine's with local routes (`ip route add local <ip>/32 dev lo`): it needs root
or CAP_NET_ADMIN, and the cluster tests skip, saying so, without."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest
import yaml
from dev_cluster import ROOT, SCRIPTS, Cluster, wait_until
from engine_pods import Runner, apply_endpoint, engines_cluster, is_ready, pod_cidr, render, why_not
from engine_pods import endpoint_pods as _endpoint_pods
from operator_schemas import EXAMPLES
from servers import SERVED_NAME, process_gone

NAMESPACE, NAME = "default", "smollm2"
API_KEY = "sk-pod-runner-test"
CIDR = pod_cidr()


def load_runner() -> ModuleType:
    spec = importlib.util.spec_from_file_location("pod_runner", SCRIPTS / "pod_runner.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


runner = load_runner()


def pod_templates(items: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    for obj in items:
        spec = obj.get("spec") or {}
        if "template" in spec and obj["kind"] in ("Deployment", "StatefulSet"):
            yield obj["metadata"]["name"], spec["template"]
        for role in ("leaderTemplate", "workerTemplate"):
            if role in spec.get("leaderWorkerTemplate", {}):
                yield f"{obj['metadata']['name']}/{role}", spec["leaderWorkerTemplate"][role]


class Objects(runner.Source):
    """The rendered ConfigMaps; a Secret render does not make (the KV key, created by the operator's loop) has a
    stand-in value."""

    def __init__(self, items: list[dict[str, Any]]):
        self.items = items

    async def data(self, kind: str, namespace: str, name: str) -> dict[str, bytes] | None:
        obj = next((o for o in self.items if o["kind"].lower() == kind.lower() and o["metadata"]["name"] == name),
                   None)
        if obj is None:
            return {"kv-secret": b"0" * 64} if kind == "secret" else None
        return {k: v.encode() for k, v in (obj.get("data") or {}).items()}


def test_what_the_runner_makes_of_each_examples_pods(tmp_path: Path) -> None:
    """Every example's engine pods are the runner's; single-pod ones run (CUDA ones on the CPU, without LoRA),
    multi-node groups are simulated; --host is the pod IP, --model dropped, mounted paths local."""
    seen = {}
    for example in EXAMPLES:
        items = render(example)
        for name, template in pod_templates(items):
            pod = {"metadata": {**template["metadata"], "namespace": "default", "name": "p", "uid": "u"},
                   "spec": template["spec"], "status": {"podIP": "198.18.0.9"}}
            if template["metadata"]["labels"].get("app.kubernetes.io/component") == "endpoint-picker":
                assert not runner.is_engine_pod(pod), name  # spec.routing's picker: kwok's to simulate
                continue
            assert runner.is_engine_pod(pod), name
            reason = runner.not_run_reason(pod)
            container = runner.engine_container(pod)
            root = tmp_path / name.replace("/", "_")
            mounts = asyncio.run(runner.materialise_volumes(Objects(items), pod, container, root))
            args, changed = runner.engine_args(container["args"], "198.18.0.9", mounts, None)
            seen[name] = (reason, args, changed)
            assert "--model" not in args and args[args.index("--host") + 1] == "198.18.0.9", (name, args)
            assert args[args.index("--device") + 1] == "cpu", (name, args)
            objectives = args[args.index("--objectives-file") + 1]
            assert objectives.startswith(str(root)) and json.loads(Path(objectives).read_text()), (name, objectives)
            assert runner.readiness_url(pod, container, "198.18.0.9").startswith("http://198.18.0.9:8000/")
    assert seen["smollm2"][0] is None and seen["smollm2"][2] == [
        "dropped --model /models-cache/hub/HuggingFaceTB/SmolLM2-135M-Instruct/main (the bundled SmolLM2-135M-Instruct)"]
    assert "--nnodes 2" in seen["llama-70b/leaderTemplate"][0] and "--nnodes 2" in seen["smollm2-pp2/workerTemplate"][0]
    _, args, changed = seen["llama-8b-lora"]
    assert args[args.index("--dtype") + 1] == "float32" and "--enable-lora" not in args, args
    assert {"--device cuda -> cpu", "dropped --enable-lora", "dropped --max-loras 4"} <= set(changed), changed
    assert "--gpu-memory-utilization" not in seen["llama-8b"][1]
    # The disaggregated decode pool's $(POD_IP) is the kubelet's business: expanded from the env before this step.
    assert runner.expand("--kv-host=$(POD_IP) $$(POD_IP) $(NOPE)", {"POD_IP": "198.18.0.9"}) == \
        "--kv-host=198.18.0.9 $(POD_IP) $(NOPE)"


# --- against a cluster of its own -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    why = why_not(CIDR)
    if why is not None:
        pytest.skip(why)
    with engines_cluster(tmp_path_factory.mktemp("engines-cluster"), CIDR) as c:
        yield c


@pytest.fixture(scope="module")
def runner_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("pod-runner-logs")


@pytest.fixture(scope="module")
def endpoint(engines: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Cluster:
    """examples/cpu-smollm2.yaml with SLUICE_API_KEY from a Secret, stored, and its rendered objects applied."""
    c = engines
    c.kubectl("create", "secret", "generic", f"{NAME}-api-key", f"--from-literal=key={API_KEY}", "-n", NAMESPACE)
    ep = yaml.safe_load((ROOT / "examples" / "cpu-smollm2.yaml").read_text())
    ep["spec"]["pod"]["env"] = [{"name": "SLUICE_API_KEY",
                                 "valueFrom": {"secretKeyRef": {"name": f"{NAME}-api-key", "key": "key"}}}]
    apply_endpoint(c, ep, tmp_path_factory.mktemp("endpoint"))
    return c


def pods(c: Cluster) -> list[dict[str, Any]]:
    return _endpoint_pods(c, NAMESPACE, NAME)


def answers(ip: str) -> bool:
    try:
        return httpx.get(f"http://{ip}:8000/ready", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def engine_pid(ip: str) -> int | None:
    """The `sluice serve` bound to this pod IP, from /proc."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"sluice_engine.entrypoints.cli" in cmdline and b"serve" in cmdline and \
                    ip.encode() in cmdline and cmdline[cmdline.index(b"--host") + 1] == ip.encode():
                return int(entry.name)
    return None


def chat(ip: str, key: str = API_KEY) -> str:
    import openai

    client = openai.OpenAI(base_url=f"http://{ip}:8000/v1", api_key=key, timeout=60, max_retries=0)
    reply = client.chat.completions.create(model=SERVED_NAME, max_tokens=8,
                                           messages=[{"role": "user", "content": "Say hello."}])
    return reply.choices[0].message.content or ""


def wait_served(c: Cluster, runner_proc: Runner, timeout: float = 120) -> dict[str, Any]:
    """Poll until the endpoint's one pod is Ready, checking all along that it is never Ready before its engine
    answers; return the pod."""
    seen_not_ready_with_ip = False
    deadline = time.monotonic() + timeout
    while True:
        current = pods(c)
        pod = current[0] if len(current) == 1 else None
        ip = (pod or {}).get("status", {}).get("podIP")
        if pod is not None and ip:
            if is_ready(pod):
                assert answers(ip), f"pod {pod['metadata']['name']} Ready before its engine on {ip} answers"
                assert seen_not_ready_with_ip, "the pod was Ready the first time it was seen: kwok's doing?"
                return pod
            seen_not_ready_with_ip = True
        assert time.monotonic() < deadline, f"no Ready pod after {timeout:.0f} s: {current}\n{runner_proc.log()}"
        assert runner_proc.proc.poll() is None, f"the runner exited:\n{runner_proc.log()}"
        time.sleep(0.3)


@pytest.fixture(scope="module")
def pod_runner(endpoint: Cluster, runner_logs: Path) -> Iterator[Runner]:
    proc = Runner(endpoint, runner_logs)
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def served(endpoint: Cluster, pod_runner: Runner) -> dict[str, Any]:
    return wait_served(endpoint, pod_runner)


@pytest.mark.cluster
def test_the_pod_is_ready_once_its_engine_answers(served: dict[str, Any], runner_logs: Path) -> None:
    ip = served["status"]["podIP"]
    assert ip.startswith(CIDR.rsplit(".", 1)[0] + "."), ip
    engine = next(s for s in served["status"]["containerStatuses"] if s["name"] == "engine")
    assert engine["ready"] and "running" in engine["state"] and engine["restartCount"] == 0, engine
    log = (runner_logs / f"{NAMESPACE}_{served['metadata']['name']}.log").read_text()
    assert f"--host {ip} --port 8000" in log and "dropped --model" in log, log[:2000]


@pytest.mark.cluster
def test_the_openai_client_is_served_with_the_secrets_api_key(served: dict[str, Any]) -> None:
    import openai

    ip = served["status"]["podIP"]
    assert chat(ip).strip()
    with pytest.raises(openai.AuthenticationError):
        chat(ip, key="not-the-key")


@pytest.mark.cluster
def test_the_services_endpointslice_lists_the_pod_ready(endpoint: Cluster, served: dict[str, Any]) -> None:
    def ready_addresses() -> list[str]:
        slices = endpoint.json("get", "endpointslices", "-n", NAMESPACE, "-l", f"kubernetes.io/service-name={NAME}")
        return [a for s in slices["items"] for e in s.get("endpoints") or []
                if (e.get("conditions") or {}).get("ready") for a in e["addresses"]]
    assert wait_until("the pod in the Service's EndpointSlice", ready_addresses, 30) == [served["status"]["podIP"]]


@pytest.mark.cluster
def test_deleting_the_pod_stops_its_engine_and_the_replacement_is_served(
        endpoint: Cluster, served: dict[str, Any], pod_runner: Runner) -> None:
    ip, name = served["status"]["podIP"], served["metadata"]["name"]
    pid = engine_pid(ip)
    assert pid is not None, f"no sluice serve bound to {ip}"
    endpoint.kubectl("delete", "pod", name, "-n", NAMESPACE, "--wait=false")
    assert process_gone(pid, 60), f"engine {pid} of the deleted pod {name} still runs:\n{pod_runner.log()}"
    replacement = wait_served(endpoint, pod_runner)
    assert replacement["metadata"]["name"] != name
    new_ip = replacement["status"]["podIP"]
    assert engine_pid(new_ip) not in (None, pid)
    if new_ip != ip:  # kwok hands a freed IP to the next pod, usually this one
        assert not answers(ip)
    assert chat(new_ip).strip()


@pytest.mark.cluster
def test_pods_beyond_max_engines_wait_not_ready(endpoint: Cluster, pod_runner: Runner, runner_logs: Path) -> None:
    pod_runner.stop()  # the module's runner, started again with one slot: the running pod keeps it
    one_slot = Runner(endpoint, runner_logs, "--max-engines", "1")
    try:
        wait_served(endpoint, one_slot)
        endpoint.kubectl("scale", "deployment", NAME, "-n", NAMESPACE, "--replicas=2")

        def waiting() -> dict[str, Any] | None:
            for pod in pods(endpoint):
                ready = next((c for c in pod.get("status", {}).get("conditions", []) if c["type"] == "Ready"), {})
                if ready.get("reason") == "WaitingForEngineSlot":
                    return ready
            return None
        ready = wait_until("the second replica to wait for an engine slot", waiting, 60)
        assert ready["status"] == "False" and "--max-engines" in ready["message"], ready
        assert sum(is_ready(p) for p in pods(endpoint)) == 1
    finally:
        one_slot.stop()
    ips = [p["status"]["podIP"] for p in pods(endpoint)]
    assert all(engine_pid(ip) is None for ip in ips), "the runner left engines behind"
    assert not any(runner.is_local_address(ip) for ip in ips), "the runner left its local routes behind"
