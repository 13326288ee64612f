"""Backends from Kubernetes: the EndpointSlices of each InferenceEndpoint's serving and standby Services.

Two list+watch loops over the API (plain HTTP on aiohttp, the pod's service account; no client library):

- InferenceEndpoints (sluice.dev/v1alpha1): which endpoints exist, the model each serves
  (spec.model.servedName, else the last path component of spec.model.uri, as the engine names it), and the
  names clients may send for it (sluice_contract.model_names: `<namespace>/<servedName>`, and the plain
  servedName with spec.model.nameScope Cluster or when the gateway watches one namespace only), and its
  LoRA adapters (spec.adapters[].name), each published by the same rule as the served name.
- EndpointSlices labelled `sluice.dev/endpoint` (the EndpointSlice controller copies a Service's labels onto
  its slices): `sluice.dev/role` = serving | standby says which pool, each endpoint's `conditions.ready`
  whether Kubernetes counts the pod ready.

A third list+watch loop reads ServedModels (sluice.dev/v1alpha1, issue 42): split models, each a name split over
InferenceEndpoints of its namespace by weight, with aliases (`split_specs`, pure). The CRD is optional: while the
cluster does not serve it (or RBAC refuses it) the gateway runs without splits, retrying in the background.

The gateway needs get/list/watch on these resources. `endpoint_specs` turns the two lists into what the
registry wants; it is pure and tested on its own.

A third loop finds the other gateway replicas: the EndpointSlices of the gateway's headless peers Service
(`peer_urls`; peers.py polls their demand).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import ssl
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import aiohttp

from sluice_contract import (
    API_VERSION,
    ENDPOINT_LABEL,
    NAME_SCOPE_NAMESPACE,
    PLURAL,
    POOL_LABEL,
    PREFILL,
    ROLE_LABEL,
    SERVICE_NAME_LABEL,
    SERVING,
    STANDBY,
    endpoint_key,
    model_names,
    served_name,
)

from .registry import EndpointSpec
from .versions import DEFAULT_SESSION_HEADER, SplitSpec, Version

log = logging.getLogger("sluice.gateway")

SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
ENDPOINTS_API = f"/apis/{API_VERSION}"
PEER_PORT_NAME = "peers"  # the port of the gateway's headless peers Service
SLICES_API = "/apis/discovery.k8s.io/v1"
WATCH_TIMEOUT_S = 300  # the server ends a watch after this; the loop lists again (catches missed deletes)


def served_model_name(ie: dict[str, Any]) -> str:
    """The contract's rule; an object without a usable uri (the CRD requires one) falls back to its name."""
    model = (ie.get("spec") or {}).get("model") or {}
    return served_name(model.get("servedName"), str(model.get("uri") or "")) or str(ie["metadata"]["name"])


def adapter_names(ie: dict[str, Any], served: str) -> list[str]:
    """The names of spec.adapters, read defensively: a CR without the field (or from an older CRD) has none,
    and an entry without a usable name, or named like the served name, is skipped (the CRD refuses both)."""
    adapters = (ie.get("spec") or {}).get("adapters") or []
    if not isinstance(adapters, list):
        return []
    names = (a.get("name") if isinstance(a, dict) else None for a in adapters)
    return list(dict.fromkeys(n for n in names if isinstance(n, str) and n and "/" not in n and n != served))


def objective_priorities(routing: Any, where: str) -> dict[str, int]:
    """spec.routing.objectives -> {name: priority}; entries the CRD would refuse are skipped, saying so."""
    out: dict[str, int] = {}
    objectives = routing.get("objectives") if isinstance(routing, dict) else None
    for o in objectives if isinstance(objectives, list) else ():
        name = o.get("name") if isinstance(o, dict) else None
        priority = o.get("priority") if isinstance(o, dict) else None
        if isinstance(name, str) and name and isinstance(priority, int) and not isinstance(priority, bool):
            out[name] = priority
        else:
            log.warning("%s: spec.routing.objectives entry %r skipped (want {name, priority})", where, o)
    return out


def _port(ports: list[dict[str, Any]] | None) -> int | None:
    ports = [p for p in ports or [] if p.get("port")]
    for p in ports:
        if p.get("name") == "http":
            return int(p["port"])
    return int(ports[0]["port"]) if ports else None


def endpoint_specs(endpoints: Iterable[dict[str, Any]], slices: Iterable[dict[str, Any]],
                   only_namespace: bool = False) -> list[EndpointSpec]:
    """InferenceEndpoints + their EndpointSlices -> one spec per endpoint, keyed <namespace>/<name>.
    `only_namespace`: the gateway watches one namespace, so plain served names cannot collide there."""
    specs: dict[str, EndpointSpec] = {}
    for ie in endpoints:
        meta = ie.get("metadata") or {}
        namespace = meta.get("namespace", "default")
        key = endpoint_key(namespace, meta["name"])
        served = served_model_name(ie)
        scope = ((ie.get("spec") or {}).get("model") or {}).get("nameScope") or NAME_SCOPE_NAMESPACE
        try:
            names = model_names(namespace, served, scope, only_namespace)
        except ValueError as e:  # the CRD's enum refuses it; an older CRD might not
            log.warning("InferenceEndpoint %s: %s; publishing its namespaced name only", key, e)
            scope = NAME_SCOPE_NAMESPACE
            names = model_names(namespace, served, scope, only_namespace)
        # Each LoRA adapter is published by the served name's rule: `<namespace>/<adapter>`, and the plain name
        # where the served name is plain too.
        adapters = {a: model_names(namespace, a, scope, only_namespace) for a in adapter_names(ie, served)}
        specs[key] = EndpointSpec(key, served, names=names, namespace=namespace,
                                  created=str(meta.get("creationTimestamp") or ""), adapters=adapters,
                                  priorities=objective_priorities((ie.get("spec") or {}).get("routing"), key))
    for s in slices:
        meta = s.get("metadata") or {}
        labels = meta.get("labels") or {}
        spec = specs.get(endpoint_key(meta.get("namespace", "default"), str(labels.get(ENDPOINT_LABEL))))
        port = _port(s.get("ports"))
        if spec is None or port is None or s.get("addressType") not in ("IPv4", "IPv6"):
            continue
        role = labels.get(ROLE_LABEL) or labels.get(POOL_LABEL) or SERVING
        if role == PREFILL:  # a disaggregated endpoint's prefill pool: its decode engines' first hop, not clients'
            continue
        pool = spec.standby if role == STANDBY else spec.serving
        for e in s.get("endpoints") or []:
            addresses = e.get("addresses") or []
            if not addresses:
                continue
            cond = e.get("conditions") or {}
            # API semantics: a missing `ready` means ready; a terminating pod takes no new requests.
            ready = cond.get("ready") is not False and not cond.get("terminating")
            url = _url(addresses[0], port)
            pool[url] = pool.get(url, False) or ready
    return [specs[k] for k in sorted(specs)]


SERVED_MODELS = "servedmodels"


def split_specs(models: Iterable[dict[str, Any]], only_namespace: bool = False) -> list[SplitSpec]:
    """ServedModels -> one SplitSpec each, keyed <namespace>/<name>; versions and aliases name endpoints of the
    same namespace. Read defensively (an older CRD, or none, may let anything in): a version without an endpoint
    name or with a weight that is not an integer >= 0 is skipped, an alias to no version is skipped."""
    out = []
    for m in models:
        meta, spec = m.get("metadata") or {}, m.get("spec") or {}
        namespace = meta.get("namespace", "default")
        key, model = endpoint_key(namespace, str(meta.get("name"))), spec.get("model")
        if not isinstance(model, str) or not model or "/" in model:
            log.warning("ServedModel %s: no usable spec.model; skipped", key)
            continue
        versions = []
        for v in spec.get("versions") or []:
            w = v.get("weight") if isinstance(v, dict) else None
            e = v.get("endpoint") if isinstance(v, dict) else None
            if isinstance(e, str) and e and isinstance(w, int) and not isinstance(w, bool) and w >= 0:
                versions.append(Version(endpoint_key(namespace, e), w))
            else:
                log.warning("ServedModel %s: version %r skipped (want {endpoint, weight >= 0})", key, v)
        scope = spec.get("nameScope") or NAME_SCOPE_NAMESPACE
        try:
            names = model_names(namespace, model, scope, only_namespace)
        except ValueError:
            scope, names = NAME_SCOPE_NAMESPACE, model_names(namespace, model, NAME_SCOPE_NAMESPACE, only_namespace)
        known = {v.endpoint for v in versions}
        aliases = {a: endpoint_key(namespace, t) for a, t in (spec.get("aliases") or {}).items()
                   if isinstance(a, str) and a and "/" not in a and isinstance(t, str)
                   and endpoint_key(namespace, t) in known}
        header = spec.get("sessionHeader")
        out.append(SplitSpec(key, model, tuple(versions), names=names, aliases=aliases,
                             alias_names={a: model_names(namespace, a, scope, only_namespace) for a in aliases},
                             session_header=header.lower() if isinstance(header, str) and header
                             else DEFAULT_SESSION_HEADER, namespace=namespace))
    return sorted(out, key=lambda s: s.key)


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def peer_urls(slices: Iterable[dict[str, Any]]) -> set[str]:
    """The gateway replicas the peers Service's EndpointSlices list, ready or not: a replica still starting
    takes no traffic, and one terminating still has requests in flight to count."""
    urls = set()
    for s in slices:
        ports = [p for p in s.get("ports") or [] if p.get("port")]
        named = [p for p in ports if p.get("name") == PEER_PORT_NAME] or ports
        if not named or s.get("addressType") not in ("IPv4", "IPv6"):
            continue
        for e in s.get("endpoints") or []:
            for host in (e.get("addresses") or [])[:1]:
                urls.add(_url(host, int(named[0]["port"])))
    return urls


class KubeAPI:
    """Just enough of the Kubernetes API: GET a list, stream a watch. Credentials from the service account
    (the token is re-read for every request: projected tokens rotate), or a plain URL (tests, kubectl proxy)."""

    def __init__(self, server: str | None = None):
        self._token_path: str | None = None
        self._ssl: ssl.SSLContext | bool = True
        if server:
            self.base = server.rstrip("/")
        else:
            host = os.environ.get("KUBERNETES_SERVICE_HOST")
            if not host:
                raise ValueError("--kubernetes outside a cluster: no KUBERNETES_SERVICE_HOST; pass --kube-api URL "
                                 "(e.g. of `kubectl proxy`)")
            port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
            self.base = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
            self._ssl = ssl.create_default_context(cafile=f"{SA_DIR}/ca.crt")
            self._token_path = f"{SA_DIR}/token"
        self.session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))

    async def close(self) -> None:
        if self.session:
            await self.session.close()

    def _headers(self) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        if self._token_path:
            with open(self._token_path) as f:
                headers["Authorization"] = f"Bearer {f.read().strip()}"
        return headers

    async def list(self, path: str, params: dict[str, str]) -> dict[str, Any]:
        assert self.session is not None
        async with self.session.get(self.base + path, params=params, headers=self._headers(), ssl=self._ssl,
                                    timeout=aiohttp.ClientTimeout(total=60)) as r:
            if r.status != 200:
                raise RuntimeError(f"GET {path}: {r.status} {(await r.text())[:300]}")
            return await r.json(content_type=None)

    async def watch(self, path: str, params: dict[str, str]) -> AsyncIterator[dict[str, Any]]:
        """Watch events, one JSON object per line (lines may be longer than aiohttp's readline allows)."""
        assert self.session is not None
        async with self.session.get(self.base + path, params={**params, "watch": "true"}, headers=self._headers(),
                                    ssl=self._ssl) as r:
            if r.status != 200:
                raise RuntimeError(f"watch {path}: {r.status} {(await r.text())[:300]}")
            buf = b""
            async for chunk in r.content.iter_any():
                buf += chunk
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    if line.strip():
                        yield json.loads(line)


def _key(obj: dict[str, Any]) -> tuple[str, str]:
    meta = obj.get("metadata") or {}
    return meta.get("namespace", ""), meta.get("name", "")


class Informer:
    """A resource's objects kept current: list, then watch from that version; list again when the watch
    ends or fails (410 Gone included)."""

    def __init__(self, api: KubeAPI, path: str, label: str | None, on_change: Callable[[], None]):
        self.api, self.path, self.label, self.on_change = api, path, label, on_change
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.synced = False
        self.failed = False  # a list or watch failed since the last successful list (e.g. no CRD, no RBAC)

    def _wanted(self, obj: dict[str, Any]) -> bool:
        """The label selector (`key` or `key=value`) checked again: a watch may pass other objects."""
        if self.label is None:
            return True
        labels = (obj.get("metadata") or {}).get("labels") or {}
        key, eq, value = self.label.partition("=")
        return key in labels and (not eq or labels[key] == value)

    async def run(self) -> None:
        params = {"labelSelector": self.label} if self.label else {}
        backoff = 0.5
        while True:
            try:
                listing = await self.api.list(self.path, params)
                self.objects = {_key(o): o for o in listing.get("items") or [] if self._wanted(o)}
                self.synced, self.failed = True, False
                self.on_change()
                watch = {**params, "allowWatchBookmarks": "true", "timeoutSeconds": str(WATCH_TIMEOUT_S)}
                version = (listing.get("metadata") or {}).get("resourceVersion")
                if version:
                    watch["resourceVersion"] = version
                async for event in self.api.watch(self.path, watch):
                    kind, obj = event.get("type"), event.get("object") or {}
                    if kind == "ERROR":  # e.g. 410 Gone: our version is too old; list again
                        log.info("watch %s: %s; listing again", self.path, obj.get("message", obj))
                        break
                    if kind not in ("ADDED", "MODIFIED", "DELETED"):
                        continue  # BOOKMARK
                    k = _key(obj)
                    if kind == "DELETED" or not self._wanted(obj):
                        changed = self.objects.pop(k, None) is not None
                    else:
                        changed = self.objects.get(k) != obj
                        self.objects[k] = obj
                    if changed:
                        self.on_change()
                backoff = 0.5
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the API server restarting, RBAC missing, ...: keep the last view, retry
                log.warning("watch %s: %s: %s; retrying in %.1fs", self.path, type(e).__name__, e, backoff)
                if not self.failed:
                    self.failed = True
                    self.on_change()  # an optional resource (KubeDiscovery.models) does not hold the others back
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 30.0)


class KubeDiscovery:
    def __init__(self, api: KubeAPI, namespaces: list[str],
                 apply: Callable[[list[EndpointSpec | SplitSpec]], None]):
        self.api, self._apply = api, apply
        self.only_namespace = len(set(namespaces)) == 1
        scopes = [f"/namespaces/{ns}" for ns in namespaces] or [""]
        self.endpoints = [Informer(api, f"{ENDPOINTS_API}{s}/{PLURAL}", None, self._changed)
                          for s in scopes]
        self.slices = [Informer(api, f"{SLICES_API}{s}/endpointslices", ENDPOINT_LABEL, self._changed)
                       for s in scopes]
        # Optional: a cluster without the ServedModel CRD has no split models (its failures do not hold back).
        self.models = [Informer(api, f"{ENDPOINTS_API}{s}/{SERVED_MODELS}", None, self._changed) for s in scopes]
        self.ready = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    def _changed(self) -> None:
        informers = self.endpoints + self.slices
        if not all(i.synced for i in informers) or not all(i.synced or i.failed for i in self.models):
            return  # half a picture would drop endpoints (or split names) that are there
        specs: list[EndpointSpec | SplitSpec] = [*endpoint_specs(
            [o for i in self.endpoints for o in i.objects.values()],
            [o for i in self.slices for o in i.objects.values()], self.only_namespace)]
        specs += split_specs([o for i in self.models for o in i.objects.values()], self.only_namespace)
        self._apply(specs)
        self.ready.set()

    async def start(self) -> None:
        await self.api.start()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(i.run()) for i in self.endpoints + self.slices + self.models]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.api.close()


def own_namespace() -> str | None:
    """The gateway pod's namespace (its service account's), or None outside a cluster."""
    try:
        with open(f"{SA_DIR}/namespace") as f:
            return f.read().strip() or None
    except OSError:
        return None


class KubePeerDiscovery:
    """The other gateway replicas: the EndpointSlices of the headless peers Service, kept current."""

    def __init__(self, api: KubeAPI, namespace: str, service: str, on_peers: Callable[[set[str]], None]):
        self.on_peers = on_peers
        self.slices = Informer(api, f"{SLICES_API}/namespaces/{namespace}/endpointslices",
                               f"{SERVICE_NAME_LABEL}={service}", self._changed)
        self._task: asyncio.Task | None = None

    def _changed(self) -> None:
        self.on_peers(peer_urls(self.slices.objects.values()))

    async def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self.slices.run())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
