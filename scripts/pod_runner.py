#!/usr/bin/env python3
"""Runs, for real on this machine, the Sluice engine pods that kwok schedules onto the dev cluster's simulated
nodes (issue 40, "Pods that serve"); every other pod stays as kwok simulates it.

    .venv/bin/python scripts/pod_runner.py --kubeconfig "$STATE/admin.kubeconfig" --log-dir "$STATE/logs/pods"

The cluster must leave the engine pods' readiness to this runner, and should give pods addresses of their own:
`SLUICE_KWOK_CIDR=198.18.0.0/16 SLUICE_KWOK_STAGES=scripts/kwok-engine-stages.yaml scripts/dev-cluster.sh up`
The Stage file marks engine pods Running but not Ready; this runner decides. Each engine binds its pod's IP and
the port its container declares, so pods on one port do not collide. A pod IP that is not yet an address of this
machine is made one with a local route, `ip route add local <ip>/32 dev lo` (root or CAP_NET_ADMIN; removed when
the runner exits): the address is then this machine's, as every 127.x address is. Not 127.x pod IPs: the
apiserver refuses loopback addresses in EndpointSlices, so Services would have no endpoints. 198.18.0.0/15 is
the range set aside for network tests (RFC 2544), no one's real network.

A pod is the runner's when it is bound to a kwok node (annotation kwok.x-k8s.io/node=fake), carries the
operator's endpoint label (sluice.dev/endpoint) and has a container named `engine` whose command is
`sluice serve` (what the operator renders). For each, once kwok has given it a pod IP, it starts
`python -m sluice_engine.entrypoints.cli serve ARGS` with the venv's Python and the container's args, where:
  - `$(VAR)` references are expanded from the container's env, as the kubelet does;
  - --host becomes the pod IP;
  - --model becomes the local model (--model here; by default the flag is dropped, so the engine serves the
    bundled SmolLM2-135M-Instruct from this machine's cache, whatever the pod names; --served-model-name is
    kept, so clients ask for the name the endpoint gives it);
  - paths under the container's volume mounts become per-pod directories: ConfigMap and Secret volumes (and
    their projected sources) are written there from the API, emptyDirs are empty directories, anything else
    (PVCs, hostPaths) an empty directory too;
  - a CUDA pod (--device cuda or auto) runs on the CPU: --device cpu, --dtype float32, and
    --gpu-memory-utilization, --tensor-parallel-size, --pipeline-parallel-size and the CUDA-only
    --quantization fp8|awq|gptq are dropped;
  - LoRA flags (--enable-lora, --max-loras, --max-lora-rank, --lora-modules-file) are dropped: the adapters are
    fetched by an init container and a sidecar, which are not run.
Environment: literal values, secretKeyRef/configMapKeyRef (read from the API), fieldRef (name, namespace, uid,
labels, annotations, node, service account, pod and host IPs) and envFrom; the cache variables (HOME,
XDG_CACHE_HOME, SLUICE_CACHE_DIR, HF_HOME, TRITON_CACHE_DIR) stay this machine's, so the engine finds the
model and its compiled kernels where they already are. The rest of the environment is the runner's.

Status, written to the pod's status subresource: Ready and ContainersReady follow the container's
readinessProbe (httpGet, polled every --probe-interval seconds; a 2xx or 3xx is ready, as for the kubelet; no
probe: ready while the process runs). A process that exits is counted in restartCount with its exit code in
lastState and started again after the kubelet's back-off (10 s doubling to 300 s, CrashLoopBackOff), or, with
restartPolicy Never (or OnFailure and exit 0), leaves the pod Failed (Succeeded). At most --max-engines
engines run at once; the pods beyond wait, not Ready, saying so. When a pod is deleted (kwok's pod-delete stage
removes it as soon as it has a deletionTimestamp) its engine gets SIGTERM, and SIGKILL (its whole process
group) after the pod's terminationGracePeriodSeconds. kwok recycles pod IPs: a new engine waits until the
one stopping on the same address has gone. Engine output goes to <log-dir>/<namespace>_<pod>.log.

Simulated, not run: init containers and sidecars (the model fetch among them: the model is the local one),
other containers of the pod (reported ready), resources and limits, security contexts, the startup and
liveness probes, preStop hooks, image pulls, cluster DNS (a Service name in an arg, e.g. --prefill-url, does
not resolve here) and Service virtual IPs (clients use pod IPs). Multi-node groups (--nnodes above 1, the
LeaderWorkerSet examples) are not run: their pods are marked Ready as kwok would, with reason Simulated.
When the runner stops (SIGINT/SIGTERM) it stops its engines, marks their pods not Ready and removes the routes
it added (after a SIGKILL, `ip route show table local` lists what is left: `ip route del local <ip>/32 dev lo`).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import errno
import ipaddress
import json
import logging
import os
import re
import shutil
import signal
import socket
import ssl
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import yaml

from sluice_contract import ENDPOINT_LABEL

log = logging.getLogger("pod_runner")

ENGINE_CONTAINER = "engine"  # sluice_operator.pod_customization.ENGINE_CONTAINER
ENGINE_COMMAND = ["sluice", "serve"]
KWOK_NODE_ANNOTATION = ("kwok.x-k8s.io/node", "fake")
# The pod's values for these would point into its volumes (the model cache): this machine's are kept instead.
MACHINE_ENV = ("HOME", "XDG_CACHE_HOME", "SLUICE_CACHE_DIR", "HF_HOME", "TRITON_CACHE_DIR")
BACKOFF_S, BACKOFF_MAX_S = 10.0, 300.0  # the kubelet's restart back-off
SIMULATED = "Simulated"

Pod = dict[str, Any]
T = TypeVar("T")


# --- the pod's engine as a local command (pure, apart from reading Secrets and ConfigMaps) -------------------

def is_engine_pod(pod: Pod) -> bool:
    """The operator's engine pods: its endpoint label and an `engine` container running `sluice serve`. The Stage
    file (scripts/kwok-engine-stages.yaml) selects the same pods."""
    if ENDPOINT_LABEL not in (pod["metadata"].get("labels") or {}):
        return False
    return engine_container(pod) is not None


def engine_container(pod: Pod) -> dict[str, Any] | None:
    return next((c for c in pod["spec"].get("containers") or []
                 if c.get("name") == ENGINE_CONTAINER and c.get("command") == ENGINE_COMMAND), None)


_VAR_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(text: str, env: dict[str, str]) -> str:
    """The kubelet's $(VAR) expansion: defined names are replaced, undefined ones kept, $$ escapes a $."""
    def one(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))
    return _VAR_REF.sub(one, text)


def _flag_value(args: list[str], flag: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def not_run_reason(pod: Pod) -> str | None:
    """Why this engine pod is simulated rather than run, or None."""
    args = (engine_container(pod) or {}).get("args") or []
    nnodes = _flag_value(args, "--nnodes")
    if nnodes is not None and nnodes.isdigit() and int(nnodes) > 1:
        return (f"a {nnodes}-node group (--nnodes {nnodes}): its ranks need the group's other pods and cluster "
                "DNS; scripts/pod_runner.py runs single-pod engines only")
    return None


_DROPPED_LORA = {"--enable-lora": 0, "--max-loras": 1, "--max-lora-rank": 1, "--lora-modules-file": 1}
_DROPPED_ON_CPU = {"--gpu-memory-utilization": 1, "--tensor-parallel-size": 1, "-tp": 1,
                   "--pipeline-parallel-size": 1, "-pp": 1}
_CUDA_QUANTIZATION = ("fp8", "awq", "gptq")


def engine_args(args: list[str], pod_ip: str, mounts: dict[str, str], model: str | None
                ) -> tuple[list[str], list[str]]:
    """The container's (already expanded) args for `sluice serve` here, and what was changed, in words."""
    on_cuda = _flag_value(args, "--device") in ("cuda", "auto")
    out: list[str] = []
    changed: list[str] = []
    i = 0
    while i < len(args):
        flag, value, width = args[i], None, 1
        if flag.startswith("--") and "=" in flag:
            flag, value = flag.split("=", 1)
        arity = (_DROPPED_LORA | (_DROPPED_ON_CPU if on_cuda else {})).get(flag)
        takes_value = flag in ("--host", "--model", "--device", "--dtype", "--quantization") or bool(arity)
        if takes_value and value is None:
            value, width = (args[i + 1] if i + 1 < len(args) else ""), 2
        i += width
        if arity is not None:
            changed.append(f"dropped {flag}" + (f" {value}" if value is not None else ""))
        elif flag == "--host":
            out += ["--host", pod_ip]
        elif flag == "--model":
            if model is None:
                changed.append(f"dropped --model {value} (the bundled SmolLM2-135M-Instruct)")
            else:
                out += ["--model", model]
                changed.append(f"--model {value} -> {model}")
        elif flag == "--device" and on_cuda:
            out += ["--device", "cpu"]
            changed.append(f"--device {value} -> cpu")
        elif flag == "--dtype" and on_cuda:
            out += ["--dtype", "float32"]
            changed.append(f"--dtype {value} -> float32")
        elif flag == "--quantization" and on_cuda and value in _CUDA_QUANTIZATION:
            changed.append(f"dropped --quantization {value} (CUDA only)")
        elif value is not None:
            out += [flag, local_path(value, mounts)]
        else:
            out.append(local_path(flag, mounts))
    return out, changed


def local_path(text: str, mounts: dict[str, str]) -> str:
    """A path under one of the container's mounts, as the per-pod directory that stands for it."""
    for mount in sorted(mounts, key=len, reverse=True):
        if text == mount or text.startswith(mount.rstrip("/") + "/"):
            return mounts[mount] + text[len(mount):]
    return text


class Source:
    """Where Secrets and ConfigMaps are read from (the API; a dict in tests)."""

    async def data(self, kind: str, namespace: str, name: str) -> dict[str, bytes] | None:
        """A Secret's or ConfigMap's data, decoded; None where it does not exist."""
        raise NotImplementedError


def _field(pod: Pod, path: str) -> str:
    meta, spec, status = pod["metadata"], pod["spec"], pod.get("status") or {}
    m = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
    if m:
        return (meta.get(m.group(1)) or {}).get(m.group(2), "")
    value = {"metadata.name": meta.get("name"), "metadata.namespace": meta.get("namespace"),
             "metadata.uid": meta.get("uid"), "spec.nodeName": spec.get("nodeName"),
             "spec.serviceAccountName": spec.get("serviceAccountName"), "status.podIP": status.get("podIP"),
             "status.hostIP": status.get("hostIP"),
             "status.podIPs": ",".join(p["ip"] for p in status.get("podIPs") or [])}.get(path)
    return value or ""


async def container_env(source: Source, pod: Pod, container: dict[str, Any]) -> dict[str, str]:
    """The container's environment as the kubelet makes it (envFrom, then env in order, $(VAR) expanded)."""
    ns = pod["metadata"]["namespace"]
    env: dict[str, str] = {}
    for ref in container.get("envFrom") or []:
        for kind in ("configMap", "secret"):
            if f"{kind}Ref" in ref:
                data = await source.data(kind, ns, ref[f"{kind}Ref"]["name"]) or {}
                env.update({ref.get("prefix", "") + k: v.decode() for k, v in data.items()})
    for var in container.get("env") or []:
        name, frm = var["name"], var.get("valueFrom")
        if frm is None:
            env[name] = expand(var.get("value", ""), env)
        elif "fieldRef" in frm:
            env[name] = _field(pod, frm["fieldRef"]["fieldPath"])
        elif "secretKeyRef" in frm or "configMapKeyRef" in frm:
            kind = "secret" if "secretKeyRef" in frm else "configMap"
            ref = frm[f"{kind}KeyRef"]
            value = (await source.data(kind, ns, ref["name"]) or {}).get(ref["key"])
            if value is not None:
                env[name] = value.decode()
            elif not ref.get("optional"):
                raise LookupError(f"env {name}: {kind} {ns}/{ref['name']} has no key {ref['key']!r}")
        elif "resourceFieldRef" in frm:
            res = frm["resourceFieldRef"]["resource"].split(".", 1)
            env[name] = str(((container.get("resources") or {}).get(res[0]) or {}).get(res[1], ""))
    return env


async def materialise_volumes(source: Source, pod: Pod, container: dict[str, Any], root: Path
                              ) -> dict[str, str]:
    """Write the container's volumes under root (ConfigMaps and Secrets from the API, the others empty) and
    return {mountPath: local directory or file}."""
    ns = pod["metadata"]["namespace"]
    volumes = {v["name"]: v for v in pod["spec"].get("volumes") or []}
    made: dict[str, Path] = {}
    for name, volume in volumes.items():
        target = root / name
        target.mkdir(parents=True, exist_ok=True)
        sources = [volume] if ("configMap" in volume or "secret" in volume) else \
            (volume.get("projected") or {}).get("sources") or []
        for src in sources:
            kind = "configMap" if "configMap" in src else "secret" if "secret" in src else None
            if kind is None:
                continue  # downwardAPI, serviceAccountToken, clusterTrustBundle: not simulated
            ref = src[kind]
            ref_name = ref.get("name") or ref.get("secretName", "")
            data = await source.data(kind, ns, ref_name)
            if data is None:
                if not ref.get("optional"):
                    raise LookupError(f"volume {name}: {kind} {ns}/{ref_name} not found")
                continue
            items = ref.get("items") or [{"key": k, "path": k} for k in data]
            for item in items:
                if item["key"] in data:
                    path = target / item["path"]
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_bytes(data[item["key"]])
                    path.chmod(0o600 if kind == "secret" else 0o644)
        made[name] = target
    mounts: dict[str, str] = {}
    for mount in container.get("volumeMounts") or []:
        local = made.get(mount["name"]) or root / mount["name"]
        if mount.get("subPath"):
            local = local / mount["subPath"]
        mounts[mount["mountPath"]] = str(local)
    return mounts


def readiness_url(pod: Pod, container: dict[str, Any], pod_ip: str) -> str | None:
    """The readinessProbe's httpGet as a URL on the pod IP; None without one (ready while the process runs)."""
    get = (container.get("readinessProbe") or {}).get("httpGet")
    if get is None:
        return None
    port = get.get("port")
    if isinstance(port, str) and not port.isdigit():
        port = next(p["containerPort"] for p in container.get("ports") or [] if p.get("name") == port)
    return f"{get.get('scheme', 'HTTP').lower()}://{get.get('host') or pod_ip}:{port}{get.get('path', '/')}"


# --- pod addresses -------------------------------------------------------------------------------------------------

def is_local_address(ip: str) -> bool:
    """Whether this machine can bind the address (every 127.x; others once routed locally)."""
    family = socket.AF_INET6 if ipaddress.ip_address(ip).version == 6 else socket.AF_INET
    with socket.socket(family) as s:
        try:
            s.bind((ip, 0))
        except OSError as e:
            if e.errno == errno.EADDRNOTAVAIL:
                return False
            raise
    return True


class LocalRoutes:
    """Makes pod IPs addresses of this machine: `ip route add local <ip>/32 dev lo` (the whole address then routes
    to the loopback device, where engines bind and clients connect). The routes added are removed by close()."""

    def __init__(self) -> None:
        self.added: list[str] = []

    async def ensure(self, ip: str) -> None:
        if is_local_address(ip):
            return
        prefix = f"{ip}/{128 if ipaddress.ip_address(ip).version == 6 else 32}"
        code, out = await self._ip("route", "add", "local", prefix, "dev", "lo")
        if code != 0 and not is_local_address(ip):
            raise PermissionError(f"pod IP {ip} is not an address of this machine and `ip route add local {prefix} "
                                  f"dev lo` failed ({out.strip()}): run scripts/pod_runner.py as root (or with "
                                  "CAP_NET_ADMIN)")
        if code == 0:
            log.info("pod IP %s: added a local route (ip route add local %s dev lo)", ip, prefix)
            self.added.append(prefix)

    async def close(self) -> None:
        for prefix in self.added:
            code, out = await self._ip("route", "del", "local", prefix, "dev", "lo")
            if code != 0:
                log.warning("could not remove the local route %s: %s", prefix, out.strip())
        self.added.clear()

    @staticmethod
    async def _ip(*args: str) -> tuple[int, str]:
        proc = await asyncio.create_subprocess_exec("ip", *args, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.STDOUT)
        out, _ = await proc.communicate()
        return proc.returncode or 0, out.decode(errors="replace")


# --- the API -----------------------------------------------------------------------------------------------------

class Kube(Source):
    """The few calls the runner makes, over HTTPS with the kubeconfig's credentials (client certificate or token)."""

    def __init__(self, kubeconfig: Path, secrets_dir: Path):
        cfg = yaml.safe_load(kubeconfig.read_text())
        ctx_name = cfg.get("current-context")
        ctx = next(c["context"] for c in cfg["contexts"] if c["name"] == ctx_name)
        cluster = next(c["cluster"] for c in cfg["clusters"] if c["name"] == ctx["cluster"])
        user = next((u["user"] for u in cfg.get("users") or [] if u["name"] == ctx.get("user")), {})
        self.server = cluster["server"].rstrip("/")

        def file(entry: dict[str, Any], key: str) -> str | None:  # a path, or the inline data written to one
            if entry.get(f"{key}-data"):
                path = secrets_dir / key
                path.write_bytes(base64.b64decode(entry[f"{key}-data"]))
                path.chmod(0o600)
                return str(path)
            return entry.get(key)

        self.ssl = ssl.create_default_context(cafile=file(cluster, "certificate-authority"))
        if cluster.get("insecure-skip-tls-verify"):
            self.ssl.check_hostname, self.ssl.verify_mode = False, ssl.CERT_NONE
        cert = file(user, "client-certificate")
        if cert:
            self.ssl.load_cert_chain(cert, file(user, "client-key"))
        self.headers = {"Authorization": f"Bearer {user['token']}"} if user.get("token") else {}
        self.session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Kube:
        self.session = aiohttp.ClientSession(headers=self.headers, connector=aiohttp.TCPConnector(ssl=self.ssl))
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.session is not None
        await self.session.close()

    async def get(self, path: str, **params: str) -> Any | None:
        assert self.session is not None
        async with self.session.get(self.server + path, params=params,
                                    timeout=aiohttp.ClientTimeout(total=30)) as r:
            if r.status == 404:
                return None
            r.raise_for_status()
            return await r.json()

    async def patch_status(self, pod: Pod, status: dict[str, Any]) -> None:
        """A strategic merge patch of the pod's status (conditions merge by type); a pod gone meanwhile is fine."""
        assert self.session is not None
        meta = pod["metadata"]
        url = f"{self.server}/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status"
        body = {"metadata": {"uid": meta["uid"]}, "status": status}  # the uid: never a same-named successor
        async with self.session.patch(url, data=json.dumps(body), timeout=aiohttp.ClientTimeout(total=30),
                                      headers={"Content-Type": "application/strategic-merge-patch+json"}) as r:
            if r.status in (404, 409):  # gone, or a successor of the same name (the uid precondition)
                log.debug("status of %s/%s not patched: %s", meta["namespace"], meta["name"], await r.text())
                return
            if r.status >= 300:
                raise aiohttp.ClientError(f"PATCH {url}: {r.status} {await r.text()}")

    async def watch(self, path: str, resource_version: str) -> AsyncIterator[dict[str, Any]]:
        assert self.session is not None
        params = {"watch": "1", "resourceVersion": resource_version, "allowWatchBookmarks": "true",
                  "timeoutSeconds": "300"}
        async with self.session.get(self.server + path, params=params,
                                    timeout=aiohttp.ClientTimeout(total=None, sock_read=330)) as r:
            r.raise_for_status()
            async for line in r.content:
                if line.strip():
                    yield json.loads(line)

    async def data(self, kind: str, namespace: str, name: str) -> dict[str, bytes] | None:
        plural = {"secret": "secrets", "configMap": "configmaps"}[kind]
        obj = await self.get(f"/api/v1/namespaces/{namespace}/{plural}/{name}")
        if obj is None:
            return None
        if kind == "secret":
            return {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}
        return {**{k: v.encode() for k, v in (obj.get("data") or {}).items()},
                **{k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()}}


# --- one pod's engine --------------------------------------------------------------------------------------------

def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


@dataclass
class PodEngine:
    """The runner's view of one pod: the latest object seen, its process, what its status says."""

    pod: Pod
    changed: asyncio.Event = field(default_factory=asyncio.Event)  # a newer pod object arrived
    gone: asyncio.Event = field(default_factory=asyncio.Event)  # deleted (or deletionTimestamp set)
    proc: asyncio.subprocess.Process | None = None
    ip: str = ""
    restarts: int = 0
    last_state: dict[str, Any] = field(default_factory=dict)
    ready: bool | None = None
    ready_since: str = ""
    task: asyncio.Task[None] | None = None

    @property
    def key(self) -> str:
        return f"{self.pod['metadata']['namespace']}/{self.pod['metadata']['name']}"


@dataclass
class Settings:
    max_engines: int = 2
    log_dir: Path = Path("pod-runner-logs")
    work_dir: Path = Path(tempfile.gettempdir())
    model: str | None = None
    python: str = sys.executable
    probe_interval: float = 1.0


class Runner:
    def __init__(self, kube: Kube, settings: Settings):
        self.kube, self.s = kube, settings
        self.engines: dict[str, PodEngine] = {}  # by pod uid
        self.slots = asyncio.Semaphore(settings.max_engines)
        self.kwok_nodes: set[str] = set()
        self.routes = LocalRoutes()
        self.other_nodes: set[str] = set()

    # -- watching pods --
    async def run(self) -> None:
        while True:
            try:
                listing = await self.kube.get("/api/v1/pods")
                assert listing is not None
                live = {p["metadata"]["uid"] for p in listing["items"]}
                for uid, engine in list(self.engines.items()):
                    if uid not in live:
                        engine.gone.set()
                for pod in listing["items"]:
                    await self.observe("ADDED", pod)
                rv = listing["metadata"]["resourceVersion"]
                async for event in self.kube.watch("/api/v1/pods", rv):
                    if event["type"] == "ERROR":
                        break  # 410 Gone and the like: list again
                    if event["type"] != "BOOKMARK":
                        await self.observe(event["type"], event["object"])
            except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as e:
                log.warning("watching pods: %s; again in 1 s", e)
                await asyncio.sleep(1)

    async def observe(self, kind: str, pod: Pod) -> None:
        uid = pod["metadata"]["uid"]
        engine = self.engines.get(uid)
        if kind == "DELETED" or pod["metadata"].get("deletionTimestamp"):
            if engine is not None:
                engine.pod = pod
                engine.gone.set()
            return
        if engine is not None:
            engine.pod = pod
            engine.changed.set()
        elif await self.owns(pod):
            engine = self.engines[uid] = PodEngine(pod)
            engine.task = asyncio.create_task(self.serve(engine))

    async def owns(self, pod: Pod) -> bool:
        node = pod["spec"].get("nodeName")
        if not node or node in self.other_nodes or not is_engine_pod(pod):
            return False
        if node not in self.kwok_nodes:
            nodes = await self.kube.get("/api/v1/nodes")
            for n in (nodes or {}).get("items", []):
                key, value = KWOK_NODE_ANNOTATION
                kwok = (n["metadata"].get("annotations") or {}).get(key) == value
                (self.kwok_nodes if kwok else self.other_nodes).add(n["metadata"]["name"])
        return node in self.kwok_nodes

    # -- one pod --
    async def until_gone(self, engine: PodEngine, aw: Awaitable[T]) -> tuple[bool, T | None]:
        """Await aw unless the pod goes first: (gone, result)."""
        task = asyncio.ensure_future(aw)
        gone = asyncio.ensure_future(engine.gone.wait())
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        gone.cancel()
        if task.done():
            return False, task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return True, None

    async def serve(self, engine: PodEngine) -> None:
        try:
            await self._serve(engine)
        except Exception:
            log.exception("%s: the runner failed on this pod", engine.key)
            await self.report(engine, False, "RunnerError", "scripts/pod_runner.py failed on this pod: see its log")
        finally:
            await self.stop(engine)
            self.engines.pop(engine.pod["metadata"]["uid"], None)

    async def _serve(self, engine: PodEngine) -> None:
        while not (engine.pod.get("status") or {}).get("podIP"):  # kwok's Stage gives it one
            engine.changed.clear()
            gone, _ = await self.until_gone(engine, engine.changed.wait())
            if gone:
                return
        engine.ip = engine.pod["status"]["podIP"]
        reason = not_run_reason(engine.pod)
        if reason is not None:
            log.info("%s: simulated, not run: %s", engine.key, reason)
            await self.report(engine, True, SIMULATED, f"not run by scripts/pod_runner.py: {reason}", running=True)
            await engine.gone.wait()
            return
        if self.slots.locked():
            await self.report(engine, False, "WaitingForEngineSlot",
                              f"scripts/pod_runner.py runs at most {self.s.max_engines} engines at once "
                              "(--max-engines); this pod waits for one to stop")
        try:
            await self.routes.ensure(engine.ip)
        except PermissionError as e:
            log.error("%s: %s", engine.key, e)
            await self.report(engine, False, "PodIPNotLocal", str(e))
            await engine.gone.wait()
            return
        gone, _ = await self.until_gone(engine, self.slots.acquire())
        if gone:
            return
        try:
            await self.run_engine(engine)
        finally:
            self.slots.release()

    async def run_engine(self, engine: PodEngine) -> None:
        meta = engine.pod["metadata"]
        work = Path(tempfile.mkdtemp(prefix=f"{meta['namespace']}_{meta['name']}_", dir=self.s.work_dir))
        try:
            await self._run_engine(engine, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)

    async def _run_engine(self, engine: PodEngine, work: Path) -> None:
        pod = engine.pod
        container = engine_container(pod)
        assert container is not None
        while True:  # as the kubelet: a missing Secret or ConfigMap is waited for (CreateContainerConfigError)
            try:
                mounts = await materialise_volumes(self.kube, pod, container, work / "volumes")
                pod_env = await container_env(self.kube, pod, container)
                break
            except LookupError as e:
                await self.report(engine, False, "CreateContainerConfigError", str(e))
                gone, _ = await self.until_gone(engine, asyncio.sleep(BACKOFF_S))
                if gone:
                    return
        args = [expand(a, pod_env) for a in container.get("args") or []]
        argv, changed = engine_args(args, engine.ip, mounts, self.s.model)
        env = {**os.environ, **{k: local_path(v, mounts) for k, v in pod_env.items() if k not in MACHINE_ENV},
               "PYTHONUNBUFFERED": "1"}
        env.pop("KUBECONFIG", None)
        ready_url = readiness_url(pod, container, engine.ip)
        probe = container.get("readinessProbe") or {}
        timeout = aiohttp.ClientTimeout(total=min(float(probe.get("timeoutSeconds", 1)), 2.0))
        log_path = self.s.log_dir / f"{pod['metadata']['namespace']}_{pod['metadata']['name']}.log"
        policy = pod["spec"].get("restartPolicy", "Always")
        async with aiohttp.ClientSession() as http:
            while True:
                await self.wait_address_free(engine)
                if engine.gone.is_set():
                    return
                cmd = [self.s.python, "-m", "sluice_engine.entrypoints.cli", "serve", *argv]
                with open(log_path, "a") as out:
                    out.write(f"=== scripts/pod_runner.py {now()}: start {engine.restarts + 1} of {engine.key} "
                              f"({'; '.join(changed) or 'args as rendered'})\n=== {' '.join(cmd)}\n")
                    out.flush()
                    engine.proc = await asyncio.create_subprocess_exec(
                        *cmd, env=env, cwd=work, stdout=out, stderr=asyncio.subprocess.STDOUT,
                        stdin=asyncio.subprocess.DEVNULL, start_new_session=True)
                log.info("%s: engine pid %d on %s (log %s)", engine.key, engine.proc.pid, engine.ip, log_path)
                started = now()
                await self.report(engine, ready_url is None, "EngineStarting" if ready_url else "",
                                  "" if ready_url is None else f"waiting for {ready_url}", running=True,
                                  started=started)
                code = await self.watch_readiness(engine, http, ready_url, timeout, started)
                if code is None:  # the pod went
                    return
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(engine.proc.pid, signal.SIGKILL)  # what it left behind (its engine-core process)
                engine.proc = None
                engine.restarts += 1
                engine.last_state = {"terminated": {"exitCode": code, "reason": "Completed" if code == 0 else "Error",
                                                    "startedAt": started, "finishedAt": now()}}
                log.warning("%s: engine exited with %d (restart %d; log %s)", engine.key, code, engine.restarts,
                            log_path)
                if policy == "Never" or (policy == "OnFailure" and code == 0):
                    phase = "Succeeded" if code == 0 else "Failed"
                    await self.report(engine, False, "EngineExited", f"sluice serve exited with {code}",
                                      phase=phase)
                    await engine.gone.wait()
                    return
                delay = min(BACKOFF_S * 2 ** (engine.restarts - 1), BACKOFF_MAX_S)
                await self.report(engine, False, "CrashLoopBackOff",
                                  f"sluice serve exited with {code}; restarting in {delay:.0f} s (log {log_path})",
                                  waiting="CrashLoopBackOff")
                gone, _ = await self.until_gone(engine, asyncio.sleep(delay))
                if gone:
                    return

    async def watch_readiness(self, engine: PodEngine, http: aiohttp.ClientSession, url: str | None,
                              timeout: aiohttp.ClientTimeout, started: str) -> int | None:
        """Poll the readiness endpoint until the process exits (its code) or the pod goes (None)."""
        assert engine.proc is not None
        exited = asyncio.ensure_future(engine.proc.wait())
        try:
            while True:
                if url is not None:
                    ready, why = False, ""
                    try:
                        async with http.get(url, timeout=timeout) as r:
                            ready, why = 200 <= r.status < 400, f"{url} answered {r.status}"
                    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                        why = f"{url}: {type(e).__name__}"
                    if ready != engine.ready:
                        log.info("%s: %s", engine.key, "ready" if ready else f"not ready ({why})")
                        await self.report(engine, ready, "" if ready else "EngineNotReady",
                                          "" if ready else why, running=True, started=started)
                gone, _ = await self.until_gone(engine, asyncio.wait({exited}, timeout=self.s.probe_interval))
                if gone:
                    return None
                if exited.done():
                    return exited.result()
        finally:
            if not exited.done():
                exited.cancel()

    async def wait_address_free(self, engine: PodEngine) -> None:
        """kwok hands a deleted pod's IP to the next pod: wait until no other engine runs on it."""
        while any(e is not engine and e.ip == engine.ip and e.proc is not None for e in self.engines.values()):
            if engine.gone.is_set():
                return
            await asyncio.sleep(0.2)

    async def stop(self, engine: PodEngine) -> None:
        proc = engine.proc
        if proc is None:
            return
        if proc.returncode is None:
            grace = float(engine.pod["spec"].get("terminationGracePeriodSeconds", 30))
            log.info("%s: stopping engine pid %d (SIGTERM, SIGKILL after %.0f s)", engine.key, proc.pid, grace)
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), grace)
            except asyncio.TimeoutError:
                log.warning("%s: engine pid %d still there after %.0f s: SIGKILL", engine.key, proc.pid, grace)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # its engine-core process and anything else it left
        await proc.wait()
        engine.proc = None

    # -- status --
    async def report(self, engine: PodEngine, ready: bool, reason: str, message: str, *, running: bool = False,
                     started: str = "", waiting: str = "", phase: str = "") -> None:
        if ready != engine.ready or not engine.ready_since:
            engine.ready, engine.ready_since = ready, now()
        status = "True" if ready else "False"
        conditions = [{"type": t, "status": status, "lastTransitionTime": engine.ready_since, "lastProbeTime": None,
                       "reason": reason or None, "message": message or None}
                      for t in ("Ready", "ContainersReady")]
        statuses = []
        for c in engine.pod["spec"].get("containers") or []:
            if c.get("name") != ENGINE_CONTAINER:  # other containers are not run: reported as kwok would
                statuses.append({"name": c["name"], "image": c.get("image", ""), "imageID": "", "ready": True,
                                 "started": True, "restartCount": 0, "state": {"running": {"startedAt": now()}}})
                continue
            if running:
                state: dict[str, Any] = {"running": {"startedAt": started or now()}}
            elif phase:
                state = engine.last_state
            else:
                state = {"waiting": {"reason": waiting or reason or "ContainerCreating", "message": message}}
            statuses.append({"name": c["name"], "image": c.get("image", ""), "imageID": "", "ready": ready,
                             "started": running, "restartCount": engine.restarts, "state": state,
                             "lastState": engine.last_state,
                             **({"containerID": f"pod-runner://{engine.proc.pid}"} if engine.proc else {})})
        body: dict[str, Any] = {"conditions": conditions, "containerStatuses": statuses}
        if phase:
            body["phase"] = phase
        try:
            await self.kube.patch_status(engine.pod, body)
        except aiohttp.ClientError as e:
            log.warning("%s: status not written: %s", engine.key, e)

    async def shutdown(self) -> None:
        for engine in list(self.engines.values()):
            engine.gone.set()
            if engine.proc is not None:
                await self.report(engine, False, "PodRunnerStopped", "scripts/pod_runner.py stopped")
        tasks = [e.task for e in self.engines.values() if e.task is not None]
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.routes.close()


async def main_async(args: argparse.Namespace) -> None:
    settings = Settings(max_engines=args.max_engines, log_dir=args.log_dir, model=args.model, python=args.python,
                        probe_interval=args.probe_interval)
    settings.log_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="sluice-pod-runner-") as tmp:
        settings.work_dir = Path(tmp)
        secrets = Path(tmp) / "kubeconfig"
        secrets.mkdir(mode=0o700)
        async with Kube(args.kubeconfig, secrets) as kube:
            runner = Runner(kube, settings)
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
            watching = asyncio.create_task(runner.run())
            log.info("watching pods on kwok nodes at %s (at most %d engines; logs in %s)", kube.server,
                     settings.max_engines, settings.log_dir)
            await asyncio.wait({watching, asyncio.ensure_future(stop.wait())}, return_when=asyncio.FIRST_COMPLETED)
            watching.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watching
            await runner.shutdown()
            log.info("stopped")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kubeconfig", type=Path, default=os.environ.get("KUBECONFIG"),
                   help="the cluster's admin kubeconfig (default: $KUBECONFIG)")
    p.add_argument("--max-engines", type=int, default=2,
                   help="engines running at once; the pods beyond wait, not Ready (default 2, for 2 cores)")
    p.add_argument("--log-dir", type=Path, default=Path("pod-runner-logs"),
                   help="one <namespace>_<pod>.log per pod, the engine's output (default ./pod-runner-logs)")
    p.add_argument("--model", default=None,
                   help="the local model every engine serves (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--python", default=sys.executable, help="the Python that runs sluice_engine (default: this one)")
    p.add_argument("--probe-interval", type=float, default=1.0, help="seconds between readiness probes")
    args = p.parse_args(argv)
    if args.kubeconfig is None:
        p.error("--kubeconfig or $KUBECONFIG is needed")
    if args.max_engines < 1:
        p.error("--max-engines must be at least 1")
    return args


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s pod_runner %(levelname)s %(message)s")
    asyncio.run(main_async(parse_args(argv)))


if __name__ == "__main__":
    main()
