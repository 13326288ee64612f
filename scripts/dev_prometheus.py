#!/usr/bin/env python3
"""The Prometheus Operator's job on the dev cluster (issue 40, "Prometheus for real"): runs Debian's `prometheus`
(.tools/bin, from scripts/get-promtool.sh) and keeps its scrape config and rule files in step with the
ServiceMonitor, PodMonitor and PrometheusRule objects in the cluster, as the Prometheus Operator would.

    .venv/bin/python scripts/dev_prometheus.py --port 9090 [--static-target gateway=127.0.0.1:9000]

The cluster is scripts/dev-cluster.sh's: its state dir ($SLUICE_DEV_CLUSTER_DIR, by default
${XDG_CACHE_HOME:-~/.cache}/sluice/dev-cluster, or --cluster-dir) gives the API server's port (api-port), its
CA (pki/ca.crt) and the admin client certificate (pki/admin.crt, pki/admin.key). Its own state (prometheus.yml,
rules/, targets/, data/, prometheus.log) is in --state-dir, by default <cluster dir>/prometheus.

Debian's prometheus is built without Kubernetes service discovery (its package leaves kubernetes_sd_configs
out: "field kubernetes_sd_configs not found"), so this program discovers the targets itself and hands them to
Prometheus as file_sd_configs files (targets/<job>.json), each target with the __meta_kubernetes_* labels
kubernetes_sd_configs would give it (role endpointslice: the slice's, its Service's, its Pod's and the matching
container port's; role pod: the pod's and its container port's). The relabelling that selects and labels them
is then the Prometheus Operator's, in prometheus.yml, run by Prometheus.

What it does, every --poll seconds:
- lists ServiceMonitors, PodMonitors and PrometheusRules in every namespace (with --selector, only those with
  those labels: a kube-prometheus-stack's `release: <name>`), and, while any monitor exists, Services,
  EndpointSlices and Pods;
- makes one scrape job per monitor endpoint, named as the Prometheus Operator names them
  (serviceMonitor/<ns>/<name>/<i>, podMonitor/<ns>/<name>/<i>), over the EndpointSlices (ServiceMonitor) or
  Pods (PodMonitor) of the monitor's namespaces, with the relabelling that keeps the selected Services' (Pods')
  named port and gives the Operator's target labels: namespace, service, pod, container, endpoint (the port's
  name) and job (the Service's name, the PodMonitor's <ns>/<name>, or jobLabel's value), plus targetLabels /
  podTargetLabels under Prometheus-safe names (sluice.dev/endpoint -> sluice_dev_endpoint); rewrites each
  job's targets file when what it discovers changes (Prometheus rereads those files by itself);
- writes each PrometheusRule's spec.groups to rules/<namespace>-<name>-<uid>.yaml (the Operator's file names),
  checked first with `promtool check rules` (a file that fails is logged and left out, the others load);
- checks the new prometheus.yml with `promtool check config --syntax-only` and, when the config or a rule file
  changed, POSTs /-/reload.
When the API server does not answer, the last config stays (a monitor kind that is suddenly not served is
dropped only after three polls in a row say so: a restarting API server answers 404 until its CRDs load).

Supported fields (everything else is logged once per object and ignored):
  ServiceMonitor spec: selector (matchLabels, matchExpressions: In, NotIn, Exists, DoesNotExist),
    namespaceSelector (matchNames, any; empty: the monitor's own namespace), endpoints, jobLabel, targetLabels,
    podTargetLabels, sampleLimit, targetLimit, labelLimit, labelNameLengthLimit, labelValueLengthLimit,
    serviceDiscoveryRole (always discovered from EndpointSlices; Endpoints is logged).
  PodMonitor spec: selector, namespaceSelector, podMetricsEndpoints, jobLabel, podTargetLabels and the limits.
  Endpoints (both): port, targetPort (ServiceMonitor), portNumber (PodMonitor), path, scheme, params, interval,
    scrapeTimeout, honorLabels, honorTimestamps, followRedirects, enableHttp2, filterRunning, relabelings,
    metricRelabelings. Not: TLS, authorization, basic auth, OAuth2, proxies, bearer tokens (no secrets are read).
  PrometheusRule spec: groups, as they are (Prometheus checks them).
  Not made: the extra targets Prometheus' role endpointslice adds for a selected pod's container ports that no
  slice lists, and init containers' ports.
Every monitor interval and scrapeTimeout is capped at --max-interval where it is given (a quicker loop on the
dev cluster; the operator renders 15 s). Jobs for --static-target name=host:port[/path] (the local gateway's
metrics, say) and for this Prometheus itself are added as they are. Unless --no-install-crds, the
PodMonitor, ServiceMonitor and PrometheusRule CRDs are installed from --crds (the reference copies in
../shared/reference-crds) where the cluster does not have them: the operator applies its ServiceMonitor and
PrometheusRule only where their CRDs exist (it logs "skipping" and reports the kind missing otherwise).

SIGTERM or SIGINT stops Prometheus (SIGTERM, then SIGKILL after 15 s) and then this program; if Prometheus
exits on its own this program exits 1 with the end of prometheus.log.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import re
import signal
import ssl
import subprocess
import sys
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ROOT / ".tools" / "bin"
REFERENCE_CRDS = ROOT.parent / "shared" / "reference-crds"
GROUP_VERSION = "monitoring.coreos.com/v1"
FIELD_MANAGER = "sluice-dev-prometheus"
# plural -> the reference CRD file that defines it
CRD_FILES = {
    "servicemonitors": "monitoring.coreos.com_servicemonitors.yaml",
    "podmonitors": "monitoring.coreos.com_podmonitors.yaml",
    "prometheusrules": "monitoring.coreos.com_prometheusrules.yaml",
}
KINDS = {"servicemonitors": "ServiceMonitor", "podmonitors": "PodMonitor", "prometheusrules": "PrometheusRule"}
ABSENT_POLLS = 3  # 404s in a row before a kind that was served counts as gone
log = logging.getLogger("dev-prometheus")

Object = dict[str, Any]

# -- fields this program understands ---------------------------------------------------------------------------
LIMITS = {"sampleLimit": "sample_limit", "targetLimit": "target_limit", "labelLimit": "label_limit",
          "labelNameLengthLimit": "label_name_length_limit", "labelValueLengthLimit": "label_value_length_limit"}
COMMON_SPEC = {"selector", "namespaceSelector", "jobLabel", "podTargetLabels", *LIMITS}
SPEC_FIELDS = {
    "ServiceMonitor": COMMON_SPEC | {"endpoints", "targetLabels", "serviceDiscoveryRole"},
    "PodMonitor": COMMON_SPEC | {"podMetricsEndpoints"},
}
COMMON_ENDPOINT = {"port", "path", "scheme", "params", "interval", "scrapeTimeout", "honorLabels",
                   "honorTimestamps", "followRedirects", "enableHttp2", "filterRunning", "relabelings",
                   "metricRelabelings"}
ENDPOINT_FIELDS = {"ServiceMonitor": COMMON_ENDPOINT | {"targetPort"},
                   "PodMonitor": COMMON_ENDPOINT | {"portNumber", "targetPort"}}
RELABEL_KEYS = {"sourceLabels": "source_labels", "separator": "separator", "targetLabel": "target_label",
                "regex": "regex", "modulus": "modulus", "replacement": "replacement", "action": "action"}


# -- durations -------------------------------------------------------------------------------------------------
UNITS_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000, "w": 604_800_000,
            "y": 31_536_000_000}
DURATION = re.compile(r"(\d+)(ms|s|m|h|d|w|y)")


def duration_ms(text: str) -> int:
    """Prometheus' duration ("1m30s", "500ms") in milliseconds."""
    parts = DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"not a Prometheus duration: {text!r}")
    return sum(int(n) * UNITS_MS[u] for n, u in parts)


def duration_text(ms: int) -> str:
    return f"{ms // 1000}s" if ms % 1000 == 0 else f"{ms}ms"


# -- the cluster -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ClusterAccess:
    """What scripts/dev-cluster.sh leaves in its state dir: the API server's address and the admin client's
    credentials. Prometheus' service discovery uses the same files."""

    server: str
    ca: Path
    cert: Path
    key: Path

    @classmethod
    def from_state(cls, state: Path) -> ClusterAccess:
        port = (state / "api-port").read_text().strip()
        pki = state / "pki"
        return cls(f"https://127.0.0.1:{port}", pki / "ca.crt", pki / "admin.crt", pki / "admin.key")



class ApiDown(Exception):
    """The API server did not answer, or answered 5xx."""


class Api:
    def __init__(self, access: ClusterAccess, timeout: float = 5.0):
        context = ssl.create_default_context(cafile=str(access.ca))
        context.load_cert_chain(str(access.cert), str(access.key))
        self.client = httpx.Client(base_url=access.server, verify=context, timeout=timeout)

    def _request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        try:
            r = self.client.request(method, path, **kw)
        except httpx.HTTPError as e:
            raise ApiDown(f"{method} {path}: {type(e).__name__}: {e}") from e
        if r.status_code >= 500 or r.status_code == 429:
            raise ApiDown(f"{method} {path}: HTTP {r.status_code}: {r.text[:300].strip()}")
        return r

    def list(self, collection: str, selector: str | None = None) -> list[Object] | None:
        """Every object of a collection (/api/v1/pods, /apis/<group>/<version>/<plural>) in every namespace;
        None where the cluster does not serve it."""
        params = {"labelSelector": selector} if selector else {}
        r = self._request("GET", collection, params=params)
        if r.status_code == 404:
            return None
        if r.status_code != 200:
            raise ApiDown(f"list {collection}: HTTP {r.status_code}: {r.text[:300]}")
        return r.json().get("items") or []

    def install_crd(self, doc: Object) -> bool:
        """Server-side apply of the CRD unless the cluster has one of its name already. True: it is there."""
        path = f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{doc['metadata']['name']}"
        r = self._request("GET", path)
        if r.status_code == 200:
            return True
        if r.status_code != 404:
            raise ApiDown(f"GET {path}: HTTP {r.status_code}: {r.text[:300]}")
        r = self._request("PATCH", path, params={"fieldManager": FIELD_MANAGER}, content=json.dumps(doc),
                          headers={"Content-Type": "application/apply-patch+yaml"})
        if r.status_code not in (200, 201):
            raise ApiDown(f"apply CRD {doc['metadata']['name']}: HTTP {r.status_code}: {r.text[:300]}")
        log.info("installed CRD %s", doc["metadata"]["name"])
        return True


# -- monitors -> scrape jobs ------------------------------------------------------------------------------------
def label_name(key: str) -> str:
    """A Kubernetes label key as Prometheus writes it in __meta_* labels and as the Operator's target labels."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", key)


class Warnings:
    """Logs each (object, message) once."""

    def __init__(self) -> None:
        self.seen: set[tuple[str, str]] = set()

    def once(self, who: str, message: str) -> None:
        if (who, message) not in self.seen:
            self.seen.add((who, message))
            log.warning("%s: %s", who, message)


def selector_relabels(selector: Object, meta: str) -> list[Object]:
    """keep/drop rules for a label selector over __meta_kubernetes_<meta>_label_* (service or pod labels)."""
    out: list[Object] = []
    for key, value in sorted((selector.get("matchLabels") or {}).items()):
        n = label_name(key)
        out.append({"action": "keep", "source_labels": [f"__meta_kubernetes_{meta}_label_{n}",
                                                        f"__meta_kubernetes_{meta}_labelpresent_{n}"],
                    "regex": f"({re.escape(str(value))});true"})
    for expr in selector.get("matchExpressions") or []:
        n, op = label_name(expr["key"]), expr["operator"]
        value_label = [f"__meta_kubernetes_{meta}_label_{n}", f"__meta_kubernetes_{meta}_labelpresent_{n}"]
        present = [f"__meta_kubernetes_{meta}_labelpresent_{n}"]
        values = "|".join(re.escape(v) for v in expr.get("values") or [])
        rule = {"In": {"action": "keep", "source_labels": value_label, "regex": f"({values});true"},
                "NotIn": {"action": "drop", "source_labels": value_label, "regex": f"({values});true"},
                "Exists": {"action": "keep", "source_labels": present, "regex": "true"},
                "DoesNotExist": {"action": "drop", "source_labels": present, "regex": "true"}}.get(op)
        if rule is None:
            raise ValueError(f"selector operator {op!r}")
        out.append(rule)
    return out


def relabel(rule: Object) -> Object:
    """A RelabelConfig of the CRDs (camelCase, actions in either case) as Prometheus writes it."""
    out = {RELABEL_KEYS[k]: v for k, v in rule.items() if k in RELABEL_KEYS}
    if "action" in out:
        out["action"] = str(out["action"]).lower()
    return out


def copy_label(source: str, target: str, regex: str | None = None) -> Object:
    rule: Object = {"source_labels": [source], "target_label": target}
    if regex:
        rule["regex"] = regex
    return rule


@dataclass
class Job:
    """A scrape job and where its targets come from: `role` (endpointslice or pod) in `namespaces` (None: all)."""

    config: Object
    role: str
    namespaces: list[str] | None

    @property
    def targets_file(self) -> str:
        return re.sub(r"[^a-zA-Z0-9_.-]", "_", self.config["job_name"]) + ".json"


@dataclass
class JobBuilder:
    targets_dir: Path
    max_interval_ms: int | None
    warnings: Warnings = field(default_factory=Warnings)

    def jobs(self, monitor: Object) -> list[Job]:
        kind, meta = monitor["kind"], monitor["metadata"]
        who = f"{kind} {meta['namespace']}/{meta['name']}"
        spec = monitor.get("spec") or {}
        for key in sorted(set(spec) - SPEC_FIELDS[kind]):
            self.warnings.once(who, f"spec.{key} is not supported here; ignored")
        if spec.get("serviceDiscoveryRole") == "Endpoints":
            self.warnings.once(who, "serviceDiscoveryRole Endpoints: discovered from EndpointSlices all the same")
        try:
            if kind == "ServiceMonitor":
                return [self._service_job(monitor, i, ep, who) for i, ep in enumerate(spec.get("endpoints") or [])]
            return [self._pod_job(monitor, i, ep, who) for i, ep in enumerate(spec.get("podMetricsEndpoints") or [])]
        except (ValueError, KeyError, TypeError) as e:
            self.warnings.once(who, f"left out: {type(e).__name__}: {e}")
            return []

    def _job(self, name: str, role: str, monitor: Object) -> Job:
        ns_sel = monitor["spec"].get("namespaceSelector") or {}
        namespaces = None if ns_sel.get("any") else \
            (list(ns_sel.get("matchNames") or []) or [monitor["metadata"]["namespace"]])
        job = Job({"job_name": name}, role, namespaces)
        job.config["file_sd_configs"] = [{"files": [str(self.targets_dir / job.targets_file)]}]
        return job

    def _common(self, job: Object, ep: Object, spec: Object, who: str, kind: str) -> None:
        for key in sorted(set(ep) - ENDPOINT_FIELDS[kind]):
            self.warnings.once(who, f"endpoint field {key} is not supported here; ignored")
        job["metrics_path"] = ep.get("path") or "/metrics"
        if ep.get("scheme"):
            job["scheme"] = ep["scheme"].lower()
        if ep.get("params"):
            job["params"] = ep["params"]
        interval = ep.get("interval")
        timeout = ep.get("scrapeTimeout")
        if self.max_interval_ms is not None:
            interval_ms = min(duration_ms(interval), self.max_interval_ms) if interval else self.max_interval_ms
            interval = duration_text(interval_ms)
        if interval:
            job["scrape_interval"] = interval
            if timeout:  # Prometheus refuses a timeout longer than the interval
                timeout = duration_text(min(duration_ms(timeout), duration_ms(interval)))
        if timeout:
            job["scrape_timeout"] = timeout
        for key, prom in (("honorLabels", "honor_labels"), ("honorTimestamps", "honor_timestamps"),
                          ("followRedirects", "follow_redirects"), ("enableHttp2", "enable_http2")):
            if key in ep:
                job[prom] = bool(ep[key])
        for key, prom in LIMITS.items():
            if spec.get(key):
                job[prom] = spec[key]
        if ep.get("metricRelabelings"):
            job["metric_relabel_configs"] = [relabel(r) for r in ep["metricRelabelings"]]

    def _service_job(self, monitor: Object, index: int, ep: Object, who: str) -> Job:
        spec, meta = monitor["spec"], monitor["metadata"]
        m = "__meta_kubernetes_endpointslice"
        out = self._job(f"serviceMonitor/{meta['namespace']}/{meta['name']}/{index}", "endpointslice", monitor)
        job = out.config
        self._common(job, ep, spec, who, "ServiceMonitor")
        rules: list[Object] = [*selector_relabels(spec.get("selector") or {}, "service")]
        # Which port: by the Service port's name, or by the container port the Service targets.
        if ep.get("port"):
            rules.append({"action": "keep", "source_labels": [f"{m}_port_name"], "regex": re.escape(ep["port"])})
        elif ep.get("targetPort") is not None:
            tp = ep["targetPort"]
            source = "__meta_kubernetes_pod_container_port_number" if isinstance(tp, int) else \
                "__meta_kubernetes_pod_container_port_name"
            rules.append({"action": "keep", "source_labels": [source], "regex": re.escape(str(tp))})
        target = [f"{m}_address_target_kind", f"{m}_address_target_name"]
        rules += [  # node or pod: what the address points at
            {"source_labels": target, "separator": ";", "regex": "Node;(.*)", "replacement": "${1}",
             "target_label": "node"},
            {"source_labels": target, "separator": ";", "regex": "Pod;(.*)", "replacement": "${1}",
             "target_label": "pod"},
        ]
        rules += self._pod_rules(ep)
        rules += [copy_label("__meta_kubernetes_service_name", "service"),
                  copy_label("__meta_kubernetes_service_name", "job")]
        if spec.get("jobLabel"):
            rules.append(copy_label(f"__meta_kubernetes_service_label_{label_name(spec['jobLabel'])}", "job",
                                    regex="(.+)"))
        rules += [copy_label(f"__meta_kubernetes_service_label_{label_name(k)}", label_name(k), regex="(.+)")
                  for k in spec.get("targetLabels") or []]
        job["relabel_configs"] = rules + self._last_rules(spec, ep)
        return out

    def _pod_job(self, monitor: Object, index: int, ep: Object, who: str) -> Job:
        spec, meta = monitor["spec"], monitor["metadata"]
        out = self._job(f"podMonitor/{meta['namespace']}/{meta['name']}/{index}", "pod", monitor)
        job = out.config
        self._common(job, ep, spec, who, "PodMonitor")
        rules: list[Object] = [*selector_relabels(spec.get("selector") or {}, "pod")]
        if ep.get("port"):
            rules.append({"action": "keep", "source_labels": ["__meta_kubernetes_pod_container_port_name"],
                          "regex": re.escape(ep["port"])})
        elif ep.get("portNumber") is not None or ep.get("targetPort") is not None:
            number = ep.get("portNumber", ep.get("targetPort"))
            source = "__meta_kubernetes_pod_container_port_number" if isinstance(number, int) else \
                "__meta_kubernetes_pod_container_port_name"
            rules.append({"action": "keep", "source_labels": [source], "regex": re.escape(str(number))})
        rules += self._pod_rules(ep)
        rules.append({"target_label": "job", "replacement": f"{meta['namespace']}/{meta['name']}"})
        if spec.get("jobLabel"):
            rules.append(copy_label(f"__meta_kubernetes_pod_label_{label_name(spec['jobLabel'])}", "job",
                                    regex="(.+)"))
        job["relabel_configs"] = rules + self._last_rules(spec, ep)
        return out

    def _last_rules(self, spec: Object, ep: Object) -> list[Object]:
        """What both monitor kinds end with: podTargetLabels, the endpoint label, the endpoint's own relabelings."""
        rules = [copy_label(f"__meta_kubernetes_pod_label_{label_name(k)}", label_name(k), regex="(.+)")
                 for k in spec.get("podTargetLabels") or []]
        return rules + self._endpoint_label(ep) + [relabel(r) for r in ep.get("relabelings") or []]

    @staticmethod
    def _pod_rules(ep: Object) -> list[Object]:
        rules: list[Object] = []
        if ep.get("filterRunning", True):  # the Operator's default: finished pods are no targets
            rules.append({"action": "drop", "source_labels": ["__meta_kubernetes_pod_phase"],
                          "regex": "(Failed|Succeeded)"})
        return rules + [copy_label("__meta_kubernetes_namespace", "namespace"),
                        copy_label("__meta_kubernetes_pod_name", "pod"),
                        copy_label("__meta_kubernetes_pod_container_name", "container")]

    @staticmethod
    def _endpoint_label(ep: Object) -> list[Object]:
        """`endpoint`: the port as the monitor names it."""
        port = ep.get("port") or ep.get("portNumber") or ep.get("targetPort")
        return [{"target_label": "endpoint", "replacement": str(port)}] if port is not None else []


# -- discovery: what Prometheus' kubernetes_sd_configs would find ------------------------------------------------
@dataclass
class Snapshot:
    """Services, EndpointSlices and Pods in every namespace, as last listed."""

    services: dict[tuple[str, str], Object] = field(default_factory=dict)
    slices: list[Object] = field(default_factory=list)
    pods: dict[tuple[str, str], Object] = field(default_factory=dict)


DISCOVERED = {"services": "/api/v1/services", "slices": "/apis/discovery.k8s.io/v1/endpointslices",
              "pods": "/api/v1/pods"}
K = "__meta_kubernetes_"


def label_meta(kind: str, labels: dict[str, str] | None) -> dict[str, str]:
    out = {}
    for key, value in (labels or {}).items():
        out[f"{K}{kind}_label_{label_name(key)}"] = value
        out[f"{K}{kind}_labelpresent_{label_name(key)}"] = "true"
    return out


def host_port(host: str, port: int | str) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def pod_meta(pod: Object) -> dict[str, str]:
    meta, spec, status = pod["metadata"], pod.get("spec") or {}, pod.get("status") or {}
    ready = next((c["status"] for c in status.get("conditions") or [] if c.get("type") == "Ready"), "unknown")
    out = {f"{K}namespace": meta["namespace"], f"{K}pod_name": meta["name"], f"{K}pod_uid": meta.get("uid", ""),
           f"{K}pod_ip": status.get("podIP", ""), f"{K}pod_node_name": spec.get("nodeName", ""),
           f"{K}pod_host_ip": status.get("hostIP", ""), f"{K}pod_phase": status.get("phase", ""),
           f"{K}pod_ready": ready.lower(), **label_meta("pod", meta.get("labels"))}
    owner = next((o for o in meta.get("ownerReferences") or [] if o.get("controller")), None)
    if owner is not None:
        out[f"{K}pod_controller_kind"], out[f"{K}pod_controller_name"] = owner["kind"], owner["name"]
    return out


def container_meta(container: Object, port: Object | None) -> dict[str, str]:
    out = {f"{K}pod_container_name": container["name"], f"{K}pod_container_image": container.get("image", ""),
           f"{K}pod_container_init": "false"}
    if port is not None:
        out |= {f"{K}pod_container_port_name": port.get("name", ""),
                f"{K}pod_container_port_number": str(port["containerPort"]),
                f"{K}pod_container_port_protocol": port.get("protocol", "TCP")}
    return out


def in_namespaces(obj: Object, namespaces: list[str] | None) -> bool:
    return namespaces is None or obj["metadata"]["namespace"] in namespaces


def endpointslice_targets(snap: Snapshot, namespaces: list[str] | None) -> list[Object]:
    """A target per endpoint and port of every EndpointSlice (its first address, as Prometheus takes), with the
    slice's, its Service's and, where the endpoint names a Pod, the pod's and its matching container's labels.
    Not made: the extra targets Prometheus adds for a pod's container ports that no slice lists."""
    groups = []
    for es in snap.slices:
        if not in_namespaces(es, namespaces):
            continue
        meta = es["metadata"]
        ns, service_name = meta["namespace"], (meta.get("labels") or {}).get("kubernetes.io/service-name")
        base = {f"{K}namespace": ns, f"{K}endpointslice_name": meta["name"],
                f"{K}endpointslice_address_type": es.get("addressType", ""),
                **label_meta("endpointslice", meta.get("labels"))}
        service = snap.services.get((ns, service_name or ""))
        if service_name:
            base[f"{K}service_name"] = service_name
        if service is not None:
            base |= label_meta("service", service["metadata"].get("labels"))
        for endpoint in es.get("endpoints") or []:
            if not endpoint.get("addresses"):
                continue
            conditions, ref = endpoint.get("conditions") or {}, endpoint.get("targetRef") or {}
            ep_labels = {**base, **{f"{K}endpointslice_endpoint_conditions_{c}": str(v).lower()
                                    for c, v in conditions.items() if v is not None}}
            if endpoint.get("nodeName"):
                ep_labels[f"{K}endpointslice_endpoint_node_name"] = endpoint["nodeName"]
            if endpoint.get("hostname"):
                ep_labels[f"{K}endpointslice_endpoint_hostname"] = endpoint["hostname"]
            if ref:
                ep_labels[f"{K}endpointslice_address_target_kind"] = ref.get("kind", "")
                ep_labels[f"{K}endpointslice_address_target_name"] = ref.get("name", "")
            pod = snap.pods.get((ref.get("namespace") or ns, ref.get("name", ""))) if ref.get("kind") == "Pod" \
                else None
            for port in es.get("ports") or []:
                if port.get("port") is None:
                    continue
                labels = {**ep_labels, f"{K}endpointslice_port": str(port["port"]),
                          f"{K}endpointslice_port_name": port.get("name") or "",
                          f"{K}endpointslice_port_protocol": port.get("protocol", "TCP")}
                if pod is not None:
                    labels |= pod_meta(pod)
                    for container in (pod.get("spec") or {}).get("containers") or []:
                        match = next((cp for cp in container.get("ports") or []
                                      if cp.get("containerPort") == port["port"]
                                      and cp.get("protocol", "TCP") == port.get("protocol", "TCP")), None)
                        if match is not None:
                            labels |= container_meta(container, match)
                            break
                groups.append({"targets": [host_port(endpoint["addresses"][0], port["port"])], "labels": labels})
    return groups


def pod_targets(snap: Snapshot, namespaces: list[str] | None) -> list[Object]:
    """A target per declared container port of every pod with an IP (a container without ports: one at the pod
    IP alone), as Prometheus' role pod makes them. Init containers are left out."""
    groups = []
    for pod in snap.pods.values():
        ip = (pod.get("status") or {}).get("podIP")
        if not ip or not in_namespaces(pod, namespaces):
            continue
        base = pod_meta(pod)
        for container in (pod.get("spec") or {}).get("containers") or []:
            ports = container.get("ports") or []
            if not ports:
                groups.append({"targets": [ip], "labels": {**base, **container_meta(container, None)}})
            for port in ports:
                groups.append({"targets": [host_port(ip, port["containerPort"])],
                               "labels": {**base, **container_meta(container, port)}})
    return groups


def static_jobs(targets: Iterable[tuple[str, str, str]]) -> list[Object]:
    """--static-target name=host:port[/path]: one job per name."""
    jobs: dict[tuple[str, str], list[str]] = {}
    for name, address, path in targets:
        jobs.setdefault((name, path), []).append(address)
    return [{"job_name": name, "metrics_path": path, "static_configs": [{"targets": addresses}]}
            for (name, path), addresses in jobs.items()]


def parse_static_target(text: str) -> tuple[str, str, str]:
    name, sep, rest = text.partition("=")
    if not sep or not name or not rest:
        raise argparse.ArgumentTypeError(f"--static-target {text!r}: want name=host:port[/path]")
    address, slash, path = rest.partition("/")
    return name, address, "/" + path if slash else "/metrics"


def rule_file_name(rule: Object) -> str:
    meta = rule["metadata"]
    return f"{meta['namespace']}-{meta['name']}-{meta.get('uid', 'nouid')}.yaml"


def replace_if_changed(path: Path, text: str, staging: Path) -> bool:
    """Write `text` to `path` unless it holds it already; by rename, so no reader sees half a file."""
    if path.is_file() and path.read_text() == text:
        return False
    tmp = staging / f".{path.name}"
    tmp.write_text(text)
    os.replace(tmp, path)
    return True


# -- the controller --------------------------------------------------------------------------------------------
@dataclass
class Settings:
    port: int
    state_dir: Path
    prometheus: str
    promtool: str
    scrape_interval: str
    max_interval_ms: int | None
    poll: float
    selector: str | None
    static_targets: list[tuple[str, str, str]]
    install_crds: bool
    crds_dir: Path
    retention: str


class DevPrometheus:
    def __init__(self, settings: Settings, access: ClusterAccess):
        self.s = settings
        self.access = access
        self.api = Api(access)
        self.rules_dir = settings.state_dir / "rules"
        self.targets_dir = settings.state_dir / "targets"
        self.builder = JobBuilder(self.targets_dir, settings.max_interval_ms)
        self.staging = settings.state_dir / "staging"
        self.config_file = settings.state_dir / "prometheus.yml"
        self.proc: subprocess.Popen[bytes] | None = None
        self.stop = threading.Event()
        self.crds_installed = not settings.install_crds
        self.last: dict[str, list[Object]] = {}  # plural -> the objects last listed
        self.snapshot = Snapshot()  # Services, EndpointSlices, Pods (listed only while some monitor exists)
        self.absent: dict[str, int] = {}  # plural -> 404s in a row
        self.checked: dict[str, str | None] = {}  # sha256 of a rule file -> promtool's complaint (None: valid)
        self.api_down_since: str | None = None
        self.pending_reload = False  # a reload that could not be sent yet

    # the API
    def list_all(self) -> bool:
        """Refresh self.last from the API. False: the API did not answer (self.last stays as it was)."""
        try:
            if not self.crds_installed:
                self.crds_installed = self.install_crds()
            fresh: dict[str, list[Object]] = {}
            for plural in CRD_FILES:
                items = self.api.list(f"/apis/{GROUP_VERSION}/{plural}", self.s.selector)
                if items is None:
                    self.absent[plural] = self.absent.get(plural, 0) + 1
                    if plural in self.last and self.absent[plural] < ABSENT_POLLS:
                        fresh[plural] = self.last[plural]  # perhaps an API server still loading its CRDs
                        continue
                    if self.absent[plural] == ABSENT_POLLS or plural not in self.last:
                        self.builder.warnings.once("cluster", f"does not serve {GROUP_VERSION} {plural} (CRD "
                                                   "missing?); none scraped or loaded")
                    fresh[plural] = []
                else:
                    self.absent[plural] = 0
                    fresh[plural] = [{**o, "kind": KINDS[plural]} for o in items]
            snapshot = Snapshot()
            if fresh["servicemonitors"] or fresh["podmonitors"]:
                listed = {what: self.api.list(path) or [] for what, path in DISCOVERED.items()}
                snapshot = Snapshot(
                    services={(o["metadata"]["namespace"], o["metadata"]["name"]): o for o in listed["services"]},
                    slices=listed["slices"],
                    pods={(o["metadata"]["namespace"], o["metadata"]["name"]): o for o in listed["pods"]})
        except ApiDown as e:
            if self.api_down_since is None:
                log.warning("the API server does not answer (%s); keeping the last config until it does", e)
                self.api_down_since = str(e)
            return False
        if self.api_down_since is not None:
            log.info("the API server answers again")
            self.api_down_since = None
        self.last, self.snapshot = fresh, snapshot
        return True

    def install_crds(self) -> bool:
        for plural, file in CRD_FILES.items():
            path = self.s.crds_dir / file
            if not path.is_file():
                log.warning("no %s: %s CRD not installed (--crds names the folder)", path, plural)
                continue
            self.api.install_crd(yaml.safe_load(path.read_text()))
        return True

    # the files
    def monitor_jobs(self) -> list[Job]:
        monitors = sorted(self.last.get("servicemonitors", []) + self.last.get("podmonitors", []),
                          key=lambda o: (o["kind"], o["metadata"]["namespace"], o["metadata"]["name"]))
        return [job for monitor in monitors for job in self.builder.jobs(monitor)]

    def scrape_config(self, jobs: list[Job]) -> Object:
        return {
            "global": {"scrape_interval": self.s.scrape_interval, "evaluation_interval": self.s.scrape_interval,
                       "scrape_timeout": duration_text(min(duration_ms(self.s.scrape_interval), 10_000))},
            "rule_files": [str(self.rules_dir / "*.yaml")],
            "scrape_configs": [
                {"job_name": "prometheus", "static_configs": [{"targets": [f"127.0.0.1:{self.s.port}"]}]},
                *static_jobs(self.s.static_targets),
                *(job.config for job in jobs)],
        }

    def write_targets(self, jobs: list[Job]) -> None:
        """Each monitor job's targets as a file_sd file; Prometheus rereads a file when it changes (no reload)."""
        wanted = set()
        for job in jobs:
            groups = (endpointslice_targets if job.role == "endpointslice" else pod_targets)(
                self.snapshot, job.namespaces)
            wanted.add(job.targets_file)
            replace_if_changed(self.targets_dir / job.targets_file, json.dumps(groups, indent=1, sort_keys=True),
                               self.staging)
        for stale in self.targets_dir.glob("*.json"):
            if stale.name not in wanted:
                stale.unlink()

    def write_config(self, jobs: list[Job]) -> bool:
        """Write prometheus.yml if it changed and promtool accepts it. True: changed."""
        config = self.scrape_config(jobs)
        text = ("# Written by scripts/dev_prometheus.py from the cluster's ServiceMonitors and PodMonitors; "
                "rewritten on every change.\n" + yaml.safe_dump(config, sort_keys=False, width=1000))
        if self.config_file.is_file() and self.config_file.read_text() == text:
            return False
        candidate = self.staging / "prometheus.yml"
        candidate.write_text(text)
        problem = self.promtool("check", "config", "--syntax-only", str(candidate))
        if problem is not None:
            log.error("promtool refuses the generated prometheus.yml; keeping the last one:\n%s", problem)
            return False
        os.replace(candidate, self.config_file)
        log.info("prometheus.yml: %d scrape jobs", len(config["scrape_configs"]))
        return True

    def write_rules(self) -> bool:
        """One file per PrometheusRule, each checked by promtool; stale files removed. True: changed."""
        changed = False
        wanted: set[str] = set()
        for rule in self.last.get("prometheusrules", []):
            name = rule_file_name(rule)
            who = f"PrometheusRule {rule['metadata']['namespace']}/{rule['metadata']['name']}"
            text = yaml.safe_dump({"groups": (rule.get("spec") or {}).get("groups") or []}, sort_keys=False,
                                  width=1000)
            digest = hashlib.sha256(text.encode()).hexdigest()
            if digest not in self.checked:
                candidate = self.staging / name
                candidate.write_text(text)
                self.checked[digest] = self.promtool("check", "rules", str(candidate))
                candidate.unlink()
                if self.checked[digest] is not None:
                    log.error("%s: promtool check rules fails; not loaded:\n%s", who, self.checked[digest])
            if self.checked[digest] is not None:
                continue
            wanted.add(name)
            if replace_if_changed(self.rules_dir / name, text, self.staging):
                log.info("%s: rules written to %s", who, self.rules_dir / name)
                changed = True
        for stale in self.rules_dir.glob("*.yaml"):
            if stale.name not in wanted:
                stale.unlink()
                log.info("removed %s (its PrometheusRule is gone or no longer valid)", stale.name)
                changed = True
        return changed

    def promtool(self, *args: str) -> str | None:
        """None where promtool accepts; else what it says."""
        proc = subprocess.run([self.s.promtool, *args], capture_output=True, text=True, timeout=60)
        return None if proc.returncode == 0 else (proc.stdout + proc.stderr).strip()

    # Prometheus
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.s.port}"

    def start_prometheus(self) -> None:
        logfile = open(self.s.state_dir / "prometheus.log", "ab")  # noqa: SIM115 (the child keeps it)
        argv = [self.s.prometheus, f"--config.file={self.config_file}",
                f"--storage.tsdb.path={self.s.state_dir / 'data'}",
                f"--storage.tsdb.retention.time={self.s.retention}",
                f"--web.listen-address=127.0.0.1:{self.s.port}", "--web.enable-lifecycle"]
        log.info("starting %s", " ".join(argv))
        self.proc = subprocess.Popen(argv, stdout=logfile, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        logfile.close()

    def reload(self) -> None:
        try:
            r = httpx.post(f"{self.url}/-/reload", timeout=30)
        except httpx.HTTPError as e:
            log.warning("POST /-/reload: %s (Prometheus still starting?); retried next poll", e)
            self.pending_reload = True
            return
        self.pending_reload = False
        if r.status_code != 200:
            log.error("Prometheus refused the reload (HTTP %d): %s", r.status_code, r.text.strip()[:2000])
        else:
            log.info("Prometheus reloaded")

    def prometheus_exited(self) -> int | None:
        return self.proc.poll() if self.proc is not None else None

    def stop_prometheus(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            log.warning("Prometheus did not stop in 15 s; SIGKILL")
            self.proc.kill()
            self.proc.wait()

    # the loop
    def sync(self) -> bool:
        """One round: list, write, report whether Prometheus should reload."""
        self.list_all()
        jobs = self.monitor_jobs()
        self.write_targets(jobs)
        rules_changed = self.write_rules()
        config_changed = self.write_config(jobs)
        return rules_changed or config_changed

    def run(self) -> int:
        for d in (self.rules_dir, self.targets_dir, self.staging, self.s.state_dir / "data"):
            d.mkdir(parents=True, exist_ok=True)
        self.sync()
        if not self.config_file.is_file():
            log.error("no valid prometheus.yml could be written; see above")
            return 1
        self.start_prometheus()
        try:
            while not self.stop.wait(self.s.poll):
                code = self.prometheus_exited()
                if code is not None:
                    tail_lines = (self.s.state_dir / "prometheus.log").read_text(errors="replace").splitlines()[-20:]
                    log.error("Prometheus exited (%d); its log ends:\n%s", code, "\n".join(tail_lines))
                    return 1
                if self.sync() or self.pending_reload:
                    self.reload()
        finally:
            self.stop_prometheus()
        log.info("stopped")
        return 0


def default_cluster_dir() -> Path:
    if os.environ.get("SLUICE_DEV_CLUSTER_DIR"):
        return Path(os.environ["SLUICE_DEV_CLUSTER_DIR"])
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "sluice" / "dev-cluster"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--port", type=int, default=9090, help="Prometheus listens on 127.0.0.1:PORT (default 9090)")
    p.add_argument("--cluster-dir", type=Path, default=None,
                   help="dev-cluster.sh's state dir (default: $SLUICE_DEV_CLUSTER_DIR or ~/.cache/sluice/dev-cluster)")
    p.add_argument("--state-dir", type=Path, default=None,
                   help="prometheus.yml, rules/, data/, prometheus.log (default: <cluster dir>/prometheus)")
    p.add_argument("--prometheus", default=str(TOOLS / "prometheus"), help="the prometheus binary")
    p.add_argument("--promtool", default=str(TOOLS / "promtool"), help="the promtool binary")
    p.add_argument("--scrape-interval", default="5s",
                   help="global scrape and rule evaluation interval (default 5s); monitors may set their own")
    p.add_argument("--max-interval", default=None,
                   help="cap every monitor's interval and scrapeTimeout at this (e.g. 5s); default: as they say")
    p.add_argument("--poll", type=float, default=3.0, help="seconds between reads of the API (default 3)")
    p.add_argument("--selector", default=None,
                   help="only monitors and rules with these labels (a label selector, e.g. release=sluice)")
    p.add_argument("--static-target", type=parse_static_target, action="append", default=[],
                   metavar="NAME=HOST:PORT[/PATH]", help="an extra scrape job (repeatable), e.g. gateway=127.0.0.1:9000")
    p.add_argument("--crds", type=Path, default=REFERENCE_CRDS,
                   help=f"folder with the monitoring.coreos.com CRDs (default {REFERENCE_CRDS})")
    p.add_argument("--no-install-crds", dest="install_crds", action="store_false",
                   help="do not install the PodMonitor, ServiceMonitor and PrometheusRule CRDs where missing")
    p.add_argument("--retention", default="1d", help="--storage.tsdb.retention.time (default 1d)")
    args = p.parse_args(argv)
    for flag in ("scrape_interval", "max_interval"):
        value = getattr(args, flag)
        if value is not None:
            try:
                duration_ms(value)
            except ValueError as e:
                p.error(f"--{flag.replace('_', '-')}: {e}")
    return args


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s dev-prometheus: %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    args = parse_args(argv)
    cluster_dir = args.cluster_dir or default_cluster_dir()
    if not (cluster_dir / "api-port").is_file():
        log.error("%s has no api-port: is the dev cluster up (scripts/dev-cluster.sh up)?", cluster_dir)
        return 1
    for tool in (args.prometheus, args.promtool):
        if not os.access(tool, os.X_OK):
            log.error("%s is missing (scripts/get-promtool.sh puts prometheus and promtool in .tools/bin)", tool)
            return 1
    settings = Settings(
        port=args.port, state_dir=(args.state_dir or cluster_dir / "prometheus").resolve(),
        prometheus=args.prometheus, promtool=args.promtool, scrape_interval=args.scrape_interval,
        max_interval_ms=duration_ms(args.max_interval) if args.max_interval else None, poll=args.poll,
        selector=args.selector, static_targets=args.static_target, install_crds=args.install_crds,
        crds_dir=args.crds, retention=args.retention)
    controller = DevPrometheus(settings, ClusterAccess.from_state(cluster_dir.resolve()))
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: controller.stop.set())
    return controller.run()


if __name__ == "__main__":
    sys.exit(main())
