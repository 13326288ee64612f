"""InferenceEndpoint validation: pydantic (what `sluice render` and the operator check) and the CRD (schema
+ CEL, what the API server checks) accept the same endpoints and reject bad ones with the intended message."""

from __future__ import annotations

import argparse
import copy
import itertools
import re
from typing import Any

import pytest
from operator_schemas import CRD_FILE, EXAMPLES, api_server_errors, crd_schema, load_yaml

from sluice_operator.engine_flags import OPERATOR_OWNED_FLAGS, PASSTHROUGH_FLAGS, check_arg, render_args
from sluice_operator.layout import LayoutError, plan_layout
from sluice_operator.reconcile import reconcile
from sluice_operator.spec import MAX_NAME_LENGTH, SpecError, parse_endpoint

BASE = {
    "apiVersion": "sluice.dev/v1alpha1",
    "kind": "InferenceEndpoint",
    "metadata": {"name": "demo", "namespace": "ml"},
    "spec": {"model": {"uri": "hf://org/model"}},
}


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    return crd_schema(load_yaml(CRD_FILE))


def with_spec(**spec: Any) -> dict[str, Any]:
    doc = copy.deepcopy(BASE)
    doc["spec"].update(spec)
    return doc


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_are_valid_everywhere(path, schema):
    doc = load_yaml(path)
    parse_endpoint(doc)
    assert api_server_errors(schema, doc) == []


def test_defaults():
    ep = parse_endpoint(BASE)
    s = ep.spec
    assert s.fixed_replicas == 1 and s.scaling is None
    assert s.accelerator.type == "gpu" and s.accelerator.resource_name == "nvidia.com/gpu"
    assert (s.parallelism.tensor, s.parallelism.pipeline) == (1, 1)
    assert s.engine.dtype == "auto" and s.engine.args == {}
    assert s.model.cache.type == "emptyDir" and s.model.name == "model"
    assert s.startup_grace_seconds == 600
    assert (s.rollout.max_surge, s.rollout.max_unavailable) == (0, 1)  # no spare GPUs for a rollout
    scaled = parse_endpoint(with_spec(scaling={"maxReplicas": 3})).spec
    assert scaled.fixed_replicas is None and scaled.scaling.min_replicas == 1
    assert scaled.scaling.target_queue_depth == 4 and scaled.scaling.scale_down_delay_seconds == 300


@pytest.mark.parametrize("rollout", [{"maxSurge": 1, "maxUnavailable": 0}, {"maxSurge": "25%"},
                                     {"maxUnavailable": "100%"}, {"maxSurge": 2, "maxUnavailable": "0%"}])
def test_valid_rollouts_pass_both_validators(rollout, schema):
    doc = with_spec(rollout=rollout)
    parse_endpoint(doc)
    assert api_server_errors(schema, doc) == []


# (document, what pydantic says, what the API server says)
INVALID = [
    pytest.param(with_spec(replicas=2, scaling={"maxReplicas": 3}),
                 "spec: set either replicas (a fixed count) or scaling (autoscaling), not both",
                 "set either replicas (a fixed count) or scaling (autoscaling), not both", id="replicas-xor-scaling"),
    pytest.param(with_spec(scaling={"minReplicas": 4, "maxReplicas": 3}),
                 "spec.scaling: scaling.minReplicas must not exceed scaling.maxReplicas",
                 "scaling.minReplicas must not exceed scaling.maxReplicas", id="min-above-max"),
    pytest.param(with_spec(scaling={"minReplicas": 0, "maxReplicas": 2, "warmPool": {"replicas": 3}}),
                 "spec.scaling: scaling.warmPool.replicas must not exceed scaling.maxReplicas",
                 "scaling.warmPool.replicas must not exceed scaling.maxReplicas", id="warm-pool-above-max"),
    pytest.param(with_spec(scaling={"maxReplicas": 2, "onMetricsOutage": {"replicas": 5}}),
                 "scaling.onMetricsOutage.replicas must not exceed scaling.maxReplicas",
                 "scaling.onMetricsOutage.replicas must not exceed scaling.maxReplicas", id="outage-above-max"),
    pytest.param(with_spec(scaling={"minReplicas": 0}),
                 "spec.scaling.maxReplicas: Field required", "maxReplicas", id="max-required"),
    pytest.param(with_spec(scaling={"maxReplicas": 0}),
                 "spec.scaling.maxReplicas: Input should be greater than or equal to 1",
                 "0 is less than the minimum of 1", id="max-zero"),
    pytest.param(with_spec(model={"uri": "https://example.com/model"}),
                 "spec.model: model.uri must be hf://<org>/<name>, pvc://<claim>/<path> or s3://<bucket>/<prefix>",
                 "model.uri must be hf://<org>/<name>, pvc://<claim>/<path> or s3://<bucket>/<prefix>", id="bad-uri"),
    pytest.param(with_spec(model={"uri": "hf://just-a-name"}), "model.uri must be hf://<org>/<name>",
                 "model.uri must be hf://<org>/<name>", id="hf-uri-needs-org"),
    pytest.param(with_spec(model={"uri": "s3://bucket/m", "revision": "v2"}),
                 "model.revision applies to hf:// models only", "model.revision applies to hf:// models only",
                 id="revision-not-hf"),
    pytest.param(with_spec(model={"uri": "pvc://claim/x", "cache": {"type": "pvc"}}),
                 "spec.model.cache: model.cache.claimName is required when model.cache.type is pvc",
                 "model.cache.claimName is required when model.cache.type is pvc", id="pvc-cache-claim"),
    pytest.param(with_spec(model={"uri": "pvc://claim/x", "cache": {"type": "hostPath"}}),
                 "model.cache.path is required when model.cache.type is hostPath",
                 "model.cache.path is required when model.cache.type is hostPath", id="hostpath-cache-path"),
    pytest.param(with_spec(accelerator={"gpusPerNode": 8}, parallelism={"tensor": 16}),
                 "spec: parallelism.tensor must not exceed accelerator.gpusPerNode",
                 "parallelism.tensor must not exceed accelerator.gpusPerNode", id="tensor-spans-nodes"),
    pytest.param(with_spec(accelerator={"gpusPerNode": 8}, parallelism={"tensor": 4, "pipeline": 3}),
                 "spec: parallelism.pipeline must split evenly",
                 "parallelism.pipeline must split evenly", id="uneven-pipeline"),
    pytest.param(with_spec(accelerator={"type": "cpu"}, parallelism={"pipeline": 3, "nodes": 2}),
                 "spec.parallelism: parallelism.pipeline must be a multiple of parallelism.nodes",
                 "parallelism.pipeline must be a multiple of parallelism.nodes", id="cpu-nodes-uneven"),
    pytest.param(with_spec(accelerator={"gpusPerNode": 8}, parallelism={"tensor": 4, "pipeline": 4, "nodes": 1}),
                 "spec: parallelism.nodes is too few", "parallelism.nodes is too few", id="nodes-too-few"),
    pytest.param(with_spec(parallelism={"nodes": 0}),
                 "spec.parallelism.nodes: Input should be greater than or equal to 1",
                 "0 is less than the minimum of 1", id="nodes-zero"),
    pytest.param(with_spec(accelerator={"type": "cpu"}, engine={"quantization": "awq"}),
                 "spec: engine.quantization fp8, awq and gptq run on GPUs only",
                 "engine.quantization fp8, awq and gptq run on GPUs only", id="awq-on-cpu"),
    pytest.param(with_spec(engine={"quantization": "q4_1"}),
                 "spec: engine.quantization q8_0, q4_0 and q4_1 (GGUF) run on CPUs only",
                 "engine.quantization q8_0, q4_0 and q4_1 (GGUF) run on CPUs only", id="gguf-on-gpu"),
    pytest.param(with_spec(engine={"quantization": "int8"}), "spec.engine.quantization: Input should be",
                 "spec.engine.quantization: 'int8' is not one of", id="unknown-quantization"),
    pytest.param(with_spec(accelerator={"type": "cpu"}, engine={"kvCacheDtype": "fp8"}),
                 "spec: engine.kvCacheDtype fp8 runs on GPUs only",
                 "engine.kvCacheDtype fp8 runs on GPUs only", id="fp8-kv-on-cpu"),
    pytest.param(with_spec(engine={"kvCacheDtype": "fp16"}), "spec.engine.kvCacheDtype: Input should be",
                 "spec.engine.kvCacheDtype: 'fp16' is not one of", id="unknown-kv-cache-dtype"),
    pytest.param(with_spec(engine={"args": {"kv-cache-dtype": "fp8"}}),
                 "spec.engine.args: 'kv-cache-dtype' is set by the operator from engine.kvCacheDtype",
                 "engine.args keys must be engine flags", id="kv-cache-dtype-flag"),
    pytest.param(with_spec(accelerator={"type": "cpu", "product": "NVIDIA-L4"}),
                 "spec.accelerator: accelerator.product and accelerator.gpusPerNode apply to GPUs only",
                 "accelerator.product and accelerator.gpusPerNode apply to GPUs only", id="cpu-product"),
    pytest.param(with_spec(engine={"args": {"tensor-parallel": 2}}),
                 "spec.engine.args: 'tensor-parallel' is not an engine flag",
                 "engine.args keys must be engine flags", id="unknown-flag"),
    pytest.param(with_spec(engine={"args": {"tensor-parallel-size": 2}}),
                 "spec.engine.args: 'tensor-parallel-size' is set by the operator from parallelism.tensor",
                 "engine.args keys must be engine flags", id="layout-flag"),
    pytest.param(with_spec(engine={"args": {"node-rank": 1}}),
                 "'node-rank' is set by the operator from (LWS_WORKER_INDEX",
                 "engine.args keys must be engine flags", id="rendezvous-flag"),
    pytest.param(with_spec(engine={"args": {"--max-num-seqs": 2}}),
                 "'--max-num-seqs' is not an engine flag", "engine.args keys must be engine flags", id="dashed-flag"),
    pytest.param(with_spec(engine={"args": {"served-model-name": "x"}}),
                 "'served-model-name' is set by the operator from model.servedName",
                 "engine.args keys must be engine flags", id="owned-flag"),
    pytest.param(with_spec(engine={"args": {"gpu-memory-utilization": 0.8}}),
                 "quote it", "is not valid under any of the given schemas", id="unquoted-fraction"),
    pytest.param(with_spec(engine={"args": {"no-prefix-caching": True}}),
                 "quote it", "is not valid under any of the given schemas", id="unquoted-switch"),
    pytest.param(with_spec(engine={"dtype": "fp8"}), "spec.engine.dtype: Input should be 'auto'",
                 "'fp8' is not one of", id="bad-dtype"),
    pytest.param(with_spec(rollout={"maxSurge": 0, "maxUnavailable": "0%"}),
                 "spec.rollout: rollout.maxSurge and rollout.maxUnavailable must not both be 0",
                 "rollout.maxSurge and rollout.maxUnavailable must not both be 0", id="rollout-stuck"),
    pytest.param(with_spec(rollout={"maxSurge": "1"}), "rollout.maxSurge must be a count >= 0 or a percentage",
                 "rollout.maxSurge must be a count >= 0 or a percentage", id="rollout-string-count"),
    pytest.param(with_spec(rollout={"maxUnavailable": -1}),
                 "rollout.maxUnavailable must be a count >= 0 or a percentage",
                 "rollout.maxUnavailable must be a count >= 0 or a percentage", id="rollout-negative"),
    pytest.param(with_spec(replicass=2), "spec.replicass: Extra inputs are not permitted",
                 "Additional properties are not allowed ('replicass' was unexpected)", id="unknown-field"),
    pytest.param({**BASE, "spec": {}}, "spec.model: Field required", "'model' is a required property",
                 id="model-required"),
    # spec.adapters (LoRA): unique names, none the served name, sources as the model's, one pod per replica.
    pytest.param(with_spec(adapters=[{"name": "sql", "source": "hf://org/sql-a"},
                                     {"name": "sql", "source": "hf://org/sql-b"}]),
                 "spec: adapters[].name must be unique", "adapters[].name must be unique", id="adapter-duplicate"),
    pytest.param(with_spec(model={"uri": "hf://org/model", "servedName": "chat"},
                           adapters=[{"name": "chat", "source": "hf://org/chat-lora"}]),
                 "spec: adapters[].name must not be the model's served name",
                 "adapters[].name must not be the model's served name", id="adapter-is-served-name"),
    pytest.param(with_spec(adapters=[{"name": "model", "source": "hf://org/model-lora"}]),
                 "spec: adapters[].name must not be the model's served name",
                 "adapters[].name must not be the model's served name", id="adapter-is-default-served-name"),
    pytest.param(with_spec(model={"uri": "s3://bucket/llama-3.1//"},
                           adapters=[{"name": "llama-3.1", "source": "s3://bucket/lora/"}]),
                 "spec: adapters[].name must not be the model's served name",
                 "adapters[].name must not be the model's served name", id="adapter-is-served-name-trailing-slash"),
    pytest.param(with_spec(adapters=[{"name": "sql", "source": "https://example.com/sql-lora"}]),
                 "spec.adapters[0]: adapters[].source must be hf://<org>/<name>, pvc://<claim>/<path> or s3://",
                 "adapters[].source must be hf://<org>/<name>, pvc://<claim>/<path> or s3://",
                 id="adapter-bad-source"),
    pytest.param(with_spec(adapters=[{"name": "sql", "source": "gs://bucket/sql-lora"}]),
                 "spec.adapters[0]: adapters[].source must be", "adapters[].source must be", id="adapter-gcs-source"),
    pytest.param(with_spec(adapters=[{"name": "sql/v2", "source": "hf://org/sql-lora"}]),
                 "spec.adapters[0]: adapters[].name must be 1 to 128 letters",
                 "adapters[].name must be 1 to 128 letters", id="adapter-bad-name"),
    pytest.param(with_spec(adapters=[{"name": "a" * 129, "source": "hf://org/sql-lora"}]),
                 "spec.adapters[0].name: String should have at most 128 characters",
                 "is too long", id="adapter-long-name"),
    pytest.param(with_spec(adapters=[{"name": "sql", "source": "s3://bucket/sql/", "revision": "v2"}]),
                 "spec.adapters[0]: adapters[].revision applies to hf:// sources only",
                 "adapters[].revision applies to hf:// sources only", id="adapter-revision-not-hf"),
    pytest.param(with_spec(adapters=[{"name": "sql"}]), "spec.adapters[0].source: Field required",
                 "'source' is a required property", id="adapter-source-required"),
    pytest.param(with_spec(adapters=[{"name": "sql", "source": "hf://org/sql-lora"}],
                           parallelism={"tensor": 2, "pipeline": 2}, accelerator={"gpusPerNode": 2}),
                 "spec: LoRA adapters (spec.adapters, engine.args enable-lora) run on replicas of one pod",
                 "LoRA adapters (spec.adapters, engine.args enable-lora) run on replicas of one pod",
                 id="adapters-multi-node"),
    pytest.param(with_spec(engine={"args": {"enable-lora": "true"}}, parallelism={"pipeline": 2, "nodes": 2}),
                 "spec: LoRA adapters (spec.adapters, engine.args enable-lora) run on replicas of one pod",
                 "LoRA adapters (spec.adapters, engine.args enable-lora) run on replicas of one pod",
                 id="enable-lora-nodes"),
    pytest.param(with_spec(engine={"args": {"enable-lora": "false"}},
                           adapters=[{"name": "sql", "source": "hf://org/sql-lora"}]),
                 "spec: engine.args enable-lora \"false\" contradicts spec.adapters",
                 "engine.args enable-lora \"false\" contradicts spec.adapters", id="enable-lora-false-with-adapters"),
    pytest.param(with_spec(adapters=[{"name": f"a{i}", "source": "hf://org/a"} for i in range(65)]),
                 "spec.adapters: List should have at most 64 items", "is too long", id="too-many-adapters"),
    pytest.param(with_spec(engine={"args": {"lora-modules-file": "/x.json"}}),
                 "'lora-modules-file' is set by the operator from spec.adapters",
                 "engine.args keys must be engine flags", id="lora-modules-file-flag"),
    pytest.param(with_spec(engine={"args": {"api-key": "secret"}}),
                 "'api-key' is set by the operator from (pod.env SLUICE_API_KEY",
                 "engine.args keys must be engine flags", id="api-key-flag"),
    pytest.param({**BASE, "metadata": {"name": "a" * 41}}, "metadata.name must be at most 40 characters",
                 "metadata.name must be at most 40 characters", id="long-name"),
    pytest.param({**BASE, "metadata": {"name": "Llama"}}, "metadata.name must start with a lowercase letter",
                 "metadata.name must start with a lowercase letter", id="uppercase-name"),
    # A DNS-1123 name, which the API server's own name check takes for a custom resource, but not a DNS-1035
    # label: neither the endpoint's Service nor (multi-node) its LeaderWorkerSet could be created (LWS's webhook
    # checks NameIsDNS1035Label), so the CRD's name rule refuses it at admission, whatever the layout.
    pytest.param({**BASE, "metadata": {"name": "70b-chat", "namespace": "ml"}},
                 "metadata.name must start with a lowercase letter",
                 "metadata.name must start with a lowercase letter", id="digit-first-name"),
    pytest.param({**with_spec(accelerator={"gpusPerNode": 8}, parallelism={"tensor": 8, "pipeline": 2}),
                  "metadata": {"name": "70b-chat", "namespace": "ml"}},
                 "metadata.name must start with a lowercase letter",
                 "metadata.name must start with a lowercase letter", id="digit-first-name-multi-node"),
]


@pytest.mark.parametrize(("doc", "python_message", "server_message"), INVALID)
def test_invalid_is_rejected_with_its_message(doc, python_message, server_message, schema):
    with pytest.raises(SpecError) as err:
        parse_endpoint(doc)
    assert python_message in str(err.value)
    errors = api_server_errors(schema, doc)
    assert any(server_message in e for e in errors), errors


# What LWS v0.9.0's webhook (pkg/webhooks/leaderworkerset_webhook.go, generalValidate) asks of a LeaderWorkerSet's
# metadata.name: apimachinery's NameIsDNS1035Label, i.e. IsDNS1035Label, this pattern and at most 63 characters.
LWS_NAME = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
LWS_NAME_MAX = 63


def test_admitted_names_name_leader_worker_sets_lws_admits(schema):
    """The CRD's name rules hold for every layout and are at least LWS's: the longest name admitted names
    LeaderWorkerSets (the serving one and the warm pool's, `<name>-warm`) that LWS's webhook takes."""
    name = f"llama-{'7' * (MAX_NAME_LENGTH - 7)}b"
    assert len(name) == MAX_NAME_LENGTH
    doc = with_spec(accelerator={"gpusPerNode": 8}, parallelism={"tensor": 8, "pipeline": 2},
                    scaling={"minReplicas": 0, "maxReplicas": 2, "warmPool": {"replicas": 1}})
    doc["metadata"] = {"name": name, "namespace": "ml"}
    assert api_server_errors(schema, doc) == []
    names = [m["metadata"]["name"] for m in reconcile(parse_endpoint(doc)) if m["kind"] == "LeaderWorkerSet"]
    assert names == [name, f"{name}-warm"]
    for lws in names:
        assert LWS_NAME.fullmatch(lws) and len(lws) <= LWS_NAME_MAX, lws


def test_errors_name_every_field():
    doc = with_spec(scaling={"maxReplicas": 0, "targetQueueDepth": 0}, engine={"dtype": "x"})
    with pytest.raises(SpecError) as err:
        parse_endpoint(doc)
    text = str(err.value)
    assert text.startswith("invalid InferenceEndpoint 'demo':")
    for field in ("spec.engine.dtype:", "spec.scaling.maxReplicas:", "spec.scaling.targetQueueDepth:"):
        assert field in text


def _layout_doc(tensor: int, pipeline: int, gpus_per_node: int | None, cpu: bool,
                nodes: int | None = None) -> dict[str, Any]:
    accelerator: dict[str, Any] = {"type": "cpu"} if cpu else {}
    if gpus_per_node is not None:
        accelerator["gpusPerNode"] = gpus_per_node
    parallelism = {"tensor": tensor, "pipeline": pipeline}
    if nodes is not None:
        parallelism["nodes"] = nodes
    return with_spec(accelerator=accelerator, parallelism=parallelism)


def test_layout_rules_agree_with_layout_maths(schema):
    """The CEL rules, their Python twins and plan_layout accept exactly the same layouts."""
    cases = itertools.product(range(1, 9), range(1, 5), [None, 1, 2, 4, 6, 8], [False, True], [None, 1, 2, 4])
    seen = {True: 0, False: 0}
    for tensor, pipeline, gpn, cpu, nodes in cases:
        if cpu and gpn is not None:
            continue  # rejected for another reason (gpusPerNode on a CPU endpoint)
        doc = _layout_doc(tensor, pipeline, gpn, cpu, nodes)
        try:
            plan_layout(tensor, pipeline, gpn, cpu=cpu, nodes=nodes)
            placeable = True
        except LayoutError:
            placeable = False
        try:
            parse_endpoint(doc)
            python_ok = True
        except SpecError:
            python_ok = False
        server_ok = api_server_errors(schema, doc) == []
        assert placeable == python_ok == server_ok, (tensor, pipeline, gpn, cpu, nodes, placeable, python_ok,
                                                     server_ok)
        seen[placeable] += 1
    assert seen[True] > 30 and seen[False] > 30


def test_engine_flags_match_the_engine():
    """PASSTHROUGH_FLAGS + OPERATOR_OWNED_FLAGS are exactly `sluice serve`'s flags, with matching types."""
    from sluice_engine.entrypoints.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    serve = sub.choices["serve"]
    flags = {}
    for action in serve._actions:
        long = [o for o in action.option_strings if o.startswith("--")]
        if long and long[0] != "--help":
            flags[long[0][2:]] = action
    assert set(flags) == set(PASSTHROUGH_FLAGS) | set(OPERATOR_OWNED_FLAGS)
    for name, kind in PASSTHROUGH_FLAGS.items():
        action = flags[name]
        if isinstance(kind, tuple):
            assert tuple(action.choices) == kind, name
        elif kind is bool:
            assert action.nargs == 0, name
        elif kind in (int, float):
            assert action.type is kind, name
        else:
            assert action.type not in (int, float) and action.nargs is None, name


def test_engine_args_values_and_rendering():
    check_arg("max-num-seqs", 8)
    check_arg("max-num-seqs", "8")
    check_arg("gpu-memory-utilization", "0.85")
    check_arg("kv-cache-memory", "4GiB")
    check_arg("attention-backend", "torch")
    check_arg("distributed-timeout", "120")
    check_arg("distributed-timeout", 300)
    for flag, value, why in [("max-num-seqs", "many", "takes an integer"),
                             ("attention-backend", "flash", "one of auto, cpu, torch, triton"),
                             ("no-prefix-caching", "yes", 'a switch: "true" or "false"'),
                             ("seed", 1.5, "quote it")]:
        with pytest.raises(ValueError, match=why):
            check_arg(flag, value)
    assert render_args({"max-num-seqs": 8, "no-prefix-caching": "true", "kv-cache-memory": "1GiB"}) == [
        "--max-num-seqs", "8", "--no-prefix-caching", "--kv-cache-memory", "1GiB"]
    assert render_args({"no-prefix-caching": "false"}) == []
    # A switch the engine has on by default is turned off with its --no- form.
    assert render_args({"engine-process": "false"}) == ["--no-engine-process"]
    assert render_args({"engine-process": "true"}) == ["--engine-process"]


QUANT_ACCEPTED = [(q, acc) for q in ("auto", "none", "q8_0", "q4_0", "q4_1", "fp8", "awq", "gptq")
                  for acc in ("gpu", "cpu")
                  if not (acc == "cpu" and q in ("fp8", "awq", "gptq")) and not (acc == "gpu" and q.startswith("q"))]


@pytest.mark.parametrize(("quantization", "accelerator"), QUANT_ACCEPTED)
def test_quantization_the_accelerator_runs_passes_both_validators(quantization, accelerator, schema):
    doc = with_spec(engine={"quantization": quantization}, accelerator={"type": accelerator})
    assert parse_endpoint(doc).spec.engine.quantization == quantization
    assert api_server_errors(schema, doc) == []
    assert parse_endpoint(BASE).spec.engine.quantization is None  # unset by default: no flag rendered


@pytest.mark.parametrize(("kv_cache_dtype", "accelerator"), [("auto", "gpu"), ("auto", "cpu"), ("fp8", "gpu")])
def test_kv_cache_dtype_the_accelerator_runs_passes_both_validators(kv_cache_dtype, accelerator, schema):
    doc = with_spec(engine={"kvCacheDtype": kv_cache_dtype}, accelerator={"type": accelerator})
    assert parse_endpoint(doc).spec.engine.kv_cache_dtype == kv_cache_dtype
    assert api_server_errors(schema, doc) == []
    assert parse_endpoint(BASE).spec.engine.kv_cache_dtype is None  # unset by default: no flag rendered


def test_kv_cache_dtype_choices_match_the_engine():
    """spec.engine.kvCacheDtype's enum is the engine's --kv-cache-dtype choices; the engine takes fp8 where the
    operator renders it (a GPU) and refuses it on CPU, naming the flag."""
    from sluice_engine.config import EngineConfig
    from sluice_engine.entrypoints.serve_cli import add_engine_args
    from sluice_operator.spec import KV_CACHE_DTYPES

    p = argparse.ArgumentParser()
    add_engine_args(p)
    action = next(a for a in p._actions if "--kv-cache-dtype" in a.option_strings)
    assert tuple(action.choices) == KV_CACHE_DTYPES and action.default == "auto"
    EngineConfig(kv_cache_dtype="fp8", device="cuda")
    EngineConfig(kv_cache_dtype="auto", device="cpu")
    with pytest.raises(ValueError, match="--kv-cache-dtype fp8: "):
        EngineConfig(kv_cache_dtype="fp8", device="cpu")


def test_quantization_choices_match_the_engine():
    """spec.engine.quantization's enum is the engine's --quantization choices; the engine takes what the
    operator renders for each accelerator (fp8/awq/gptq on a GPU, the GGUF formats on CPU) and refuses what
    the device cannot run, with a message that names the flag."""
    from sluice_engine.config import EngineConfig
    from sluice_engine.entrypoints.serve_cli import add_engine_args
    from sluice_operator.spec import QUANTIZATIONS

    p = argparse.ArgumentParser()
    add_engine_args(p)
    action = next(a for a in p._actions if "--quantization" in a.option_strings)
    assert tuple(action.choices) == QUANTIZATIONS and action.default == "auto"
    for q in ("auto", "none"):
        EngineConfig(quantization=q)
    EngineConfig(quantization="q4_1", device="cpu")
    for q in ("fp8", "awq", "gptq"):
        EngineConfig(quantization=q)
        EngineConfig(quantization=q, device="cuda")
        with pytest.raises(ValueError, match=f"--quantization {q}: "):
            EngineConfig(quantization=q, device="cpu")
    with pytest.raises(ValueError, match="--quantization q4_1: "):
        EngineConfig(quantization="q4_1", device="cuda")
    with pytest.raises(ValueError, match="--quantization must be one of"):
        EngineConfig(quantization="int8")
