"""The kopf loop: thin handlers over reconcile() (manifests) and endpoint_status() (status).

One pass (`Loop.converge`): parse the endpoint, server-side apply every child, prune the children the spec no
longer produces, fold the children's status into the endpoint's. It runs on create/update/resume, on a periodic resync
(so deleted children come back and drift is undone), and on every event of a child workload (a deleted one
is re-applied at once; a status change is folded into the endpoint's status), and on every event of a shared model
cache's Job (cache_sync.py). Deletion is left to the garbage collector: every child has a controller
ownerReference (a shared cache, one non-controller reference per endpoint using it), so the loop needs no
finalizer.

NOTE: the periodic resync is one operator-wide task, not a `@kopf.timer`: kopf makes a finalizer mandatory
for any resource with timers or daemons (it must stop them before the object goes), and a finalizer would
make a stopped operator block every `kubectl delete ie`.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import kopf

from . import cache_sync, drift, engine_probe
from .apply import CHILD_KINDS, ENDPOINT_KIND, POD_KIND, SECRET_KIND, ApiError, KubeApi, kind_of
from .children import WORKLOAD_KINDS, Problem, apply_children, create_once, owned_by
from .config import OperatorConfig
from .disaggregation import kv_secret, prefill_name
from .meta import ENDPOINT_LABEL, ROLE_LABEL, SERVING, standby_name
from .model_cache import MODEL_CACHE_LABEL
from .operator_metrics import OperatorMetrics
from .policy import check as check_policy
from .reconcile import reconcile
from .routing import pool_of
from .scale_in_hold import hold_scale_in, replicas_to_hold
from .served_model import SERVED_MODEL_KIND, SM_PLURAL, served_model_status, versions_of
from .spec import API_VERSION, GROUP, KIND, PLURAL, VERSION, InferenceEndpoint, SpecError, parse_endpoint
from .status import adapters_pending, changed, endpoint_status, invalid_status, status_patch, transitions
from .workload import LWS_API_VERSION

Object = dict[str, Any]
LoginFn = Callable[..., Any]  # a kopf login handler: returns a kopf.ConnectionInfo (or None), maybe awaitable


class InvalidEndpoint(Exception):
    """The endpoint's spec does not validate; its status already says why."""


def default_login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """In a pod: the service account. Elsewhere: the kubeconfig (static credentials only)."""
    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


def _plain(body: Any) -> Object:
    """kopf's body views as plain JSON data."""
    return json.loads(json.dumps(body, default=dict))


class ChildrenNotApplied(Exception):
    """Some children could not be applied; the endpoint's status says which and why."""


@dataclass
class Loop:
    cfg: OperatorConfig = field(default_factory=OperatorConfig)
    credentials: kopf.ConnectionInfo | None = None  # set by the login handler
    resync_task: asyncio.Task[None] | None = None
    _locks: defaultdict[tuple[str, str], asyncio.Lock] = field(default_factory=lambda: defaultdict(asyncio.Lock))
    # Per endpoint, from its last applying pass: the kinds the cluster does not serve (their CRD is not
    # installed), and the children that could not be applied. Passes that only fold status keep reporting them.
    _missing: dict[tuple[str, str], frozenset[str]] = field(default_factory=dict)
    _problems: dict[tuple[str, str], tuple[Problem, ...]] = field(default_factory=dict)
    _pods_unreadable: bool = False  # logged once: without RBAC for pods, Scheduled stays Unknown
    metrics: OperatorMetrics = field(default_factory=OperatorMetrics)
    # Per endpoint: what the last resync round saw of it (drift.py), to skip endpoints at rest.
    _seen: dict[tuple[str, str], drift.Seen] = field(default_factory=dict)
    background: set[asyncio.Task[None]] = field(default_factory=set)  # coalesced passes after child events
    resync_round: Callable[[KubeApi, Any], Awaitable[None]] | None = None  # set by build_registry
    # Passes at once, over all endpoints: hundreds of endpoints created together (an Argo CD sync, an operator
    # restart) queue here instead of flooding the API server until its requests time out.
    max_concurrent_passes: int = 16
    _passes: asyncio.Semaphore | None = None

    def api(self) -> KubeApi:
        if self.credentials is None:
            raise kopf.TemporaryError("not logged in to the API server yet", delay=1)
        return KubeApi(self.credentials, on_request=self.metrics.count_request)

    async def converge(self, api: KubeApi, body: Any, logger: logging.Logger | logging.LoggerAdapter,
                       apply: bool = True) -> Object:
        """One pass; returns the status written ({} if the endpoint is gone). `apply=False` only folds the
        children's status (and moves the scale-in hold). Raises ChildrenNotApplied, after writing the status,
        when a child could not be applied."""
        meta = _plain(body)["metadata"]
        key = (meta.get("namespace") or "default", meta["name"])
        if self._passes is None:
            self._passes = asyncio.Semaphore(self.max_concurrent_passes)
        async with self._passes:
            return await self._timed_converge(api, body, logger, apply, key)

    async def _timed_converge(self, api: KubeApi, body: Any, logger: logging.Logger | logging.LoggerAdapter,
                              apply: bool, key: tuple[str, str]) -> Object:
        started, result = time.monotonic(), "error"
        try:
            status = await self._converge(api, body, logger, apply)
            result = "ok"
            self.metrics.set_phase(key, status.get("phase") if status else None)
            return status
        except InvalidEndpoint:
            result = "invalid"
            self.metrics.set_phase(key, "Failed")
            raise
        finally:
            self.metrics.observe_reconcile(result, time.monotonic() - started)

    async def _converge(self, api: KubeApi, body: Any, logger: logging.Logger | logging.LoggerAdapter,
                        apply: bool) -> Object:
        meta = _plain(body)["metadata"]
        key = (meta.get("namespace") or "default", meta["name"])
        async with self._locks[key]:
            # The endpoint as stored now, not as the (possibly older) body saw it: a resync's list may predate
            # a pass that just ran; conditions keep their transition times; an event is posted once.
            fresh = await api.get(ENDPOINT_KIND, *key)
            if fresh is None or fresh["metadata"].get("uid") != meta.get("uid", fresh["metadata"].get("uid")):
                return {}  # deleted meanwhile (or replaced by a new endpoint of the same name)
            if fresh["metadata"].get("deletionTimestamp"):
                return {}  # being deleted: the garbage collector takes the children away, nothing is re-applied
            doc = _plain(fresh)
            meta = doc["metadata"]
            previous = doc.get("status") or {}
            try:
                ep = parse_endpoint({k: doc.get(k) for k in ("apiVersion", "kind", "metadata", "spec")})
                check_policy(ep, self.cfg)  # a forbidden endpoint gets nothing applied, not even its ConfigMap
                cache = await cache_sync.observe(api, ep, logger)
                # May refuse what this operator's settings cannot serve.
                manifests = reconcile(ep, self.cfg, awaiting_model=cache is not None and cache.hold)
            except SpecError as e:
                status = invalid_status(meta.get("generation"), str(e), previous, _now(), reason=e.reason)
                await self._write_status(api, body, key, status, previous, logger)
                raise InvalidEndpoint(str(e)) from None
            pods = await self._serving_pods(api, ep, logger)
            if ep.spec.scaling is not None and pods:
                hold = replicas_to_hold(pods, await self._current_replicas(api, ep, manifests))
                manifests = hold_scale_in(ep, manifests, hold)
            if apply:
                # Children the spec no longer produces go first: a ScaledObject is gone before the workload's
                # fixed count is applied, so KEDA's HPA does not fight over it meanwhile.
                await self._prune(api, ep, manifests, logger)
                # A shared model cache (claim and fetch Job) is created once and co-owned, never applied over.
                own = []
                for manifest in manifests:
                    if cache_sync.is_shared(manifest):
                        await cache_sync.ensure(api, manifest, cache, logger)
                    else:
                        own.append(manifest)
                # The pools' KV key, before the pods that mount it: random, made once (disaggregation.py).
                secret = await create_once(api, SECRET_KIND, kv_secret(ep), logger) \
                    if ep.spec.disaggregation is not None else None
                applied = await apply_children(api, ep.metadata.uid, own, logger)
                applied.problems += [secret] if secret is not None else []
                self._missing[key], self._problems[key] = frozenset(applied.missing), tuple(applied.problems)
                await cache_sync.release_unused(api, ep, manifests, logger)
            else:
                await self._move_hold(api, ep, manifests, logger)
            status = await self._fold(api, ep, manifests, previous, pods, key, logger, cache)
            await self._write_status(api, body, key, status, previous, logger)
            if apply and self._problems[key]:
                raise ChildrenNotApplied("; ".join(p.message for p in self._problems[key]))
            return status

    async def _current_replicas(self, api: KubeApi, ep: InferenceEndpoint, manifests: list[Object]) -> int | None:
        """The serving workload's live replica count (the autoscaler's last choice), if it is the endpoint's."""
        m = next(m for m in manifests if m["kind"] in WORKLOAD_KINDS and m["metadata"]["name"] == ep.name)
        try:
            live = await api.get(kind_of(m), ep.namespace, ep.name)
        except ApiError:
            return None
        if live is None or not owned_by(live, ep.metadata.uid):
            return None
        return (live.get("spec") or {}).get("replicas")

    async def _move_hold(self, api: KubeApi, ep: InferenceEndpoint, manifests: list[Object],
                         logger: logging.Logger | logging.LoggerAdapter) -> None:
        """Apply the ScaledObject alone when the scale-in hold moved (a replica started or finished loading)."""
        so = next((m for m in manifests if m["kind"] == "ScaledObject"), None)
        if so is None or "ScaledObject" in self._missing.get((ep.namespace, ep.name), frozenset()):
            return
        live = await api.get(kind_of(so), ep.namespace, so["metadata"]["name"])
        if live is None or not owned_by(live, ep.metadata.uid):
            return  # not applied yet, or someone else's: the next applying pass decides
        if (live.get("spec") or {}).get("minReplicaCount") != so["spec"]["minReplicaCount"]:
            logger.info("scale-in hold: minReplicaCount %s", so["spec"]["minReplicaCount"])
            await apply_children(api, ep.metadata.uid, [so], logger)

    async def _prune(self, api: KubeApi, ep: InferenceEndpoint, manifests: list[Object],
                     logger: logging.Logger | logging.LoggerAdapter) -> None:
        """Delete the children this endpoint owns that the spec no longer produces."""
        if not ep.metadata.uid:  # nothing could prove ownership
            return
        wanted = {(m["apiVersion"], m["kind"], m["metadata"]["name"]) for m in manifests}
        for kind in CHILD_KINDS:
            for obj in await api.list(kind, ep.namespace, {ENDPOINT_LABEL: ep.name}) or []:
                name = obj["metadata"]["name"]
                if (kind.api_version, kind.kind, name) not in wanted and owned_by(obj, ep.metadata.uid):
                    logger.info("pruning %s %s: the spec no longer produces it", kind.kind, name)
                    await api.delete(kind, ep.namespace, name)

    async def _fold(self, api: KubeApi, ep: InferenceEndpoint, manifests: list[Object], previous: Object,
                    pods: list[Object] | None, key: tuple[str, str],
                    logger: logging.Logger | logging.LoggerAdapter,
                    cache: cache_sync.SharedCache | None = None) -> Object:
        missing = self._missing.get(key, frozenset())

        async def live(name: str, kinds: tuple[str, ...]) -> Object | None:
            m = next((m for m in manifests if m["kind"] in kinds and m["metadata"]["name"] == name), None)
            if m is None or m["kind"] in missing:
                return None
            obj = await api.get(kind_of(m), ep.namespace, name)
            # Only the endpoint's own: an object of the same name that belongs to someone else says nothing.
            return obj if obj is not None and owned_by(obj, ep.metadata.uid) else None

        workloads = ("Deployment", "LeaderWorkerSet")
        serving = await live(ep.name, workloads)
        pods = pods if serving is not None else []
        # Which adapters each ready replica has loaded: only the engines know (engine_probe.py).
        adapters = await engine_probe.probe(pods, logger) \
            if ep.spec.adapters and pods is not None else None
        return endpoint_status(
            ep, serving=serving, standby=await live(standby_name(ep), workloads),
            prefill=await live(prefill_name(ep), workloads) if ep.spec.disaggregation else None,
            scaled_object=await live(ep.name, ("ScaledObject",)),
            pods=pods, missing_kinds=missing,
            problems=self._problems.get(key, ()), previous=previous, now=_now(), cfg=self.cfg,
            model_cache=cache.state if cache is not None else None, adapters=adapters,
            inference_pool=await live(ep.name, ("InferencePool",)) if pool_of(ep) is not None else None)

    async def _serving_pods(self, api: KubeApi, ep: InferenceEndpoint,
                            logger: logging.Logger | logging.LoggerAdapter) -> list[Object] | None:
        """The serving pods (scheduling and model load), or None where the operator may not read pods."""
        try:
            return await api.list(POD_KIND, ep.namespace, {ENDPOINT_LABEL: ep.name, ROLE_LABEL: SERVING}) or []
        except ApiError as e:
            if e.status != 403:
                raise
            if not self._pods_unreadable:
                logger.warning("may not list pods (%s): the Scheduled condition stays Unknown", e)
                self._pods_unreadable = True
            return None

    async def _write_status(self, api: KubeApi, body: Any, key: tuple[str, str], status: Object,
                            previous: Object, logger: logging.Logger | logging.LoggerAdapter) -> None:
        if not changed(status, previous):
            return
        await api.patch_status(*key, status_patch(status, previous))
        # Posted by our own client, not kopf.event(): that needs kopf's per-task context, which the resync
        # task does not have.
        involved = {"apiVersion": API_VERSION, "kind": KIND, "name": key[1], "namespace": key[0],
                    "uid": _plain(body)["metadata"].get("uid")}
        for event in transitions(previous, status):
            await api.post_event(involved, event.type, event.reason, event.message, _now(), logger)


MAX_RETRY_DELAY_S = 300.0


def retry_delay(base_seconds: float, retry: int) -> float:
    """Exponential backoff: base, 2 x base, 4 x base, ... at most MAX_RETRY_DELAY_S."""
    return min(base_seconds * 2 ** min(retry, 16), MAX_RETRY_DELAY_S)


def build_registry(loop: Loop, *, namespaces: list[str] | None = None, login: LoginFn = default_login,
                   resync_seconds: float = 60.0, retry_seconds: float = 10.0,
                   debounce_seconds: float = 0.25) -> kopf.OperatorRegistry:
    """All handlers, in a registry of their own (tests run several operators in one process)."""
    registry = kopf.OperatorRegistry()
    endpoint = (GROUP, VERSION, PLURAL)

    @kopf.on.login(registry=registry)
    async def sluice_login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        info = login(**kwargs)
        if inspect.isawaitable(info):
            info = await info
        loop.credentials = info or loop.credentials
        return info

    async def converge(body: Any, logger: Any, retry: int) -> None:
        try:
            async with loop.api() as api:
                await loop.converge(api, body, logger)
        except InvalidEndpoint as e:
            raise kopf.PermanentError(str(e)) from None
        except ChildrenNotApplied as e:
            # The status already says why; retry the pass, less often the longer it keeps failing.
            raise kopf.TemporaryError(str(e), delay=retry_delay(retry_seconds, retry)) from None
        # Anything else (API errors, timeouts) is retried by kopf after `backoff` seconds.

    @kopf.on.resume(*endpoint, registry=registry, backoff=retry_seconds)
    @kopf.on.create(*endpoint, registry=registry, backoff=retry_seconds)
    @kopf.on.update(*endpoint, registry=registry, backoff=retry_seconds)
    async def endpoint_changed(body: kopf.Body, logger: Any, retry: int = 0, **_: Any) -> None:
        await converge(body, logger, retry)

    async def resync_round(api: KubeApi, logger: Any) -> None:
        """One round (drift.py): a few lists for every endpoint at once, then a pass only where something
        changed, a status-only pass where only status moved."""
        scope = list(namespaces or [])
        bodies = [b for b in await api.list_endpoints(scope) if not b["metadata"].get("deletionTimestamp")]
        keys = {(b["metadata"].get("namespace") or "default", b["metadata"]["name"]) for b in bodies}
        loop.metrics.keep_only(keys)
        children: list[Object] = []
        for kind in CHILD_KINDS:
            children += await api.list_labelled(kind, scope, {ENDPOINT_LABEL: None}) or []
        try:
            pods = await api.list_labelled(POD_KIND, scope, {ENDPOINT_LABEL: None, ROLE_LABEL: SERVING}) or []
        except ApiError as e:
            if e.status != 403:
                raise
            pods = []  # without RBAC for pods: status-only passes follow workload events alone
        seen = drift.observe(bodies, children, pods)
        loop._seen = {k: v for k, v in loop._seen.items() if k in keys}
        for body in bodies:
            key = (body["metadata"].get("namespace") or "default", body["metadata"]["name"])
            need = drift.needed(loop._seen.get(key), seen[key])
            if loop._problems.get(key):
                need = "apply"  # a child could not be applied last time: try again
            elif need is None and adapters_pending(body.get("status")):
                # Adapters load (or fail to) inside the engines, which no watch sees: ask again each round
                # until every ready replica has them.
                need = "fold"
            loop._seen[key] = seen[key]
            if need is None:
                continue
            try:
                await loop.converge(api, body, logger, apply=need == "apply")
            except InvalidEndpoint:
                pass  # the status says why; the next spec change gets a fresh try
            except ChildrenNotApplied as e:
                logger.warning("resync of %s: %s", body["metadata"]["name"], e)
            except Exception:  # one endpoint's trouble must not stop the others' resync
                loop._seen.pop(key, None)  # look again next round
                logger.exception("resync of %s failed", body["metadata"]["name"])

    loop.resync_round = resync_round  # one round on demand (tests, benchmarks/operator_scale.py)

    async def resync_forever(logger: Any) -> None:
        while True:
            await asyncio.sleep(resync_seconds)
            started = time.monotonic()
            try:
                async with loop.api() as api:
                    await resync_round(api, logger)
                loop.metrics.resync_rounds.observe(time.monotonic() - started)
            except Exception:
                logger.exception("resync failed; next try in %s s", resync_seconds)

    @kopf.on.startup(registry=registry)
    async def start_resync(logger: Any, **_: Any) -> None:
        loop.resync_task = asyncio.create_task(resync_forever(logger))

    @kopf.on.cleanup(registry=registry)
    async def stop_resync(**_: Any) -> None:
        for task in list(loop.background):
            task.cancel()
        if loop.resync_task is not None:
            loop.resync_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loop.resync_task

    # Child events come in bursts (a rollout moves a workload's status many times a second): they are
    # coalesced per endpoint into one pass `debounce_seconds` after the first, applying if any of them was a
    # deletion.
    pending: dict[tuple[str, str], tuple[str, bool]] = {}  # endpoint -> (owner uid, apply)

    async def coalesced_pass(key: tuple[str, str], logger: Any) -> None:
        await asyncio.sleep(debounce_seconds)
        uid, apply = pending.pop(key)
        # The uid makes converge skip an endpoint that was deleted, or replaced by one of the same name.
        body = {"metadata": {"namespace": key[0], "name": key[1], "uid": uid}}
        try:
            async with loop.api() as api:
                await loop.converge(api, body, logger, apply=apply)
        except (InvalidEndpoint, ChildrenNotApplied):
            pass  # the status says why; the endpoint's own handler or the resync retries
        except Exception:
            logger.exception("pass over %s/%s after a child's event failed; the resync retries", *key)

    async def child_event(type: str | None, body: kopf.Body, logger: Any, **_: Any) -> None:
        owner = next((r for r in body.metadata.get("ownerReferences") or []
                      if r.get("kind") == KIND and r.get("controller")), None)
        if owner is None:
            return
        key = (body.metadata.namespace, owner["name"])
        apply = type == "DELETED"  # a deleted child is applied again; anything else only moves the status
        if key in pending:
            uid, applying = pending[key]
            pending[key] = (owner.get("uid") or uid, applying or apply)
            return
        pending[key] = (owner.get("uid") or "", apply)
        task = asyncio.create_task(coalesced_pass(key, logger))
        loop.background.add(task)
        task.add_done_callback(loop.background.discard)

    async def shared_cache_event(body: kopf.Body, logger: Any, **_: Any) -> None:
        """A shared model cache's Job moved (a download finished or failed): every endpoint using it converges,
        so their workloads scale up as soon as the model is there."""
        owners = [r for r in body.metadata.get("ownerReferences") or [] if r.get("kind") == KIND]
        async with loop.api() as api:
            for owner in owners:
                parent = await api.get(ENDPOINT_KIND, body.metadata.namespace, owner["name"])
                if parent is None or parent["metadata"].get("deletionTimestamp") or \
                        parent["metadata"].get("uid") != owner.get("uid"):
                    continue
                try:
                    await loop.converge(api, parent, logger)
                except InvalidEndpoint:
                    pass

    kopf.on.event("batch", "v1", "jobs", labels={MODEL_CACHE_LABEL: kopf.PRESENT}, registry=registry,
                  id="model_cache_job_event")(shared_cache_event)

    # ServedModels (model versions by weight, served_model.py): their status follows their own events and those
    # of the InferenceEndpoints they name. Nothing is applied for them: the gateway reads them itself.
    async def refresh_served_models(namespace: str, wanted: Callable[[Object], bool], logger: Any) -> None:
        async with loop.api() as api:
            models = [m for m in await api.list_labelled(SERVED_MODEL_KIND, [namespace], {}) or [] if wanted(m)]
            if not models:
                return
            endpoints = {e["metadata"]["name"]: e for e in await api.list_endpoints([namespace])}
            for m in models:
                status = served_model_status(m, endpoints, _now())
                if status != m.get("status"):
                    try:
                        await api.patch(SERVED_MODEL_KIND, namespace, f"{m['metadata']['name']}/status",
                                        {"status": status})
                    except ApiError as e:
                        if e.status != 404:  # deleted meanwhile
                            raise

    async def served_model_event(type: str | None, body: kopf.Body, logger: Any, **_: Any) -> None:
        if type == "DELETED":
            return
        name = body.metadata.name
        try:
            await refresh_served_models(body.metadata.namespace, lambda m: m["metadata"]["name"] == name, logger)
        except Exception:
            logger.exception("status of ServedModel %s not written; its next event retries", name)

    async def endpoint_event(body: kopf.Body, logger: Any, **_: Any) -> None:
        name = body.metadata.name
        try:
            await refresh_served_models(body.metadata.namespace, lambda m: name in versions_of(m), logger)
        except Exception:
            logger.exception("status of the ServedModels naming %s not written; their next event retries", name)

    kopf.on.event(GROUP, VERSION, SM_PLURAL, registry=registry, id="served_model_event")(served_model_event)
    kopf.on.event(*endpoint, registry=registry, id="served_model_versions_event")(endpoint_event)

    children = {ENDPOINT_LABEL: kopf.PRESENT}
    kopf.on.event("apps", "v1", "deployments", labels=children, registry=registry)(child_event)
    group, version = LWS_API_VERSION.split("/")
    kopf.on.event(group, version, "leaderworkersets", labels=children, registry=registry,
                  id="lws_event")(child_event)
    return registry


def operator_settings() -> kopf.OperatorSettings:
    settings = kopf.OperatorSettings()
    settings.posting.reporting_component = "sluice-operator"
    # Resources are resolved once at start: no CRD or namespace watches, so no RBAC for them.
    settings.scanning.disabled = True
    # Long-lived watches die silently behind some load balancers: make the server end them, and reconnect.
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.watching.connect_timeout = 30
    return settings
