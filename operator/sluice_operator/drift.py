"""What the periodic resync must do for each endpoint, from a few list calls for all of them.

A resync used to run a whole pass over every endpoint every period: a read of the endpoint, a read and an
apply per child, a list per child kind for pruning, the status reads: some 30 API calls per endpoint per
minute at rest, and a serial round that could not keep up with hundreds of endpoints. Now one round lists
the endpoints, each child kind and the serving pods once (per watched namespace, or once for the
cluster), and compares what it sees with what the previous round saw:

- nothing changed: nothing to do (an endpoint at rest costs no request of its own);
- the endpoint's spec (generation), or a child's spec, changed, or a child is gone: a full pass (apply,
  prune, status), which undoes drift and recreates what was deleted;
- only status moved (a workload's or ScaledObject's status, a serving pod): a status-only pass.

A child's "spec version" is its metadata.generation where the kind keeps one (it moves on spec changes
only: Deployments, LeaderWorkerSets, ScaledObjects, PodDisruptionBudgets, ...), else its resourceVersion
(ConfigMaps and Services have no status to move it). After a pass that changed something the next round
sees new versions and runs one more pass, which changes nothing; then the endpoint is at rest.

Events still drive the fast path: endpoint create/update, child workload events (handlers.py).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from .children import owned_by
from .meta import ENDPOINT_LABEL

Object = dict[str, Any]
Key = tuple[str, str]  # (namespace, endpoint name)
Need = Literal["apply", "fold"]


@dataclass(frozen=True, slots=True)
class Seen:
    """One round's view of an endpoint."""

    uid: str
    generation: int
    specs: frozenset[tuple[str, str, str]]  # (kind, name, spec version) of each child it owns
    states: frozenset[tuple[str, str, str]]  # (kind, name, resourceVersion) of children with status, and pods


def needed(previous: Seen | None, now: Seen) -> Need | None:
    """The pass `now` calls for, given what the last round saw (None: never seen, e.g. after a restart)."""
    if previous is None or (previous.uid, previous.generation) != (now.uid, now.generation):
        return "apply"
    if previous.specs != now.specs:
        return "apply"
    if previous.states != now.states:
        return "fold"
    return None


def observe(endpoints: Iterable[Object], children: Iterable[Object], pods: Iterable[Object]) -> dict[Key, Seen]:
    """Group the listed children (any kind, carrying the endpoint label) and serving pods by endpoint. Only
    children the endpoint owns count: an object of the same name that is someone else's is not its state."""
    by_key: dict[Key, list[Object]] = defaultdict(list)
    for obj in children:
        meta = obj.get("metadata") or {}
        name = (meta.get("labels") or {}).get(ENDPOINT_LABEL)
        if name:
            by_key[(meta.get("namespace") or "default", name)].append(obj)
    pods_by_key: dict[Key, list[Object]] = defaultdict(list)
    for pod in pods:
        meta = pod.get("metadata") or {}
        name = (meta.get("labels") or {}).get(ENDPOINT_LABEL)
        if name:
            pods_by_key[(meta.get("namespace") or "default", name)].append(pod)
    out: dict[Key, Seen] = {}
    for ep in endpoints:
        meta = ep["metadata"]
        key = (meta.get("namespace") or "default", meta["name"])
        uid = meta.get("uid") or ""
        specs, states = set(), set()
        for obj in by_key.get(key, ()):
            if not owned_by(obj, uid):
                continue
            m = obj["metadata"]
            version = m.get("resourceVersion") or ""
            generation = m.get("generation")
            specs.add((obj["kind"], m["name"], f"g{generation}" if generation is not None else version))
            if generation is not None:  # a kind with a status, which moves without a spec change
                states.add((obj["kind"], m["name"], version))
        for pod in pods_by_key.get(key, ()):
            states.add(("Pod", pod["metadata"]["name"], pod["metadata"].get("resourceVersion") or ""))
        out[key] = Seen(uid, int(meta.get("generation") or 0), frozenset(specs), frozenset(states))
    return out
