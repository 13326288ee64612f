"""Which LoRA adapters each ready serving replica has loaded: GET /v1/models on the pod itself.

The one place the operator talks to the engines (everything else it learns from the API server): the engine
loads an adapter when its files are complete, and refuses a bad one, on its own time, and only the engine
knows. Asked only for endpoints with spec.adapters, only of ready serving pods, at most PROBE_CONCURRENCY at a
time, each within PROBE_TIMEOUT_S; a pod that does not answer is reported as such, never an error of the pass.

Reaching the pods: their IP and the engine's `http` port, from the live pod. The endpoint's NetworkPolicy
(network_policy.py) admits the operator's pods to that port. An engine with an API key (env SLUICE_API_KEY of its
container: /v1 routes need it) is asked with the key when the pod spec holds its value; a key from a Secret leaves
the answer unknown, saying so: the operator reads no Secret (its RBAC grants only the creation of one, the KV key
of a disaggregated endpoint, by design).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

import aiohttp

from .meta import SERVES_LABEL
from .pod_customization import ENGINE_CONTAINER
from .workload import PORT

Object = dict[str, Any]
# name of a ready serving pod -> the adapters it lists, or why it could not be asked
Probes = Mapping[str, "frozenset[str] | str"]
PROBE_TIMEOUT_S = 3.0
PROBE_CONCURRENCY = 16
API_KEY_ENV = "SLUICE_API_KEY"  # the engine's --api-key default (sluice_engine/entrypoints/serve_cli.py)


def is_ready(pod: Object) -> bool:
    meta, st = pod.get("metadata") or {}, pod.get("status") or {}
    if meta.get("deletionTimestamp") or (meta.get("labels") or {}).get(SERVES_LABEL) != "true":
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in st.get("conditions") or [])


def _engine(pod: Object) -> Object:
    containers = (pod.get("spec") or {}).get("containers") or []
    return next((c for c in containers if c.get("name") == ENGINE_CONTAINER), containers[0] if containers else {})


def models_url(pod: Object) -> str | None:
    ip = (pod.get("status") or {}).get("podIP")
    if not ip:
        return None
    port = next((p.get("containerPort") for p in _engine(pod).get("ports") or [] if p.get("name") == "http"), PORT)
    host = f"[{ip}]" if ":" in ip else ip
    return f"http://{host}:{port}/v1/models"


def _api_key(pod: Object) -> str | None:
    """The engine's API key, as its container gets it; None: it has none. Raises LookupError for a key the
    operator does not read (valueFrom a Secret)."""
    env = next((e for e in _engine(pod).get("env") or [] if e.get("name") == API_KEY_ENV), None)
    if env is None:
        return None
    if "value" in env:
        return env["value"] or None
    source = ", ".join(sorted(env.get("valueFrom") or {})) or "valueFrom"
    raise LookupError(f"its /v1 routes need the API key of env {API_KEY_ENV} ({source}), which the operator "
                      "does not read")


async def _listed(session: aiohttp.ClientSession, url: str, key: str | None) -> frozenset[str]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with session.get(url, headers=headers) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}")
        body = await resp.json(content_type=None)
    return frozenset(str(m["id"]) for m in body.get("data") or [] if isinstance(m, dict) and "id" in m)


async def probe(pods: list[Object], logger: logging.Logger | logging.LoggerAdapter) -> dict[str, frozenset[str] | str]:
    """Each ready serving pod's answer: the model ids its /v1/models lists (the base and its loaded adapters), or
    why there is none."""
    ready = [p for p in pods if is_ready(p)]
    out: dict[str, frozenset[str] | str] = {}
    if not ready:
        return out
    gate = asyncio.Semaphore(PROBE_CONCURRENCY)
    timeout = aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)

    async def one(session: aiohttp.ClientSession, pod: Object) -> None:
        name = pod["metadata"]["name"]
        url = models_url(pod)
        if url is None:
            out[name] = "no pod IP"
            return
        try:
            key = _api_key(pod)
            async with gate:
                out[name] = await _listed(session, url, key)
        except LookupError as e:
            out[name] = str(e)
        except (aiohttp.ClientError, TimeoutError, RuntimeError, ValueError) as e:
            out[name] = f"GET {url}: {str(e) or type(e).__name__}"
            logger.debug("adapter probe of pod %s: %s", name, out[name])

    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(one(session, p) for p in ready))
    return out
