"""kmock's in-memory Kubernetes API with the API server's bookkeeping the operator's loop relies on.

kmock (by kopf's author) stores objects as plain JSON and merges every PATCH. `ApiServer` adds:
- a uid on create, a new resourceVersion on every write (kopf guards its patches with a JSON-patch test of
  resourceVersion and waits for the version it wrote), and a name from `generateName` (kopf posts its events
  with one; kmock alone would file them all under one missing name, and the second would collide);
- server-side apply (`application/apply-patch+yaml`) with field ownership in `metadata.managedFields`
  (kube_ssa.py): an apply creates a missing object, removes the fields its manager dropped, and conflicts
  with other managers unless forced; other writes take over the fields they change;
- a write that changes nothing keeps the object's resourceVersion and sends no watch event, as the API
  server's no-op writes do (the operator's resync tells objects at rest by their versions);
- optimistic concurrency: a write that names a resourceVersion other than the stored one gets 409 Conflict
  (leader election's Lease updates rely on it);
- label selectors on lists (`k=v`, `k!=v`, `k`, `!k`), as the API server filters them (kmock returns every
  object of the kind);
- resource types left out, as a cluster without a CRD serves them (`absent`), and writes refused as an
  admission webhook or a validation rule would refuse them (`refuse`).

kmock keeps every request it served, for tests' assertions, and routes each new one by scanning that history
once per reaction: cost grows with the requests served so far. `record_requests = False` forgets a request
once it is answered (watches stay while they stream), so a long run (benchmarks/operator_scale.py) stays linear.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
import uuid
from typing import Any

import attrs
import kmock
import kube_ssa

APPLY_CONTENT_TYPE = "application/apply-patch+yaml"
_versions = itertools.count(1)


@attrs.frozen
class Invalid(kmock.KubernetesError):
    """What the API server answers a write it refuses (a failed validation or admission webhook)."""

    status: int = 422
    reason: str = "Invalid"
    message: str = "invalid"


@attrs.frozen
class ApplyConflict(kmock.KubernetesError):
    status: int = 409
    reason: str = "Conflict"
    message: str = "conflict"


class ApiServer(kmock.KubernetesEmulator):
    absent: frozenset[str] = frozenset()  # plurals served as unknown resource types (no CRD installed)
    refuse: dict[tuple[str, str], str] = {}  # noqa: RUF012 - set per test: (plural, name) -> the refusal message

    record_requests: bool = True  # False: forget answered requests (no assertions on them; long runs stay fast)
    _writes: asyncio.Lock | None = None

    async def _handle(self, request: Any) -> Any:
        if self.record_requests:
            return await self._answer(request)
        try:
            return await self._answer(request)
        finally:
            # By identity: kmock's routing finds a request in its history by `is`, never by equality.
            for i in range(len(self._requests) - 1, -1, -1):
                if self._requests[i] is request:
                    del self._requests[i]
                    break

    async def _answer(self, request: Any) -> Any:
        if request.resource is not None and request.resource.plural in self.absent:
            raise kmock.KubernetesResourceNotFoundError()
        if request.resource is None or request.action not in (kmock.action.CREATE, kmock.action.UPDATE):
            return await super()._handle(request)
        if self._writes is None:
            self._writes = asyncio.Lock()
        # One write at a time: ownership is computed from the stored object, which must not change meanwhile.
        async with self._writes:
            return await super()._handle(self._bookkeeping(request))

    async def _serve_list(self, request: Any) -> Any:
        payload = await super()._serve_list(request)
        selector = request.params.get("labelSelector")
        if selector:
            payload["items"] = [o for o in payload["items"]
                                if _selects(selector, (o.get("metadata") or {}).get("labels") or {})]
        return payload

    def _stored(self, request: Any) -> dict[str, Any] | None:
        key = (request.resource, request.namespace, request.name)
        if key in self.objects and not self.objects[key].deleted:
            return self.objects[key].raw
        return None

    def _bookkeeping(self, request: Any) -> Any:
        """The request as kmock should store it; raises what the API server would answer instead."""
        data = request.data
        if request.action == kmock.action.CREATE and isinstance(data, dict):
            name = (data.get("metadata") or {}).get("name") or request.name
            self._check_refusal(request.resource.plural, name, data)
        if request.action == kmock.action.UPDATE and request.subresource is None and isinstance(data, dict):
            self._check_refusal(request.resource.plural, request.name, data)
            old = self._stored(request)
            manager = request.params.get("fieldManager") or "unknown"
            content_type = request.headers.get("Content-Type", "")
            if content_type.startswith(APPLY_CONTENT_TYPE):
                force = request.params.get("force") == "true"
                try:
                    new = kube_ssa.apply(old, data, manager, force)
                except kube_ssa.Conflict as e:
                    raise ApplyConflict(message=str(e)) from None
                if old is None:  # an apply creates what is missing
                    _rewrite(request, action=kmock.action.CREATE, method=kmock.method.POST, data=new)
                    data = new
                else:
                    data = kube_ssa.merge_patch(old, new)
                    _rewrite(request, data=data)
            elif old is not None:
                expected = (data.get("metadata") or {}).get("resourceVersion")
                if expected is not None and expected != (old.get("metadata") or {}).get("resourceVersion"):
                    raise ApplyConflict(message="the object has been modified; please apply your changes to the "
                                                "latest version and try again")
                merged = _merged(old, data)
                data = kube_ssa.merge_patch(old, kube_ssa.update(old, merged, manager))
                _rewrite(request, data=data)
        version = str(next(_versions))
        if request.action == kmock.action.UPDATE and isinstance(data, dict) and request.subresource in (None, "status"):
            old = self._stored(request)
            if old is not None and _without_version(_merged(old, data)) == _without_version(old):
                # A no-op write: the API server answers the object as stored, keeps its resourceVersion and
                # tells no watcher (kmock would store it again and send MODIFIED to every watch).
                _rewrite(request, action=kmock.action.FETCH, method=kmock.method.GET)
                return request
        if isinstance(data, dict):
            meta = data.setdefault("metadata", {})
            meta["resourceVersion"] = version
            if request.action == kmock.action.CREATE:
                meta.setdefault("uid", str(uuid.uuid4()))
                if not meta.get("name") and meta.get("generateName"):
                    meta["name"] = meta["generateName"] + secrets.token_hex(3)
        elif isinstance(data, list):  # a JSON patch: its own test ops come first
            data.append({"op": "add", "path": "/metadata/resourceVersion", "value": version})
        return request

    def _check_refusal(self, plural: str, name: str | None, data: dict[str, Any]) -> None:
        message = self.refuse.get((plural, name or ""))
        if message is not None:
            kind = data.get("kind", plural)
            raise Invalid(message=f'{kind} "{name}" is invalid: {message}')


def _selects(selector: str, labels: dict[str, str]) -> bool:
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            ok = labels.get(key) != value
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            ok = labels.get(key) == value
        elif term.startswith("!"):
            ok = term[1:] not in labels
        else:
            ok = term in labels
        if not ok:
            return False
    return True


def _rewrite(request: Any, **fields: Any) -> None:
    # NOTE: in place, not attrs.evolve(): kmock routes only the request objects it recorded itself.
    for name, value in fields.items():
        object.__setattr__(request, name, value)


def _without_version(obj: dict[str, Any]) -> dict[str, Any]:
    meta = {k: v for k, v in (obj.get("metadata") or {}).items() if k != "resourceVersion"}
    return {**obj, "metadata": meta}


def _merged(old: Any, patch: Any) -> Any:
    """A JSON merge patch (RFC 7386) applied: None removes a key."""
    if not isinstance(patch, dict):
        return patch
    out = dict(old) if isinstance(old, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = _merged(out.get(key), value)
    return out
