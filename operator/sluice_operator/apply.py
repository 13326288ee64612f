"""A small async Kubernetes client for the loop: server-side apply, list, delete, status.

It talks to the API server with the credentials kopf logged in with (a `kopf.ConnectionInfo`), so the
operator has one login path. Only what the loop needs: every child is namespaced.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import kopf

from .spec import API_VERSION, PLURAL

FIELD_MANAGER = "sluice-operator"  # also the events' reporting component
MAX_EVENT_MESSAGE = 1024
APPLY_CONTENT_TYPE = "application/apply-patch+yaml"  # JSON is YAML: the body is plain JSON
MERGE_CONTENT_TYPE = "application/merge-patch+json"
# Merges list entries by their key (ownerReferences: uid), so two writers adding their own entries never clash.
STRATEGIC_CONTENT_TYPE = "application/strategic-merge-patch+json"


@dataclass(frozen=True, slots=True)
class Kind:
    api_version: str
    kind: str
    plural: str
    optional: bool = False  # a CRD the cluster may not have (KEDA, LWS, the Prometheus operator, Gateway API)


# Every kind reconcile() can produce: the prune pass lists these by the endpoint label.
CHILD_KINDS = (
    Kind("v1", "ConfigMap", "configmaps"),
    Kind("apps/v1", "Deployment", "deployments"),
    Kind("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet", "leaderworkersets", optional=True),
    Kind("v1", "Service", "services"),
    Kind("policy/v1", "PodDisruptionBudget", "poddisruptionbudgets"),
    Kind("keda.sh/v1alpha1", "TriggerAuthentication", "triggerauthentications", optional=True),
    Kind("keda.sh/v1alpha1", "ScaledObject", "scaledobjects", optional=True),
    Kind("monitoring.coreos.com/v1", "ServiceMonitor", "servicemonitors", optional=True),
    Kind("monitoring.coreos.com/v1", "PrometheusRule", "prometheusrules", optional=True),
    Kind("networking.k8s.io/v1", "NetworkPolicy", "networkpolicies"),
    # spec.routing.inferencePool (routing.py): the picker's identity and RBAC, the pool, the route.
    Kind("v1", "ServiceAccount", "serviceaccounts"),
    Kind("rbac.authorization.k8s.io/v1", "Role", "roles"),
    Kind("rbac.authorization.k8s.io/v1", "RoleBinding", "rolebindings"),
    Kind("inference.networking.k8s.io/v1", "InferencePool", "inferencepools", optional=True),
    Kind("gateway.networking.k8s.io/v1", "HTTPRoute", "httproutes", optional=True),
)
KINDS = {(k.api_version, k.kind): k for k in CHILD_KINDS}
ENDPOINT_KIND = Kind(API_VERSION, "InferenceEndpoint", PLURAL)
POD_KIND = Kind("v1", "Pod", "pods")  # read only: the status reads scheduling and model load from them
# Created once, never read, applied, listed or deleted (the KV key of a disaggregated endpoint, disaggregation.py):
# the operator may only create Secrets; the garbage collector deletes it with its endpoint.
SECRET_KIND = Kind("v1", "Secret", "secrets")


def collection_path(api_version: str, plural: str, namespace: str) -> str:
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    return f"{prefix}/namespaces/{namespace}/{plural}"


def kind_of(manifest: dict[str, Any]) -> Kind:
    try:
        return KINDS[manifest["apiVersion"], manifest["kind"]]
    except KeyError:
        raise ValueError(f"no API path known for {manifest['apiVersion']} {manifest['kind']}") from None


class ApiError(Exception):
    def __init__(self, status: int, method: str, path: str, message: str):
        super().__init__(f"{method} {path}: HTTP {status}: {message}")
        self.status = status
        self.message = message  # the API server's own words (Status.message)


def _retry_after(value: str | None) -> float:
    try:
        return max(float(value or 1), 0.1)
    except ValueError:
        return 1.0


class KubeApi:
    """`async with KubeApi(info) as api:` one aiohttp session per reconcile pass."""

    THROTTLE_RETRIES = 5  # answers 429 waited out (Retry-After, at most THROTTLE_MAX_WAIT_S each) before failing
    THROTTLE_MAX_WAIT_S = 5.0

    def __init__(self, info: kopf.ConnectionInfo, timeout_s: float = 30.0,
                 on_request: Callable[[str, int | str], None] | None = None):
        self._info = info
        self._on_request = on_request  # (method, HTTP status or "error"): the operator's metrics
        self._server = info.server.rstrip("/")
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> KubeApi:
        ssl: Any = False if self._info.insecure else self._info.as_ssl_context()
        self._session = aiohttp.ClientSession(
            headers=self._info.as_http_headers(), timeout=self._timeout,
            connector=aiohttp.TCPConnector(ssl=ssl), trust_env=self._info.trust_env)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._session is not None
        await self._session.close()

    async def _request(self, method: str, path: str, *, params: dict[str, str] | None = None,
                       body: Any = None, content_type: str = "application/json") -> dict[str, Any]:
        assert self._session is not None, "use `async with KubeApi(...)`"
        data = None if body is None else json.dumps(body)
        headers = {"Content-Type": content_type, "Accept": "application/json"}
        for attempt in range(self.THROTTLE_RETRIES + 1):
            try:
                async with self._session.request(method, self._server + path, params=params, data=data,
                                                 headers=headers) as resp:
                    text = await resp.text()
            except (aiohttp.ClientError, TimeoutError):
                if self._on_request is not None:
                    self._on_request(method, "error")
                raise
            if self._on_request is not None:
                self._on_request(method, resp.status)
            # 429: the server asks to come back (API priority and fairness, or a CRD's storage still starting
            # right after it was installed, "storage is (re)initializing"); client-go waits Retry-After too.
            if resp.status != 429 or attempt == self.THROTTLE_RETRIES:
                break
            await asyncio.sleep(min(_retry_after(resp.headers.get("Retry-After")), self.THROTTLE_MAX_WAIT_S))
        if resp.status >= 400:
            try:
                message = json.loads(text).get("message", text)
            except (ValueError, AttributeError):
                message = text
            raise ApiError(resp.status, method, path, str(message)[:500])
        return json.loads(text) if text else {}

    # -- children ---------------------------------------------------------------------------------
    async def apply(self, manifest: dict[str, Any], *, field_manager: str = FIELD_MANAGER,
                    force: bool = True) -> dict[str, Any]:
        """Server-side apply (creates a missing object); returns the live object. `force` takes over fields
        other managers own; without it the API server answers 409 for them."""
        kind, meta = kind_of(manifest), manifest["metadata"]
        base = collection_path(kind.api_version, kind.plural, meta["namespace"])
        params = {"fieldManager": field_manager, "force": "true" if force else "false"}
        return await self._request("PATCH", f"{base}/{meta['name']}", body=manifest, params=params,
                                   content_type=APPLY_CONTENT_TYPE)

    async def get(self, kind: Kind, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return await self._request("GET", f"{collection_path(kind.api_version, kind.plural, namespace)}/{name}")
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    async def list(self, kind: Kind, namespace: str, selector: dict[str, str]) -> list[dict[str, Any]] | None:
        """Objects carrying every label of `selector`; None when the cluster does not serve the kind (no CRD)."""
        return await self.list_labelled(kind, [namespace], dict(selector))

    async def list_labelled(self, kind: Kind, namespaces: list[str],
                            selector: dict[str, str | None]) -> list[dict[str, Any]] | None:
        """Objects of `kind` in `namespaces` (none: the whole cluster, one request) carrying the selector's
        labels (a None value: the label with any value). None when the cluster does not serve the kind."""
        query = ",".join(k if v is None else f"{k}={v}" for k, v in selector.items())
        prefix = "/api/v1" if kind.api_version == "v1" else f"/apis/{kind.api_version}"
        paths = [collection_path(kind.api_version, kind.plural, ns) for ns in namespaces] or [f"{prefix}/{kind.plural}"]
        items: list[dict[str, Any]] = []
        for path in paths:
            try:
                out = await self._request("GET", path, params={"labelSelector": query})
            except ApiError as e:
                if e.status == 404:
                    return None
                raise
            items += out.get("items", [])
        # Filter again: a selector is a request, and a wrong delete costs more than a second look.
        items = [i for i in items if all(
            k in labels and (v is None or labels[k] == v)
            for labels in [(i.get("metadata") or {}).get("labels") or {}] for k, v in selector.items())]
        for item in items:  # list items carry no apiVersion/kind
            item.setdefault("apiVersion", kind.api_version)
            item.setdefault("kind", kind.kind)
        return items

    async def delete(self, kind: Kind, namespace: str, name: str) -> None:
        path = f"{collection_path(kind.api_version, kind.plural, namespace)}/{name}"
        try:
            await self._request("DELETE", path, body={"kind": "DeleteOptions", "apiVersion": "v1",
                                                      "propagationPolicy": "Background"})
        except ApiError as e:
            if e.status != 404:
                raise

    # -- shared objects (cache_sync.py): created once, then co-owned, never applied over --------------------
    async def create(self, kind: Kind, manifest: dict[str, Any]) -> dict[str, Any]:
        """POST a new object; ApiError 409 when it exists."""
        path = collection_path(kind.api_version, kind.plural, manifest["metadata"]["namespace"])
        return await self._request("POST", path, body=manifest, params={"fieldManager": FIELD_MANAGER})

    async def patch(self, kind: Kind, namespace: str, name: str, body: dict[str, Any],
                    content_type: str = MERGE_CONTENT_TYPE) -> dict[str, Any]:
        path = f"{collection_path(kind.api_version, kind.plural, namespace)}/{name}"
        return await self._request("PATCH", path, body=body, params={"fieldManager": FIELD_MANAGER},
                                   content_type=content_type)

    async def delete_unchanged(self, kind: Kind, namespace: str, name: str, resource_version: str) -> bool:
        """Delete the object only if nobody wrote it since `resource_version`; False if someone did."""
        path = f"{collection_path(kind.api_version, kind.plural, namespace)}/{name}"
        try:
            await self._request("DELETE", path, body={
                "kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background",
                "preconditions": {"resourceVersion": resource_version}})
        except ApiError as e:
            if e.status == 409:
                return False
            if e.status != 404:
                raise
        return True

    async def read_log(self, namespace: str, pod: str, container: str, tail_lines: int) -> str | None:
        """The last lines of a container's log; None where it cannot be read (no such pod, no RBAC)."""
        assert self._session is not None, "use `async with KubeApi(...)`"
        path = f"{collection_path('v1', 'pods', namespace)}/{pod}/log"
        params = {"container": container, "tailLines": str(tail_lines)}
        try:
            async with self._session.get(self._server + path, params=params) as resp:
                return await resp.text() if resp.status < 400 else None
        except (aiohttp.ClientError, TimeoutError):
            return None

    async def patch_if_unchanged(self, kind: Kind, namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        """A JSON merge patch carrying metadata.resourceVersion: the API server refuses it with 409 (ApiError)
        if the object changed since that version (optimistic concurrency, as an update would be)."""
        assert patch.get("metadata", {}).get("resourceVersion"), "an unguarded patch"
        return await self._request("PATCH", f"{collection_path(kind.api_version, kind.plural, namespace)}/{name}",
                                   body=patch, content_type=MERGE_CONTENT_TYPE)

    # -- the endpoint -----------------------------------------------------------------------------
    async def list_endpoints(self, namespaces: list[str]) -> list[dict[str, Any]]:
        """Every InferenceEndpoint in the namespaces (no namespaces: the whole cluster)."""
        prefix = f"/apis/{ENDPOINT_KIND.api_version}"
        paths = [f"{prefix}/namespaces/{ns}/{PLURAL}" for ns in namespaces] or [f"{prefix}/{PLURAL}"]
        items = []
        for path in paths:
            items += (await self._request("GET", path)).get("items", [])
        for item in items:
            item.setdefault("apiVersion", ENDPOINT_KIND.api_version)
            item.setdefault("kind", ENDPOINT_KIND.kind)
        return items

    async def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> dict[str, Any]:
        """Merge-patch the status subresource; the loop never writes an endpoint's spec."""
        base = collection_path(ENDPOINT_KIND.api_version, ENDPOINT_KIND.plural, namespace)
        return await self._request("PATCH", f"{base}/{name}/status", body={"status": status},
                                   content_type=MERGE_CONTENT_TYPE)

    # -- events -----------------------------------------------------------------------------------------
    async def post_event(self, involved: dict[str, Any], type_: str, reason: str, message: str, now: str,
                         logger: logging.Logger | logging.LoggerAdapter) -> None:
        """A core/v1 Event about `involved` (an object reference). Events are auxiliary: a failure is logged."""
        event = event_manifest(involved, type_, reason, message, now)
        try:
            await self._request("POST", collection_path("v1", "events", involved["namespace"]), body=event)
        except (ApiError, aiohttp.ClientError, TimeoutError) as e:
            logger.warning("could not post event %s %s: %s", type_, reason, e)


def event_manifest(involved: dict[str, Any], type_: str, reason: str, message: str, now: str) -> dict[str, Any]:
    """A core/v1 Event as `kubectl describe` shows it (the API server names it from generateName)."""
    if len(message) > MAX_EVENT_MESSAGE:
        message = message[:MAX_EVENT_MESSAGE - 3] + "..."
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{involved['name']}.", "namespace": involved["namespace"]},
        "involvedObject": involved,
        "type": type_,
        "reason": reason,
        "message": message,
        "source": {"component": FIELD_MANAGER},
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }
