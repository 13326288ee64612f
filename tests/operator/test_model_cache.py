"""The model cache (issue 14): the shared cache's claim and Job, the pods' side of every cache type, the spec's
rules, the fetch scripts as they run, and the status while a model downloads. Pure; the loop is in
test_model_cache_loop.py."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from operator_schemas import CRD_FILE, api_server_errors, crd_schema, load_yaml, reference_crd, schema_errors

from sluice_operator import model_cache
from sluice_operator.model_cache import CacheState, cache_state, shared_cache_name
from sluice_operator.model_source import FETCH_HF_SCRIPT, FETCH_S3_SCRIPT
from sluice_operator.reconcile import reconcile
from sluice_operator.spec import SpecError, parse_endpoint
from sluice_operator.status import endpoint_status

K8S_VERSIONS = ["1.30", kubernetes_validate.latest_version()]
NOW = "2026-01-01T00:00:00Z"
SHARED = {"type": "shared", "size": "40Gi", "storageClassName": "nfs-rwx"}


def endpoint(name: str = "qwen", *, uid: str = "11111111-1111-1111-1111-111111111111", cache: dict | None = None,
             uri: str = "hf://Qwen/Qwen2.5-7B-Instruct", revision: str | None = "a1b2c3", **spec: Any) -> dict:
    model: dict[str, Any] = {"uri": uri, "cache": copy.deepcopy(SHARED if cache is None else cache)}
    if revision:
        model["revision"] = revision
    return {"apiVersion": "sluice.dev/v1alpha1", "kind": "InferenceEndpoint",
            "metadata": {"name": name, "namespace": "inference", "uid": uid},
            "spec": {"model": model, "accelerator": {"type": "cpu"}, **spec}}


def render(doc: dict, **kw: Any) -> list[dict[str, Any]]:
    return reconcile(parse_endpoint(doc), **kw)


def of_kind(manifests: list[dict], kind: str) -> list[dict]:
    return [m for m in manifests if m["kind"] == kind]


def templates(workload: dict) -> list[dict]:
    if workload["kind"] == "Deployment":
        return [workload["spec"]["template"]]
    lwt = workload["spec"]["leaderWorkerTemplate"]
    return [lwt["leaderTemplate"], lwt["workerTemplate"]]


def init_names(template: dict) -> list[str]:
    return [c["name"] for c in template["spec"].get("initContainers", [])]


# -- the shared cache: one claim and one Job, valid, shared ----------------------------------------------------
@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_shared_cache_claim_job_and_pods_validate_strictly(version):
    manifests = render(endpoint(replicas=2))
    (claim,), (job,) = of_kind(manifests, "PersistentVolumeClaim"), of_kind(manifests, "Job")
    for m in (claim, job, *of_kind(manifests, "Deployment")):
        kubernetes_validate.validate(m, version, strict=True)
    assert [m["kind"] for m in manifests[:2]] == ["PersistentVolumeClaim", "Job"]  # before the pods that mount it


def test_shared_claim_and_job_spec():
    manifests = render(endpoint(replicas=2))
    (claim,), (job,) = of_kind(manifests, "PersistentVolumeClaim"), of_kind(manifests, "Job")
    name = claim["metadata"]["name"]
    assert name == job["metadata"]["name"] and name.startswith("sluice-model-") and len(name) == 25
    assert claim["spec"] == {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "40Gi"}},
                             "storageClassName": "nfs-rwx"}
    pod = job["spec"]["template"]["spec"]
    (fetch,) = pod["containers"]
    assert pod["restartPolicy"] == "Never" and "activeDeadlineSeconds" not in job["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["fsGroup"] == 10001
    assert {"name": "model-cache", "persistentVolumeClaim": {"claimName": name}} in pod["volumes"]  # writable
    assert fetch["command"] == ["python", "-c", FETCH_HF_SCRIPT]  # inline: no endpoint's ConfigMap to outlive
    env = {e["name"]: e["value"] for e in fetch["env"]}
    assert env["SLUICE_MODEL_REPO"] == "Qwen/Qwen2.5-7B-Instruct" and env["SLUICE_MODEL_REVISION"] == "a1b2c3"
    assert env["SLUICE_MODEL_DIR"] == "/models-cache/hub/Qwen/Qwen2.5-7B-Instruct/a1b2c3"
    # Shared: labelled by the cache, not by one endpoint (the prune pass lists by sluice.dev/endpoint).
    for m in (claim, job):
        assert "sluice.dev/endpoint" not in m["metadata"]["labels"]
        assert m["metadata"]["labels"]["sluice.dev/model-cache"] == name.removeprefix("sluice-model-")
        assert m["metadata"]["annotations"]["sluice.dev/model-uri"] == "hf://Qwen/Qwen2.5-7B-Instruct"
        assert m["metadata"]["ownerReferences"] == [{
            "apiVersion": "sluice.dev/v1alpha1", "kind": "InferenceEndpoint", "name": "qwen",
            "uid": "11111111-1111-1111-1111-111111111111", "controller": False, "blockOwnerDeletion": False}]


def test_two_endpoints_of_one_model_and_revision_share_one_claim_and_job():
    a = render(endpoint("chat-a", uid="a" * 8 + "-0000-0000-0000-" + "0" * 12, replicas=1))
    b = render(endpoint("chat-b", uid="b" * 8 + "-0000-0000-0000-" + "0" * 12,
                        scaling={"minReplicas": 0, "maxReplicas": 2}))
    names = {(m["kind"], m["metadata"]["name"]) for m in a + b if m["kind"] in ("Job", "PersistentVolumeClaim")}
    assert len(names) == 2  # one claim, one Job
    (claim_a,), (claim_b,) = of_kind(a, "PersistentVolumeClaim"), of_kind(b, "PersistentVolumeClaim")
    assert claim_a["spec"] == claim_b["spec"]
    # Each endpoint's pods mount that claim.
    for manifests in (a, b):
        (deploy,) = of_kind(manifests, "Deployment")
        volumes = deploy["spec"]["template"]["spec"]["volumes"]
        assert {"name": "model-cache", "persistentVolumeClaim": {"claimName": claim_a["metadata"]["name"],
                                                                 "readOnly": True}} in volumes


@pytest.mark.parametrize(("change", "same"), [
    ({"revision": "a1b2c3"}, True),
    ({"revision": "ffff00"}, False),
    ({"revision": None}, False),
    ({"uri": "hf://Qwen/Qwen2.5-14B-Instruct"}, False),
    ({"cache": {**SHARED, "storageClassName": "cephfs"}}, False),  # a claim has one class
    ({"cache": {**SHARED, "size": "80Gi"}}, True),  # the first endpoint's size holds
])
def test_the_cache_is_keyed_by_model_revision_and_storage_class(change, same):
    base = parse_endpoint(endpoint()).spec.model
    other = parse_endpoint(endpoint(**{k: v for k, v in change.items() if k != "revision"},
                                    revision=change.get("revision", "a1b2c3"))).spec.model
    assert (shared_cache_name(base) == shared_cache_name(other)) is same


def test_s3_model_in_a_shared_cache():
    manifests = render(endpoint(uri="s3://models/llama-8b/", revision=None))
    (job,) = of_kind(manifests, "Job")
    (fetch,) = job["spec"]["template"]["spec"]["containers"]
    assert fetch["command"] == ["sh", "-c", FETCH_S3_SCRIPT, "s3://models/llama-8b/", "/models-cache/s3/models/llama-8b"]
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(job, version, strict=True)


# -- the serving pods' side ---------------------------------------------------------------------------------
def test_serving_pods_mount_the_shared_claim_read_only_and_wait_for_the_marker():
    (deploy,) = of_kind(render(endpoint()), "Deployment")
    pod = deploy["spec"]["template"]["spec"]
    assert init_names(deploy["spec"]["template"]) == ["wait-for-model"]  # the Job fetches, not the pods
    (wait,) = pod["initContainers"]
    assert wait["command"][-1] == "/models-cache/hub/Qwen/Qwen2.5-7B-Instruct/a1b2c3/.sluice-complete"
    assert 'until [ -f "$0" ]' in wait["command"][2]
    engine = pod["containers"][0]
    assert {"name": "model-cache", "mountPath": "/models-cache", "readOnly": True} in engine["volumeMounts"]
    assert all(m.get("readOnly") for c in (wait, engine) for m in c["volumeMounts"] if m["name"] == "model-cache")
    env = {e["name"]: e["value"] for e in engine["env"]}
    assert env["SLUICE_CACHE_DIR"] == "/tmp/sluice-cache"  # its own scratch: the cache is read-only
    args = engine["args"]
    assert args[args.index("--model") + 1] == "/models-cache/hub/Qwen/Qwen2.5-7B-Instruct/a1b2c3"
    assert not of_kind(render(endpoint()), "ConfigMap")[0]["data"].keys() - {"served-model-name", "model-uri",
                                                                             "fetch-hf.py", "objectives.json"}


def test_every_pod_of_a_multi_node_group_uses_the_shared_cache():
    doc = endpoint(parallelism={"pipeline": 2, "nodes": 2})
    manifests = render(doc)
    (lws,) = of_kind(manifests, "LeaderWorkerSet")
    claim = of_kind(manifests, "PersistentVolumeClaim")[0]["metadata"]["name"]
    for template in templates(lws):
        assert init_names(template) == ["wait-for-model"]
        assert {"name": "model-cache", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}} in \
            template["spec"]["volumes"]
        as_pod_template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": template}
        kubernetes_validate.validate(as_pod_template, K8S_VERSIONS[-1], strict=True)


def test_until_the_download_completes_workloads_are_held_at_zero_and_keda_paused():
    fixed = render(endpoint(replicas=3), awaiting_model=True)
    assert of_kind(fixed, "Deployment")[0]["spec"]["replicas"] == 0
    assert of_kind(render(endpoint(replicas=3)), "Deployment")[0]["spec"]["replicas"] == 3
    scaled = render(endpoint(scaling={"minReplicas": 1, "maxReplicas": 4, "warmPool": {"replicas": 1}}),
                    awaiting_model=True)
    serving, warm = of_kind(scaled, "Deployment")
    assert serving["spec"]["replicas"] == 0 and warm["spec"]["replicas"] == 0
    (so,) = of_kind(scaled, "ScaledObject")
    assert so["metadata"]["annotations"] == {"autoscaling.keda.sh/paused-replicas": "0"}
    assert schema_errors(crd_schema(reference_crd("keda.sh_scaledobjects.yaml"), "v1alpha1"), so) == []
    done = render(endpoint(scaling={"minReplicas": 1, "maxReplicas": 4}))
    assert "annotations" not in of_kind(done, "ScaledObject")[0]["metadata"]
    assert "replicas" not in of_kind(done, "Deployment")[0]["spec"]  # KEDA's again


def test_held_replicas_apply_only_to_a_shared_cache_in_the_operator():
    # awaiting_model is decided by cache_sync for shared caches only; the other cache types never pass it.
    manifests = render(endpoint(cache={"type": "emptyDir"}, replicas=2))
    assert not of_kind(manifests, "Job") and not of_kind(manifests, "PersistentVolumeClaim")
    assert init_names(of_kind(manifests, "Deployment")[0]["spec"]["template"]) == ["fetch-model"]


@pytest.mark.parametrize("layout", [{}, {"parallelism": {"pipeline": 2, "nodes": 2}}])
def test_host_path_cache_is_handed_to_the_engine_user(layout):
    manifests = render(endpoint(cache={"type": "hostPath", "path": "/var/lib/sluice/cache"}, **layout))
    assert not of_kind(manifests, "Job")
    workload = next(m for m in manifests if m["kind"] in ("Deployment", "LeaderWorkerSet"))
    for template in templates(workload):  # the leader and every worker: each node's directory
        pod = template["spec"]
        assert init_names(template) == ["own-model-cache", "fetch-model"]  # owned before it is written
        own = pod["initContainers"][0]
        assert own["command"][:2] == ["sh", "-c"] and own["command"][-1] == "/models-cache"
        assert 'chown 10001:10001 "$0"' in own["command"][2] and "-R" not in own["command"][2]
        sec = own["securityContext"]
        assert (sec["runAsUser"], sec["runAsNonRoot"]) == (0, False)
        assert sec["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]}
        assert sec["allowPrivilegeEscalation"] is False and sec["readOnlyRootFilesystem"] is True
        assert pod["securityContext"]["fsGroup"] == 10001 and pod["securityContext"]["runAsUser"] == 10001
        for c in [pod["initContainers"][1], *pod["containers"]]:  # everything else stays non-root
            assert "runAsUser" not in c["securityContext"] and c["securityContext"]["runAsNonRoot"] is True
        assert {"name": "model-cache", "hostPath": {"path": "/var/lib/sluice/cache", "type": "DirectoryOrCreate"}} \
            in pod["volumes"]
        as_pod_template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": template}
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(as_pod_template, version, strict=True)


# -- the spec's rules, in Python and in the CRD's CEL -----------------------------------------------------------
@pytest.mark.parametrize(("cache", "uri", "message"), [
    ({"type": "shared"}, "hf://a/b", "model.cache.size is required when model.cache.type is shared"),
    ({"type": "emptyDir", "size": "10Gi"}, "hf://a/b", "apply to model.cache.type shared only"),
    ({"type": "hostPath", "path": "/x", "storageClassName": "nfs"}, "hf://a/b", "apply to model.cache.type shared only"),
    ({"type": "shared", "size": "40Gi"}, "pvc://weights/llama", "a pvc:// model is read where it is"),
])
def test_invalid_caches_are_refused_with_a_reason(cache, uri, message):
    doc = endpoint(cache=cache, uri=uri, revision=None)
    with pytest.raises(SpecError, match=message):
        parse_endpoint(doc)
    schema = crd_schema(load_yaml(CRD_FILE))
    body = {k: v for k, v in doc.items() if k != "metadata"} | {"metadata": {"name": "qwen"}}
    assert any(message in e for e in api_server_errors(schema, body))


def test_size_must_be_a_quantity():
    with pytest.raises(SpecError, match="model.cache.size"):
        parse_endpoint(endpoint(cache={"type": "shared", "size": "forty gigs"}))
    schema = crd_schema(load_yaml(CRD_FILE))
    body = {k: v for k, v in endpoint(cache={"type": "shared", "size": "forty gigs"}).items() if k != "metadata"}
    assert any("spec.model.cache.size" in e for e in api_server_errors(schema, body | {"metadata": {"name": "q"}}))
    assert api_server_errors(schema, {k: v for k, v in endpoint().items() if k != "metadata"} |
                             {"metadata": {"name": "q"}}) == []


# -- the fetch scripts, run ----------------------------------------------------------------------------------
FAKE_HUB = '''
import os, pathlib, time
CALLS = pathlib.Path(os.environ["FAKE_HUB_CALLS"])

def snapshot_download(repo, revision=None, local_dir=None):
    with CALLS.open("a") as f:
        f.write(f"{repo}@{revision}\\n")
    out = pathlib.Path(local_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "model.safetensors").write_bytes(b"x" * 3000)
    time.sleep(float(os.environ.get("FAKE_HUB_SECONDS", "0")))
    (out / "config.json").write_text("{}")
    return str(out)
'''


def _run_hf(tmp_path: Path, script: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "fake"), "FAKE_HUB_CALLS": str(tmp_path / "calls"),
           "SLUICE_MODEL_REPO": "org/model", "SLUICE_MODEL_REVISION": "v1",
           "SLUICE_MODEL_DIR": str(tmp_path / "cache" / "org" / "model"), "FAKE_HUB_SECONDS": "1.3"}
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)


def test_hub_fetch_reports_progress_marks_complete_and_runs_once(tmp_path):
    (tmp_path / "fake" / "huggingface_hub").mkdir(parents=True)
    (tmp_path / "fake" / "huggingface_hub" / "__init__.py").write_text(textwrap.dedent(FAKE_HUB))
    script = FETCH_HF_SCRIPT.replace(f"stop.wait({model_cache.PROGRESS_PERIOD_S})", "stop.wait(0.5)")
    first = _run_hf(tmp_path, script)
    assert first.returncode == 0, first.stderr
    progress = [int(n) for n in model_cache.PROGRESS_LINE.findall(first.stdout)]
    assert progress and progress[-1] == 3002  # the weights and config.json, counted on disk
    assert model_cache.progress_bytes(first.stdout) == 3002
    marker = tmp_path / "cache" / "org" / "model" / model_cache.COMPLETE_MARKER
    assert marker.is_file() and '"revision": "v1"' in marker.read_text()
    second = _run_hf(tmp_path, script)  # a cold start on a warm cache: no Hub round trip
    assert second.returncode == 0 and "already complete" in second.stdout
    assert (tmp_path / "calls").read_text().splitlines() == ["org/model@v1"]


def test_s3_fetch_marks_complete_only_on_success_and_runs_once(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    aws = bin_dir / "aws"
    aws.write_text('#!/bin/sh\necho "$@" >> "$AWS_CALLS"\n[ -n "$AWS_FAIL" ] && exit 3\n'
                   'mkdir -p "$5" && head -c 2048 /dev/zero > "$5/weights.bin"\n')
    aws.chmod(0o755)
    target = tmp_path / "cache" / "s3" / "bucket" / "m"

    def run(**env: str) -> subprocess.CompletedProcess[str]:
        full = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "AWS_CALLS": str(tmp_path / "calls"), **env}
        return subprocess.run(["sh", "-c", FETCH_S3_SCRIPT, "s3://bucket/m/", str(target)], env=full,
                              capture_output=True, text=True, timeout=60)

    failed = run(AWS_FAIL="1")
    assert failed.returncode == 3 and not (target / model_cache.COMPLETE_MARKER).exists()
    ok = run()
    assert ok.returncode == 0, ok.stderr
    assert model_cache.progress_bytes(ok.stdout) is not None and model_cache.progress_bytes(ok.stdout) >= 2048
    assert (target / model_cache.COMPLETE_MARKER).read_text().strip() == "s3://bucket/m/"
    again = run()
    assert again.returncode == 0 and "already complete" in again.stdout
    assert len((tmp_path / "calls").read_text().splitlines()) == 2  # the failed try and the one that worked


# -- the shared cache's state and the endpoint's status --------------------------------------------------------
def _job(condition: str | None = None, message: str = "") -> dict:
    conds = [{"type": condition, "status": "True", "reason": condition, "message": message}] if condition else []
    return {"metadata": {"name": "sluice-model-x"}, "status": {"conditions": conds}}


def test_cache_state_from_claim_job_and_log():
    claim = {"metadata": {"name": "sluice-model-x"}, "status": {"phase": "Bound"}}
    running = cache_state("sluice-model-x", claim, _job(), "noise\nsluice-fetch: 1024 bytes\nsluice-fetch: 3221225472 bytes\n")
    assert (running.complete, running.bytes_done) == (False, 3221225472)
    assert running.message == "downloading the model into the shared cache by Job sluice-model-x, 3.0 GiB so far"
    assert cache_state("sluice-model-x", claim, _job("Complete")).complete
    marked = {"metadata": {"annotations": {model_cache.COMPLETE_ANNOTATION: "true"}}}
    assert cache_state("sluice-model-x", marked, None).complete  # the Job may be gone; the claim remembers
    failed = cache_state("sluice-model-x", claim, _job("Failed", "Job has reached the specified backoff limit"))
    assert failed.failed == "Job has reached the specified backoff limit" and "delete the Job to retry" in failed.message
    pending = cache_state("sluice-model-x", {"metadata": {}, "status": {"phase": "Pending"}}, _job(), None)
    assert pending.bytes_done is None and "(claim sluice-model-x is Pending)" in pending.message


def _cond(status: dict, type_: str) -> dict:
    return next(c for c in status["conditions"] if c["type"] == type_)


def test_status_while_the_shared_cache_downloads_then_fails():
    ep = parse_endpoint(endpoint(replicas=2))
    held = {"metadata": {}, "spec": {"replicas": 0}, "status": {}}
    downloading = CacheState("sluice-model-x", complete=False, bytes_done=5 * 1024**3)
    st = endpoint_status(ep, serving=held, pods=[], now=NOW, model_cache=downloading)
    assert st["phase"] == "Loading"
    model_ready = _cond(st, "ModelReady")
    assert (model_ready["status"], model_ready["reason"]) == ("False", "Downloading")
    assert "5.0 GiB so far" in model_ready["message"]
    failed = CacheState("sluice-model-x", complete=False, failed="BackoffLimitExceeded")
    st = endpoint_status(ep, serving=held, pods=[], now=NOW, model_cache=failed)
    assert st["phase"] == "Failed"
    assert (_cond(st, "ModelReady")["reason"], _cond(st, "Ready")["reason"]) == ("DownloadFailed", "DownloadFailed")
    done = CacheState("sluice-model-x", complete=True)
    st = endpoint_status(ep, serving={"metadata": {}, "spec": {"replicas": 2}, "status": {}}, pods=[], now=NOW,
                         model_cache=done)
    assert st["phase"] == "Pending" and _cond(st, "ModelReady")["reason"] != "Downloading"


def test_a_progress_deadline_passed_while_downloading_is_not_a_failure():
    ep = parse_endpoint(endpoint(cache={"type": "emptyDir"}, replicas=1))
    deploy = {"metadata": {}, "spec": {"replicas": 1}, "status": {"replicas": 1, "conditions": [
        {"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded", "message": "too slow"}]}}
    pod = {"metadata": {"name": "p"}, "status": {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "True"}],
        "initContainerStatuses": [{"name": "fetch-model", "state": {"running": {}}}]}}
    st = endpoint_status(ep, serving=deploy, pods=[pod], now=NOW)
    assert st["phase"] == "Loading" and _cond(st, "ModelReady")["reason"] == "Downloading"
    assert _cond(st, "Degraded")["status"] == "False"
    pod["status"]["initContainerStatuses"] = [{"name": "fetch-model", "state": {"terminated": {"exitCode": 0}}}]
    st = endpoint_status(ep, serving=deploy, pods=[pod], now=NOW)  # downloaded, and still no progress: failed
    assert st["phase"] == "Failed" and _cond(st, "Ready")["reason"] == "ProgressDeadlineExceeded"
