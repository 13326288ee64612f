"""Faults on the whole loop (marker `cluster`): `scripts/dev-cluster.sh up --engines` on a cluster of its own, as in
test_cluster_loop.py (whose helpers this module imports; its skip conditions apply), with engine pods run by
scripts/pod_runner.py as real `sluice serve` processes (at most two at once, so one endpoint at a time).

1. A warm pool answers the first request at zero: an endpoint like examples/cpu-scale-to-zero.yaml with
   scaling.warmPool {replicas: 1} gets a `<name>-warm` Deployment whose pod carries role standby. With the serving
   Deployment at zero (KEDA) and the standby Ready, the first request through the gateway (the real `openai`
   client, streamed) is answered by the standby at once (sluice_gateway_standby_requests_total goes up), and KEDA
   still scales the serving Deployment 0 -> 1 on that demand; the serving pod's own cold start is printed next to
   the time to first token.
2. An engine killed: an endpoint held at two replicas (minReplicas = maxReplicas = 2). One engine process is
   SIGKILLed while requests go through the gateway: every request is answered (the gateway retries on the other
   replica). Then what the kubelet would do: the container restarts in place (the runner's back-off, restartCount
   1) and the pod is Ready again; and when the pod is deleted (an eviction, a drain, a person), the Deployment
   replaces it with a new pod that the runner serves and that becomes Ready.
"""

from __future__ import annotations

import copy
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from dev_cluster import wait_until
from test_cluster_loop import DOC, NAMESPACE, Loop, _stream, start_loop

from sluice_contract import ENDPOINT_LABEL, ROLE_LABEL, SERVING, STANDBY

pytestmark = pytest.mark.cluster

CIDR = f"198.19.{(os.getpid() + 60) % 250}.0/24"  # apart from test_cluster_loop's and the dev cluster's
COOLDOWN_S = 15


@pytest.fixture(scope="module")
def loop(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[Loop]:
    yield from start_loop(tmp_path_factory, CIDR)


def _apply(loop: Loop, name: str, scaling: dict[str, Any], grace_s: int = 60) -> str:
    """A copy of the example named `name` (served as `name`), its scaling updated; the gateway's model name."""
    doc = copy.deepcopy(DOC)
    doc["metadata"]["name"] = name
    doc["spec"]["model"]["servedName"] = name
    doc["spec"]["scaling"].update(scaling)
    doc["spec"]["startupGraceSeconds"] = grace_s
    loop.cluster.apply(doc)
    return f"{NAMESPACE}/{name}"


def _pods(loop: Loop, name: str, role: str | None = None) -> list[dict[str, Any]]:
    sel = f"{ENDPOINT_LABEL}={name}" + (f",{ROLE_LABEL}={role}" if role else "")
    return loop.cluster.json("get", "pods", "-n", NAMESPACE, "-l", sel)["items"]


def _ready(pod: dict[str, Any]) -> bool:
    return not pod["metadata"].get("deletionTimestamp") and any(
        c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions") or [])


def _replicas(loop: Loop, name: str) -> int | None:
    deploy = loop.cluster.get("deployment", name, "-n", NAMESPACE)
    return None if deploy is None else deploy["spec"].get("replicas")


def _scaling_state(loop: Loop, name: str) -> str:
    """What a failed scaling wait saw, for its message: the serving Deployment's replicas, each pod of the endpoint
    (role, phase, Ready, being deleted), the ScaledObject's conditions, and the tails of the loop's logs (operator,
    gateway, KEDA, pod runner, Prometheus). A scale-to-zero wait once timed out in a full CI run (145 s; ~24 s
    alone) with nothing else to go on."""
    pods = [(p["metadata"]["labels"].get(ROLE_LABEL), p["status"].get("phase"), _ready(p),
             bool(p["metadata"].get("deletionTimestamp"))) for p in _pods(loop, name)]
    scaled = loop.cluster.json("get", "scaledobjects.keda.sh", "-n", NAMESPACE)["items"]
    conditions = {o["metadata"]["name"]: [(c["type"], c["status"], c.get("reason"), c.get("message"))
                                          for c in o.get("status", {}).get("conditions") or []] for o in scaled}
    return (f"\nserving replicas: {_replicas(loop, name)}\npods (role, phase, ready, deleting): {pods}\n"
            f"ScaledObjects: {conditions}\n{loop.logs()}")


def _metric(loop: Loop, name: str, **labels: str) -> float:
    """The sum of the gateway's samples of `name` that carry `labels`."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    total = 0.0
    for line in httpx.get(f"{loop.gateway}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") and all(w in line.split("}", 1)[0] for w in want):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _delete(loop: Loop, name: str) -> None:
    """Delete the endpoint and wait until its pods are gone (their engines stopped: only two may run)."""
    loop.cluster.kubectl("delete", "inferenceendpoint", name, "-n", NAMESPACE, "--wait=false", check=False)
    wait_until(f"{name}'s pods gone", lambda: not _pods(loop, name), 90, interval=1)


def _age_s(pod: dict[str, Any], condition: str = "Ready") -> float:
    """Seconds from the pod's creation to its condition's last transition (the cold start, for Ready)."""
    from datetime import datetime

    def ts(text: str) -> float:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()

    cond = next(c for c in pod["status"]["conditions"] if c["type"] == condition)
    return ts(cond["lastTransitionTime"]) - ts(pod["metadata"]["creationTimestamp"])


def test_the_warm_pool_answers_the_first_request_and_keda_still_scales_up(loop: Loop) -> None:
    name = "smollm2-pool"
    model = _apply(loop, name, {"warmPool": {"replicas": 1}, "scaleDownDelaySeconds": COOLDOWN_S}, grace_s=10)
    try:
        c = loop.cluster
        warm = wait_until("the warm pool's Deployment", lambda: c.get("deployment", f"{name}-warm", "-n", NAMESPACE),
                          60)
        assert warm["spec"]["replicas"] == 1, warm["spec"]
        started = time.monotonic()
        try:
            wait_until("the serving Deployment at zero, its pods gone, the standby Ready", lambda: (
                _replicas(loop, name) == 0 and not _pods(loop, name, SERVING)
                and [p for p in _pods(loop, name, STANDBY) if _ready(p)]), 10 + COOLDOWN_S + 120, interval=1)
        except AssertionError as e:
            raise AssertionError(f"{e}{_scaling_state(loop, name)}") from None
        print(f"\nserving at zero, standby Ready: {time.monotonic() - started:.0f} s after the warm Deployment")
        wait_until("the gateway to see the standby ready", lambda: _metric(
            loop, "sluice_gateway_backends", endpoint=model, role=STANDBY, state="ready") >= 1, 30)
        assert _metric(loop, "sluice_gateway_backends", endpoint=model, role=SERVING, state="ready") == 0

        before = _metric(loop, "sluice_gateway_standby_requests_total", endpoint=model)
        asked = time.monotonic()
        ttft, answer = _stream(loop, "Say hello in five words.", max_tokens=24, model=model)
        assert answer.strip(), answer
        after = _metric(loop, "sluice_gateway_standby_requests_total", endpoint=model)
        assert after == before + 1, (before, after)
        print(f"time to first token at zero serving replicas, from the warm pool: {ttft * 1000:.0f} ms")
        assert ttft < 3, ttft

        # The request was demand: KEDA scales the serving Deployment 0 -> 1 and its pod comes up (cold).
        wait_until("KEDA to scale the serving Deployment 0 -> 1", lambda: (_replicas(loop, name) or 0) >= 1, 60)
        print(f"serving Deployment at 1 {time.monotonic() - asked:.1f} s after the request")
        pod = wait_until("the serving pod Ready", lambda: next(
            (p for p in _pods(loop, name, SERVING) if _ready(p)), None), 120)
        cold = _age_s(pod)
        print(f"the serving replica's cold start (pod created -> Ready): {cold:.1f} s; the standby answered in "
              f"{ttft:.2f} s")
        assert ttft < cold
    finally:
        _delete(loop, name)


def _engine_pid(pod: dict[str, Any]) -> int:
    """The runner's engine process for the pod (its containerID is pod-runner://<pid>)."""
    cid = pod["status"]["containerStatuses"][0]["containerID"]
    assert cid.startswith("pod-runner://"), cid
    pid = int(cid.removeprefix("pod-runner://"))
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    assert b"serve" in cmdline, cmdline
    return pid


def _running(pod: dict[str, Any]) -> float:
    """The engine's own sluice_num_requests_running."""
    text = httpx.get(f"http://{pod['status']['podIP']}:8000/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("sluice_num_requests_running"))


def test_an_engine_killed_is_retried_around_restarted_and_replaced(loop: Loop) -> None:
    name = "smollm2-pair"
    model = _apply(loop, name, {"minReplicas": 2, "maxReplicas": 2, "scaleDownDelaySeconds": COOLDOWN_S})
    try:
        started = time.monotonic()
        pods = wait_until("two serving pods Ready", lambda: (lambda ps: ps if len(ps) == 2 else None)(
            [p for p in _pods(loop, name, SERVING) if _ready(p)]), 180, interval=1)
        wait_until("the gateway to see both ready", lambda: _metric(
            loop, "sluice_gateway_backends", endpoint=model, role=SERVING, state="ready") == 2, 30)
        print(f"\ntwo replicas Ready {time.monotonic() - started:.0f} s after apply")
        from openai import OpenAI

        client = OpenAI(base_url=f"{loop.gateway}/v1", api_key="unused", timeout=120, max_retries=0)
        retries0 = _metric(loop, "sluice_gateway_retries_total", endpoint=model)
        ok0 = _metric(loop, "sluice_gateway_requests_total", endpoint=model, outcome="ok")
        stop, answered, failed = threading.Event(), [], []

        def worker(i: int) -> None:
            n = 0
            while not stop.is_set():
                n += 1
                try:  # not streamed: the gateway may retry it whole even mid-generation (docs/gateway.md)
                    r = client.chat.completions.create(
                        model=model, max_tokens=48, temperature=0,
                        messages=[{"role": "user", "content": f"Worker {i}, request {n}: count to {n % 7 + 3}."}])
                    answered.append(r.choices[0].message.content)
                except Exception as e:  # noqa: BLE001  (every failure is the finding)
                    failed.append(f"{type(e).__name__}: {e}")

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        # The victim: the engine with a request in its running batch (the router's prefix hashing may send all of
        # them to one replica), so that a request is in flight on it when it dies.
        victim = wait_until("a request running on an engine", lambda: next(
            (p for p in pods if _running(p) > 0), None), 20, interval=0.05)
        survivor = next(p for p in pods if p is not victim)
        pid = _engine_pid(victim)
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        time.sleep(8)
        stop.set()
        for t in threads:
            t.join(120)
        retries = _metric(loop, "sluice_gateway_retries_total", endpoint=model) - retries0
        ok = _metric(loop, "sluice_gateway_requests_total", endpoint=model, outcome="ok") - ok0
        print(f"engine pid {pid} of {victim['metadata']['name']} SIGKILLed: {len(answered)} requests answered, "
              f"{len(failed)} failed, gateway retries {retries:.0f}, outcome ok {ok:.0f}")
        assert not failed, failed
        assert retries >= 1, "the request running on the killed engine was not retried"
        assert len(answered) >= 4 and ok == len(answered), (len(answered), ok)

        # The kubelet restarts a crashed container in place (restartPolicy Always, with back-off): the runner too.
        uid = victim["metadata"]["uid"]

        def restarted() -> dict[str, Any] | None:
            pod = loop.cluster.get("pod", victim["metadata"]["name"], "-n", NAMESPACE)
            if pod and pod["metadata"]["uid"] == uid and _ready(pod) and \
                    pod["status"]["containerStatuses"][0].get("restartCount", 0) >= 1:
                return pod
            return None

        back = wait_until("the killed engine restarted in place, its pod Ready again", restarted, 90, interval=1)
        status = back["status"]["containerStatuses"][0]
        print(f"restarted in place (restartCount {status['restartCount']}, last exit "
              f"{status.get('lastState', {}).get('terminated', {}).get('exitCode')}), Ready "
              f"{time.monotonic() - killed:.0f} s after the kill")
        assert _engine_pid(back) != pid

        # The pod deleted (as an eviction or a drain would): the Deployment replaces it, the runner serves it.
        deleted = time.monotonic()
        loop.cluster.kubectl("delete", "pod", victim["metadata"]["name"], "-n", NAMESPACE, "--wait=false")
        fresh = wait_until("a replacement pod Ready beside the other", lambda: (lambda ps: ps if len(ps) == 2 and all(
            p["metadata"]["uid"] != uid for p in ps) else None)(
            [p for p in _pods(loop, name, SERVING) if _ready(p)]), 120, interval=1)
        new = next(p for p in fresh if p["metadata"]["name"] != survivor["metadata"]["name"])
        print(f"{new['metadata']['name']} replaced the deleted pod, Ready {time.monotonic() - deleted:.0f} s after "
              "the delete")
        _engine_pid(new)
        _, answer = _stream(loop, "Still there?", max_tokens=4, model=model)
        assert answer
    finally:
        _delete(loop, name)
