"""spec.disaggregation: a prefill pool and a decode pool instead of one serving workload.

- Decode pool: the Deployment and Service `<name>` (role serving: the endpoint's Service, the gateway's backends,
  status.replicas). Each engine runs `--kv-role decode` with its KV receiver on the pod's IP (`--kv-host
  $(POD_IP)`, port `kv`), an offload tier for the pushed blocks, and `--prefill-url` naming the prefill Service: it
  sends each request's prompt there first (kv_transfer/prefill_hop.py in the engine) and decodes from the pushed
  blocks; a failed hop means it computes the prompt itself.
- Prefill pool: the Deployment and Service `<name>-prefill` (role prefill: the gateway leaves it out; only decode
  engines call it). Each engine runs `--kv-role prefill`.
- One KEDA ScaledObject per autoscaled pool, each on its own signal: prefill on the prompt tokens waiting to be
  computed, decode on the requests it carries.
Both pools share the ConfigMap, model, engine and accelerator of the spec; spec.py refuses pools whose KV block
sizes differ, and engines of more than one rank (their transfers are not built).

KV transfers are authenticated with a per-endpoint key: the Secret `<name>-kv` (key `kv-secret`, 64 hex
characters), mounted read-only by both pools and named by `--kv-secret-file` (the engine refuses a KV receiver on
a non-loopback address without it). NOTE(design): the key is random, made once, not derived. reconcile stays
pure by only naming the Secret; the loop (handlers.py) creates it when absent, owned by the endpoint so the
garbage collector removes it with the endpoint. Deriving it with an HMAC of an operator-held master key would
make it reproducible, but the operator would then hold one key that opens every endpoint's transfers, the
manifest (and `sluice render`) would carry the secret, and applying it would need get and patch on Secrets,
i.e. reading every Secret of the namespace. Creating once needs only `create` on Secrets: the operator can
never read a Secret back, this one included. The Secret is immutable; an edit to the key is a delete (the next
pass makes a new one) and a rollout of both pools.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

from .autoscaling import ENDPOINT_METRIC_LABEL, scaled_object_of
from .config import OperatorConfig
from .engine_flags import render_args
from .meta import PREFILL, SERVING, object_meta
from .spec import KV_PORT, DecodePool, InferenceEndpoint, PrefillPool

POD_IP_ENV = "POD_IP"
PROMPT_TOKENS_METRIC = "sluice_num_prompt_tokens_waiting"
RUNNING_METRIC = "sluice_num_requests_running"
WAITING_METRIC = "sluice_num_requests_waiting"
ROLE_METRIC_LABEL = "sluice_dev_role"  # the ServiceMonitor's copy of the role label onto every series
KV_SECRET_KEY = "kv-secret"
KV_SECRET_VOLUME = "kv-secret"
KV_SECRET_DIR = "/etc/sluice-kv"
KV_SECRET_FILE = f"{KV_SECRET_DIR}/{KV_SECRET_KEY}"  # the engines' --kv-secret-file


@dataclass(frozen=True)
class PoolParts:
    """What a pool adds to the engine pod: flags after the endpoint's, its own resources, env and ports."""

    args: tuple[str, ...] = ()
    resources: dict[str, Any] | None = None
    env: tuple[dict[str, Any], ...] = ()
    ports: tuple[dict[str, Any], ...] = ()
    volumes: tuple[dict[str, Any], ...] = ()  # of the pod, and their mounts in the engine container
    mounts: tuple[dict[str, Any], ...] = ()


def prefill_name(ep: InferenceEndpoint) -> str:
    return f"{ep.name}-prefill"


def prefill_url(ep: InferenceEndpoint, cfg: OperatorConfig) -> str:
    """The prefill Service, as the decode engines reach it (port 80, the Services' port)."""
    return f"http://{prefill_name(ep)}.{ep.namespace}.svc.{cfg.cluster_domain}"


def kv_secret_name(ep: InferenceEndpoint) -> str:
    return f"{ep.name}-kv"


def kv_secret(ep: InferenceEndpoint, key: str | None = None) -> dict[str, Any]:
    """The endpoint's KV transfer key as a Secret, owned by the endpoint. `key`: 64 hex characters; None: a fresh
    random one (the loop creates it once, never applies it again)."""
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "immutable": True,
            "metadata": object_meta(ep, kv_secret_name(ep), "kv"),
            "stringData": {KV_SECRET_KEY: key if key is not None else secrets.token_hex(32)}}


def _kv_secret_mount(ep: InferenceEndpoint) -> tuple[tuple[str, ...], dict[str, Any], dict[str, Any]]:
    """--kv-secret-file, the Secret's volume (only its key; readable by the engine through fsGroup) and its read-only mount."""
    volume = {"name": KV_SECRET_VOLUME, "secret": {"secretName": kv_secret_name(ep), "defaultMode": 0o440,
                                                    "items": [{"key": KV_SECRET_KEY, "path": KV_SECRET_KEY}]}}
    mount = {"name": KV_SECRET_VOLUME, "mountPath": KV_SECRET_DIR, "readOnly": True}
    return ("--kv-secret-file", KV_SECRET_FILE), volume, mount


def prefill_parts(ep: InferenceEndpoint, pool: PrefillPool) -> PoolParts:
    flag, volume, mount = _kv_secret_mount(ep)
    return PoolParts(args=(*render_args(pool.args), "--kv-role", "prefill", *flag), resources=pool.resources,
                     volumes=(volume,), mounts=(mount,))


def decode_parts(ep: InferenceEndpoint, pool: DecodePool, cfg: OperatorConfig) -> PoolParts:
    # The receiver listens on the pod's IP: the address the prefill engines push to (an engine refuses a wildcard
    # with --prefill-url, as the push target must be reachable). The kubelet expands $(POD_IP) from the env.
    flag, volume, mount = _kv_secret_mount(ep)
    args = (*render_args(pool.args), "--kv-role", "decode", "--kv-host", f"$({POD_IP_ENV})", "--kv-port", str(KV_PORT),
            "--kv-offload-bytes", pool.kv_offload_bytes, "--prefill-url", prefill_url(ep, cfg),
            "--prefill-min-prompt-tokens", str(pool.min_prompt_tokens), *flag)
    env = ({"name": POD_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},)
    ports = ({"name": "kv", "containerPort": KV_PORT, "protocol": "TCP"},)
    return PoolParts(args=args, resources=pool.resources, env=env, ports=ports, volumes=(volume,), mounts=(mount,))


def _series(ep: InferenceEndpoint, metric: str, role: str) -> str:
    return (f'sum({metric}{{namespace="{ep.namespace}",{ENDPOINT_METRIC_LABEL}="{ep.name}",'
            f'{ROLE_METRIC_LABEL}="{role}"}})')


def prefill_query(ep: InferenceEndpoint) -> str:
    """The prefill pool's backlog: prompt tokens its engines have not computed yet."""
    return _series(ep, PROMPT_TOKENS_METRIC, PREFILL)


def decode_query(ep: InferenceEndpoint) -> str:
    """The decode pool's load: the requests its engines carry, running and waiting."""
    return f"{_series(ep, RUNNING_METRIC, SERVING)} + {_series(ep, WAITING_METRIC, SERVING)}"


def pool_scaled_object(ep: InferenceEndpoint, cfg: OperatorConfig, target: dict[str, Any], role: str) -> dict[str, Any]:
    """A pool's ScaledObject: one Prometheus trigger on its own signal. No scale to zero (minReplicas >= 1): a
    decode pool at zero has no Service backend, and a prefill pool at zero only means every prompt is computed
    by the decode engines."""
    d = ep.spec.disaggregation
    assert d is not None
    if role == PREFILL:
        scaling, name, query = d.prefill.scaling, prefill_name(ep), prefill_query(ep)
        threshold, trigger = d.prefill.scaling.target_prompt_tokens, "prompt-tokens-waiting"
    else:
        scaling, name, query = d.decode.scaling, ep.name, decode_query(ep)
        threshold, trigger = d.decode.scaling.target_requests, "requests"
    assert scaling is not None
    # An unreadable metric holds at least minReplicas, never scaling in below the current count.
    return scaled_object_of(ep, name, target, scaling, scaling.min_replicas, [{
        "type": "prometheus",
        "name": trigger,
        "metricType": "AverageValue",  # per replica
        "metadata": {"serverAddress": cfg.prometheus_url, "query": query, "threshold": str(threshold),
                     "activationThreshold": "0", "ignoreNullValues": "false"},
    }])
