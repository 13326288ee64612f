"""Distributed layouts as the operator renders them: `sluice serve` layout flags, a LeaderWorkerSet group's
rendezvous (LWS_WORKER_INDEX, LWS_LEADER_ADDRESS, the leader's `dist` port), worker probes, /dev/shm, and
that every rendered command line is one the engine's own parser accepts (issue 12, acceptance 5)."""

from __future__ import annotations

import copy
import json
import re
from typing import Any

import kubernetes_validate
import pytest
import yaml
from operator_schemas import EXAMPLES, crd_schema, load_yaml, reference_crd, schema_errors

from sluice_engine.entrypoints.cli import main
from sluice_operator.reconcile import layout_of, reconcile
from sluice_operator.spec import parse_endpoint
from sluice_operator.workload import MASTER_PORT, PORT

K8S_VERSIONS = ["1.30", kubernetes_validate.latest_version()]
BUILTIN_KINDS = {"ConfigMap", "Deployment", "Service", "PodDisruptionBudget"}
LWS_CRD = "leaderworkerset.x-k8s.io_leaderworkersets.yaml"
# What the LWS pod webhook injects into every container of a group (group 0 of LeaderWorkerSet "llama-70b").
LWS_ENV = {"LWS_LEADER_ADDRESS": "llama-70b-0.llama-70b-0.inference", "LWS_GROUP_SIZE": "2"}

TP8_PP2 = """\
apiVersion: sluice.dev/v1alpha1
kind: InferenceEndpoint
metadata: {name: llama-70b, namespace: inference}
spec:
  model: {uri: pvc://llama-weights/Llama-3.1-70B-Instruct}
  accelerator: {gpusPerNode: 8}
  parallelism: {tensor: 8, pipeline: 2}
  cost: {gpuHourUSD: 2.5}
"""


def endpoint(**spec: Any) -> dict[str, Any]:
    doc = {"apiVersion": "sluice.dev/v1alpha1", "kind": "InferenceEndpoint",
           "metadata": {"name": "demo", "namespace": "ml"}, "spec": {"model": {"uri": "hf://org/model"}}}
    doc["spec"].update(copy.deepcopy(spec))
    return doc


def workload_of(manifests: list[dict[str, Any]]) -> dict[str, Any]:
    (wl,) = [m for m in manifests if m["kind"] in ("Deployment", "LeaderWorkerSet")]
    return wl


def templates(wl: dict[str, Any]) -> dict[str, dict[str, Any]]:
    if wl["kind"] == "Deployment":
        return {"pod": wl["spec"]["template"]}
    lwt = wl["spec"]["leaderWorkerTemplate"]
    return {"leader": lwt["leaderTemplate"], "worker": lwt["workerTemplate"]}


def engine_of(template: dict[str, Any]) -> dict[str, Any]:
    (engine,) = template["spec"]["containers"]  # one container, one `sluice serve`
    assert engine["command"] == ["sluice", "serve"]
    return engine


def flags(engine: dict[str, Any]) -> dict[str, str]:
    args = engine["args"]
    return dict(zip(args[::2], args[1::2], strict=True))


def expand(args: list[str], env: dict[str, str]) -> list[str]:
    """The kubelet's $(VAR) expansion of container args (a variable it does not know stays as written)."""
    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), a) for a in args]


def engine_parses(args: list[str]):
    """What `sluice serve ARGS` would run with: the engine's own parser (SystemExit on a bad flag or value)."""
    from sluice_engine.entrypoints.cli import build_parser

    return build_parser().parse_args(["serve", *args])


def shm_volume(template: dict[str, Any]) -> dict[str, Any] | None:
    pod = template["spec"]
    mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    vol = next((v for v in pod["volumes"] if mounts.get(v["name"]) == "/dev/shm"), None)
    return vol and vol["emptyDir"]


def validate(manifests: list[dict[str, Any]]) -> None:
    """kubernetes-validate strict for built-in kinds; the reference CRD (and each pod template strictly) for
    a LeaderWorkerSet."""
    for m in manifests:
        if m["kind"] in BUILTIN_KINDS:
            for version in K8S_VERSIONS:
                kubernetes_validate.validate(m, version, strict=True)
        elif m["kind"] == "LeaderWorkerSet":
            assert schema_errors(crd_schema(reference_crd(LWS_CRD), "v1"), m) == []
            for role, template in templates(m).items():
                pod_template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"x-{role}"},
                                "template": template}
                for version in K8S_VERSIONS:
                    kubernetes_validate.validate(pod_template, version, strict=True)


# -- acceptance 5: TP 8 x PP 2 on 8-GPU nodes -------------------------------------------------------------------
def test_tp8_pp2_renders_a_leaderworkerset_of_two_serves(tmp_path, capsys):
    path = tmp_path / "tp8pp2.yaml"
    path.write_text(TP8_PP2)
    assert main(["render", "-f", str(path)]) == 0
    manifests = list(yaml.safe_load_all(capsys.readouterr().out))
    validate(manifests)

    lws = workload_of(manifests)
    assert lws["kind"] == "LeaderWorkerSet"
    lwt = lws["spec"]["leaderWorkerTemplate"]
    assert lwt["size"] == 2
    assert lwt["restartPolicy"] == "RecreateGroupOnPodRestart"  # one failed pod recreates the group
    assert lws["spec"]["startupPolicy"] == "LeaderCreated"  # the leader is Ready only once workers joined
    # Each group's own headless Service (named after its leader pod), not one named like the LeaderWorkerSet:
    # that name is the endpoint's Service's.
    assert lws["spec"]["networkConfig"] == {"subdomainPolicy": "UniquePerReplica"}
    assert lws["metadata"]["name"] in {m["metadata"]["name"] for m in manifests if m["kind"] == "Service"}

    leader, worker = engine_of(lwt["leaderTemplate"]), engine_of(lwt["workerTemplate"])
    lf, wf = flags(leader), flags(worker)
    for f in (lf, wf):
        assert (f["--tensor-parallel-size"], f["--pipeline-parallel-size"]) == ("8", "2")
        assert f["--nnodes"] == "2"
        assert f["--master-addr"] == "$(LWS_LEADER_ADDRESS)" and f["--master-port"] == str(MASTER_PORT)
        assert f["--device"] == "cuda" and f["--port"] == str(PORT)
    assert lf["--node-rank"] == "0" and wf["--node-rank"] == "$(LWS_WORKER_INDEX)"
    # Apart from the node rank, leader and worker run the same command line.
    assert {k: v for k, v in lf.items() if k != "--node-rank"} == {k: v for k, v in wf.items() if k != "--node-rank"}

    # The master port is declared, by name, on the leader: node 0 hosts the rendezvous.
    assert {"name": "dist", "containerPort": MASTER_PORT, "protocol": "TCP"} in leader["ports"]
    assert [p["name"] for p in worker["ports"]] == ["http"]

    # What each pod's `sluice serve` runs with, after the kubelet expands LWS's variables.
    lead = engine_parses(expand(leader["args"], {**LWS_ENV, "LWS_WORKER_INDEX": "0"}))
    work = engine_parses(expand(worker["args"], {**LWS_ENV, "LWS_WORKER_INDEX": "1"}))
    for ns in (lead, work):
        assert (ns.tensor_parallel_size, ns.pipeline_parallel_size, ns.nnodes) == (8, 2, 2)
        assert (ns.master_addr, ns.master_port) == (LWS_ENV["LWS_LEADER_ADDRESS"], MASTER_PORT)
    assert (lead.node_rank, work.node_rank) == (0, 1)

    # Every device of the replica: 8 GPUs a pod x 2 pods = tensor x pipeline, one rank per GPU. The leader's
    # flags carry the whole layout, which is what sluice_num_gpus (and so cost per token) counts.
    for template in (lwt["leaderTemplate"], lwt["workerTemplate"]):
        res = engine_of(template)["resources"]
        assert res["limits"]["nvidia.com/gpu"] == res["requests"]["nvidia.com/gpu"] == 8
        assert shm_volume(template) == {"medium": "Memory", "sizeLimit": "16Gi"}  # NCCL's shared memory
    assert 8 * lwt["size"] == lead.tensor_parallel_size * lead.pipeline_parallel_size == 16
    # The price is per GPU (the engine's sluice_num_gpus counts them); it reaches the leader through the
    # ConfigMap file the engine re-reads, so editing it rolls no group.
    assert flags(leader)["--objectives-file"] == "/etc/sluice/objectives.json"
    cm = next(m for m in manifests if m["kind"] == "ConfigMap")
    assert json.loads(cm["data"]["objectives.json"])["gpu-hour-usd"] == 2.5


def test_workers_are_probed_on_their_health_and_serve_no_api():
    manifests = reconcile(parse_endpoint(yaml.safe_load(TP8_PP2)))
    lwt = workload_of(manifests)["spec"]["leaderWorkerTemplate"]
    leader, worker = engine_of(lwt["leaderTemplate"]), engine_of(lwt["workerTemplate"])
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert worker[probe]["httpGet"] == {"path": "/health", "port": "http", "scheme": "HTTP"}
    assert leader["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert leader["livenessProbe"]["httpGet"]["path"] == "/health"
    http = {p["name"]: p["containerPort"] for p in worker["ports"]}
    assert http == {"http": PORT}  # the worker's /health listens on --port, like the leader's API
    assert lwt["workerTemplate"]["metadata"]["labels"]["sluice.dev/serves"] == "false"
    (svc,) = [m for m in manifests if m["kind"] == "Service"]
    labels = lwt["workerTemplate"]["metadata"]["labels"]
    assert not all(labels.get(k) == v for k, v in svc["spec"]["selector"].items())  # no requests to workers


# -- single-pod layouts -------------------------------------------------------------------------------------
@pytest.mark.parametrize(("spec", "layout_flags", "shm"), [
    pytest.param({}, {}, "2Gi", id="one-gpu"),
    pytest.param({"parallelism": {"tensor": 4}}, {"--tensor-parallel-size": "4"}, "8Gi", id="tp4"),
    pytest.param({"parallelism": {"tensor": 2, "pipeline": 2}},
                 {"--tensor-parallel-size": "2", "--pipeline-parallel-size": "2"}, "8Gi", id="tp2-pp2"),
    pytest.param({"accelerator": {"gpusPerNode": 8}, "parallelism": {"tensor": 4, "pipeline": 2}},
                 {"--tensor-parallel-size": "4", "--pipeline-parallel-size": "2"}, "16Gi", id="fits-one-node"),
    pytest.param({"accelerator": {"type": "cpu"}}, {}, None, id="cpu"),
    pytest.param({"accelerator": {"type": "cpu"}, "parallelism": {"tensor": 3}},
                 {"--tensor-parallel-size": "3"}, "6Gi", id="cpu-tp3"),
])
def test_single_pod_layouts(spec, layout_flags, shm):
    ep = parse_endpoint(endpoint(**spec))
    manifests = reconcile(ep)
    validate(manifests)
    wl = workload_of(manifests)
    assert wl["kind"] == "Deployment"
    template = wl["spec"]["template"]
    engine = engine_of(template)
    f = flags(engine)
    assert {k: v for k, v in f.items() if "parallel" in k} == layout_flags  # left out at 1
    assert not {"--nnodes", "--node-rank", "--master-addr", "--master-port"} & set(f)
    assert [p["name"] for p in engine["ports"]] == ["http"]
    volume = shm_volume(template)
    assert (volume and volume["sizeLimit"]) == shm
    if volume:
        assert volume["medium"] == "Memory"
    ns = engine_parses(engine["args"])
    layout = layout_of(ep)
    assert ns.tensor_parallel_size * ns.pipeline_parallel_size == layout.ranks
    assert engine.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0) == layout.gpus_per_pod


# -- CPU over two pods (the kind e2e's multi-node case) -------------------------------------------------------
def test_cpu_pipeline_over_two_pods():
    path = next(p for p in EXAMPLES if p.name == "cpu-pipeline-2node.yaml")
    ep = parse_endpoint(load_yaml(path))
    manifests = reconcile(ep)
    validate(manifests)
    lws = workload_of(manifests)
    assert lws["kind"] == "LeaderWorkerSet" and lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    env = {"LWS_LEADER_ADDRESS": "smollm2-pp2-0.smollm2-pp2-0.default"}
    for index, (role, template) in enumerate(templates(lws).items()):
        engine = engine_of(template)
        assert "nvidia.com/gpu" not in str(engine.get("resources")) and "tolerations" not in template["spec"]
        assert shm_volume(template) == {"medium": "Memory", "sizeLimit": "2Gi"}  # one rank a pod
        ns = engine_parses(expand(engine["args"], {**env, "LWS_WORKER_INDEX": str(index)}))
        assert (ns.device, ns.tensor_parallel_size, ns.pipeline_parallel_size) == ("cpu", 1, 2)
        assert (ns.nnodes, ns.node_rank, ns.master_addr) == (2, index, env["LWS_LEADER_ADDRESS"]), role
        assert ns.distributed_timeout == 120.0


def test_nodes_spread_gpus_wider_than_needed():
    ep = parse_endpoint(endpoint(accelerator={"gpusPerNode": 8}, parallelism={"tensor": 2, "pipeline": 2, "nodes": 2}))
    manifests = reconcile(ep)
    validate(manifests)
    lwt = workload_of(manifests)["spec"]["leaderWorkerTemplate"]
    assert lwt["size"] == 2
    for template in (lwt["leaderTemplate"], lwt["workerTemplate"]):
        assert engine_of(template)["resources"]["limits"]["nvidia.com/gpu"] == 2
        assert shm_volume(template)["sizeLimit"] == "4Gi"


# -- the contract, over every example -------------------------------------------------------------------------
@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_rendered_command_line_is_one_the_engine_accepts(path):
    """Each pod's `sluice serve` args, once the kubelet has expanded the variables LWS injects, parse with the
    engine's parser, and they carry the endpoint's whole layout."""
    ep = parse_endpoint(load_yaml(path))
    layout = layout_of(ep)
    for wl in [m for m in reconcile(ep) if m["kind"] in ("Deployment", "LeaderWorkerSet")
               and m["metadata"]["labels"]["app.kubernetes.io/component"] != "endpoint-picker"]:  # routing.py
        for index, template in enumerate(templates(wl).values()):
            engine = engine_of(template)
            args = engine["args"]
            used = set(re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", " ".join(args)))
            # Only what LWS injects, or the container's own env from the pod's fields (a decode pod's POD_IP).
            own = {e["name"] for e in engine.get("env", []) if "fieldRef" in e.get("valueFrom", {})}
            lws = used - own
            assert lws <= {"LWS_LEADER_ADDRESS", "LWS_WORKER_INDEX"}
            assert not lws or wl["kind"] == "LeaderWorkerSet"
            ns = engine_parses(expand(args, {"LWS_LEADER_ADDRESS": "leader.example", "LWS_WORKER_INDEX": str(index),
                                             "POD_IP": "10.0.0.7"}))
            assert (ns.tensor_parallel_size, ns.pipeline_parallel_size) == (layout.tensor, layout.pipeline)
            assert ns.nnodes == layout.pods_per_replica and ns.node_rank == index
