"""LoRA adapters (spec.adapters, issue 26): validation (pydantic and the CRD agree), what reconcile renders (the
ConfigMap's adapters.json the engine re-reads, the fetch sidecars, the flags), that adding or removing an
adapter leaves the pod template alone, the fetch scripts on a real filesystem, the status from what each ready
replica's /v1/models lists, and the whole loop on kmock: a live endpoint takes a new adapter with no rollout."""

from __future__ import annotations

import copy
import json
import os
import socket
import subprocess
import sys
import textwrap
import types
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from operator_schemas import CRD_FILE, EXAMPLES, api_server_errors, crd_schema, load_yaml

from sluice_operator import adapters
from sluice_operator.engine_probe import probe
from sluice_operator.reconcile import reconcile
from sluice_operator.spec import ADAPTER_NAME_PATTERN, SpecError, parse_endpoint
from sluice_operator.status import adapter_status, adapters_pending, adapters_ready, endpoint_status

EXAMPLE = next(p for p in EXAMPLES if p.name == "gpu-8b-lora.yaml")
CPU = {
    "apiVersion": "sluice.dev/v1alpha1",
    "kind": "InferenceEndpoint",
    "metadata": {"name": "demo", "namespace": "ml"},
    "spec": {"model": {"uri": "hf://org/base-model", "servedName": "base"}, "accelerator": {"type": "cpu"}},
}
SQL = {"name": "sql", "source": "hf://org/sql-lora", "revision": "v1"}
CHAT = {"name": "chat", "source": "s3://adapters/base/chat/"}


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    return crd_schema(load_yaml(CRD_FILE))


def doc_with(spec: dict[str, Any] | None = None, **changes: Any) -> dict[str, Any]:
    doc = copy.deepcopy(CPU)
    doc["spec"].update(copy.deepcopy(spec or {}))
    doc["spec"].update(copy.deepcopy(changes))
    return doc


def rendered(doc: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the ConfigMap's data, the serving Deployment)."""
    manifests = reconcile(parse_endpoint(doc))
    cm = next(m for m in manifests if m["kind"] == "ConfigMap")
    dep = next(m for m in manifests if m["kind"] == "Deployment")
    return cm["data"], dep


def template(doc: dict[str, Any]) -> dict[str, Any]:
    return rendered(doc)[1]["spec"]["template"]


# -- validation --------------------------------------------------------------------------------------------
def test_adapter_names_are_what_the_engine_accepts() -> None:
    from sluice_engine.lora.modules_file import NAME

    assert NAME.pattern == ADAPTER_NAME_PATTERN


@pytest.mark.parametrize("adapters_", [
    [SQL, CHAT, {"name": "legal.v2_b-1", "source": "pvc://claim/adapters/legal"}],
    [{"name": "a" * 128, "source": "hf://org/x"}],
    # Names that only look like the served name: a '.' is no wildcard, and only the last path component counts.
    [{"name": "base-model.v2", "source": "hf://org/x"}],
    [{"name": "org", "source": "hf://org/x"}],
], ids=["three-sources", "longest-name", "dotted", "uri-org"])
def test_valid_adapters_pass_both_validators(adapters_: list[dict[str, Any]], schema: dict[str, Any]) -> None:
    doc = doc_with(adapters=adapters_)
    doc["spec"]["model"].pop("servedName")
    assert [a.name for a in parse_endpoint(doc).spec.adapters] == [a["name"] for a in adapters_]
    assert api_server_errors(schema, doc) == []


@pytest.mark.parametrize(("uri", "served"), [
    ("hf://org/llama", None), ("hf://org/llama", "chat"), ("hf://org/llama", ""), ("s3://b/m/llama/", None),
    ("s3://b/m/llama//", None), ("pvc://claim/llama", None), ("pvc://claim/x/llama.v1", None),
    ("s3://b/lxama/", None), ("s3://llama/", None), ("hf://llama/x", None),
])
@pytest.mark.parametrize("name", ["llama", "chat", "l.ama", "llama.v1", "x"])
def test_served_name_rule_twins_agree(uri: str, served: str | None, name: str, schema: dict[str, Any]) -> None:
    """The CEL rule (no split in CEL: endsWith and a regex) and the Python twin (the engine's served name)
    refuse exactly the adapter names equal to the served name, trailing slashes and dotted names included."""
    model: dict[str, Any] = {"uri": uri}
    if served is not None:
        model["servedName"] = served
    doc = doc_with(model=model, adapters=[{"name": name, "source": "hf://org/a"}])
    try:
        clash = False
        parse_endpoint(doc)
    except SpecError as e:
        assert "must not be the model's served name" in str(e), e
        clash = True
    server = api_server_errors(schema, doc)
    assert clash == any("must not be the model's served name" in e for e in server), (server, clash)
    assert len(server) == int(clash), server


def test_served_name_rule_known_difference(schema: dict[str, Any]) -> None:
    """The one case the twins part: a dotted name, a uri ending in a look-alike with a trailing slash, and the
    name itself earlier in the uri. CEL refuses it (its regex reads '.' as any character); the operator would
    serve it. Renaming the adapter is the way out; nothing the API server admits is refused later."""
    doc = doc_with(model={"uri": "s3://b/l.ama/lxama/"}, adapters=[{"name": "l.ama", "source": "hf://org/a"}])
    parse_endpoint(doc)
    assert api_server_errors(schema, doc) == [
        "adapters[].name must not be the model's served name (model.servedName, else the last path component of "
        "model.uri): clients tell the model and its adapters apart by name"]


# -- rendering ---------------------------------------------------------------------------------------------
def test_example_renders_the_adapters_file_flags_and_sidecars() -> None:
    doc = load_yaml(EXAMPLE)
    data, dep = rendered(doc)
    pod = dep["spec"]["template"]["spec"]
    # The engine's file: every adapter, at the directory it lands in.
    from sluice_engine.lora.modules_file import parse_modules_file

    assert parse_modules_file(data[adapters.ADAPTERS_KEY]) == {
        "sql": "/models-cache/adapters/hf/my-org/llama-3.1-8b-sql-lora/v1",
        "support": "/models-cache/adapters/s3/my-adapters/llama-3.1-8b/support",
        "legal": "/models-cache/adapters/legal",  # on the cache's own claim: read where it is
    }
    assert json.loads(data[adapters.FETCH_LIST_KEY])["adapters"] == [{
        "name": "sql", "repo": "my-org/llama-3.1-8b-sql-lora", "revision": "v1",
        "dir": "/models-cache/adapters/hf/my-org/llama-3.1-8b-sql-lora/v1"}]
    assert data[adapters.FETCH_S3_LIST_KEY] == (
        "support\t/models-cache/adapters/s3/my-adapters/llama-3.1-8b/support\ts3://my-adapters/llama-3.1-8b/support/\n")
    # The flags: LoRA on, the file the engine re-reads; nothing per adapter.
    engine = pod["containers"][0]
    assert engine["args"][-3:] == ["--lora-modules-file", "/etc/sluice/adapters.json", "--enable-lora"]
    assert not any("sql" in a for a in engine["args"])
    # The sidecars: native (restartPolicy Always), before the model's fetch, with the model's credentials; the
    # engine never gets them.
    names = [c["name"] for c in pod["initContainers"]]
    assert names == ["fetch-adapters", "fetch-adapters-s3", "fetch-model"]
    for c in pod["initContainers"][:2]:
        assert c["restartPolicy"] == "Always"
        assert c["envFrom"] == [{"secretRef": {"name": "model-credentials"}}]
        assert {m["mountPath"] for m in c["volumeMounts"]} == {"/models-cache", "/tmp", "/etc/sluice"}
    assert "envFrom" not in engine
    # The ConfigMap mounted as a directory, with the adapters' keys.
    config = next(v for v in pod["volumes"] if v["name"] == "config")
    assert {i["key"] for i in config["configMap"]["items"]} >= {*adapters.LIVE_KEYS, adapters.FETCH_SCRIPT_KEY}
    assert not any("subPath" in m for m in engine["volumeMounts"])


def test_no_adapters_renders_nothing_of_lora() -> None:
    data, dep = rendered(doc_with())
    pod = dep["spec"]["template"]["spec"]
    assert not set(data) & {*adapters.LIVE_KEYS, adapters.FETCH_SCRIPT_KEY}
    assert "--enable-lora" not in pod["containers"][0]["args"]
    assert [c["name"] for c in pod["initContainers"]] == ["fetch-model"]


@pytest.mark.parametrize(("before", "after"), [
    ([SQL], [SQL, CHAT]),  # added
    ([SQL, CHAT], [CHAT]),  # removed
    ([SQL], [{**SQL, "revision": "v2"}]),  # a new revision: fetched and reloaded from its own directory
    ([SQL], [CHAT, {"name": "local", "source": "pvc://models/adapters/local"}]),  # on the model's claim below
])
def test_adding_or_removing_adapters_leaves_the_pod_template_alone(before: list[Any], after: list[Any]) -> None:
    """Only the ConfigMap's adapter lists change: no rollout, no model reloaded on any replica."""
    model = {"uri": "pvc://models/base", "servedName": "base"}
    (data_a, dep_a), (data_b, dep_b) = rendered(doc_with(model=model, adapters=before)), rendered(
        doc_with(model=model, adapters=after))
    assert dep_a["spec"]["template"] == dep_b["spec"]["template"]
    assert data_a[adapters.ADAPTERS_KEY] != data_b[adapters.ADAPTERS_KEY]
    assert {k: v for k, v in data_a.items() if k not in adapters.LIVE_KEYS} == {
        k: v for k, v in data_b.items() if k not in adapters.LIVE_KEYS}


def test_enable_lora_kept_on_makes_the_first_and_last_adapter_free() -> None:
    on = {"engine": {"args": {"enable-lora": "true"}}}
    assert template(doc_with(on)) == template(doc_with(on, adapters=[SQL]))
    args = template(doc_with(on))["spec"]["containers"][0]["args"]
    assert args.count("--enable-lora") == 1 and "true" not in args
    # Without it, the first adapter turns LoRA on: a flag, so a rollout (documented).
    assert template(doc_with()) != template(doc_with(adapters=[SQL]))


def test_pvc_adapters_are_read_where_they_are() -> None:
    doc = doc_with(model={"uri": "pvc://models/base", "servedName": "base", "cache": {
        "type": "pvc", "claimName": "cache"}}, adapters=[
        {"name": "on-model-claim", "source": "pvc://models/lora/a"},
        {"name": "on-cache-claim", "source": "pvc://cache/lora/b"},
        {"name": "elsewhere", "source": "pvc://team-adapters/c"},
        {"name": "elsewhere-too", "source": "pvc://team-adapters/d"}])
    data, dep = rendered(doc)
    paths = {a["name"]: a["path"] for a in json.loads(data[adapters.ADAPTERS_KEY])["adapters"]}
    assert paths == {"on-model-claim": "/models/lora/a", "on-cache-claim": "/models-cache/lora/b",
                     "elsewhere": "/adapter-claims/team-adapters/c", "elsewhere-too": "/adapter-claims/team-adapters/d"}
    pod = dep["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"].startswith("adapter-")]  # one per claim
    assert volume["persistentVolumeClaim"] == {"claimName": "team-adapters", "readOnly": True}
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == volume["name"])
    assert mount == {"name": volume["name"], "mountPath": "/adapter-claims/team-adapters", "readOnly": True}
    # A claim the pods mount anyway changes no template; a new one does (a documented rollout).
    base = doc_with(model=doc["spec"]["model"], adapters=[{"name": "x", "source": "pvc://models/lora/a"}])
    same = doc_with(model=doc["spec"]["model"], adapters=[{"name": "y", "source": "pvc://cache/lora/b"}])
    assert template(base) == template(same) != template(doc)


def test_shared_cache_adapters_go_to_the_pods_scratch() -> None:
    doc = doc_with(model={"uri": "hf://org/base", "cache": {"type": "shared", "size": "10Gi"}}, adapters=[SQL])
    data, dep = rendered(doc)
    (entry,) = json.loads(data[adapters.ADAPTERS_KEY])["adapters"]
    assert entry["path"] == "/tmp/sluice-cache/adapters/hf/org/sql-lora/v1"  # the claim is read-only here
    sidecar = next(c for c in dep["spec"]["template"]["spec"]["initContainers"] if c["name"] == "fetch-adapters")
    cache = next(m for m in sidecar["volumeMounts"] if m["name"] == "model-cache")
    assert cache["readOnly"] is True
    # Its own /tmp (HOME, HF_HOME); only the engine's scratch directory of the engine's /tmp is shared.
    assert {"name": "HF_HOME", "value": "/tmp/huggingface"} in sidecar["env"]
    mounts = {m["mountPath"]: m for m in sidecar["volumeMounts"]}
    assert mounts["/tmp"]["name"] == "fetch-home"
    assert mounts["/tmp/sluice-cache"] == {"name": "tmp", "mountPath": "/tmp/sluice-cache", "subPath": "sluice-cache"}
    engine = dep["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "SLUICE_CACHE_DIR", "value": "/tmp/sluice-cache"} in engine["env"]


@pytest.mark.parametrize("model", [{"uri": "hf://org/base"}, {"uri": "s3://bucket/base/"},
                                   {"uri": "hf://org/base", "cache": {"type": "shared", "size": "10Gi"}},
                                   {"uri": "pvc://models/base"}])
def test_credential_holders_have_a_home_the_engine_cannot_write(model: dict) -> None:
    """Issue 39: a container that holds the model credentials has its HOME (and HF_HOME) on a volume of its own.
    Were it the engine's /tmp, the engine could plant ~/.aws/config (credential_process) or a Python user site for
    that container to run."""
    doc = doc_with(model={**model, "credentialsSecretRef": {"name": "creds"}}, adapters=[SQL])
    _, dep = rendered(doc)
    pod = dep["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["fetch-home"] == {"name": "fetch-home", "emptyDir": {}}
    engine_volumes = {m["name"] for c in pod["containers"] for m in c["volumeMounts"]}
    assert "fetch-home" not in engine_volumes
    holders = [c for c in pod["initContainers"] if c.get("envFrom")]
    assert {c["name"] for c in holders} >= {"fetch-adapters", "fetch-adapters-s3"}
    for c in holders:
        env = {e["name"]: e["value"] for e in c["env"] if "value" in e}
        home = env["HOME"]
        (own,) = [m for m in c["volumeMounts"] if m["mountPath"] == home]
        assert own["name"] == "fetch-home", c["name"]
        if "HF_HOME" in env:
            assert env["HF_HOME"].startswith(home + "/"), c["name"]
        # Nothing of the engine's /tmp but its scratch cache directory.
        assert all(m.get("subPath") == "sluice-cache" for m in c["volumeMounts"] if m["name"] == "tmp"), c["name"]


def test_local_directories_never_leave_the_adapters_root() -> None:
    doc = doc_with(adapters=[{"name": "a", "source": "s3://bucket/../../etc/x y/"},
                             {"name": "b", "source": "hf://org/.."}])
    paths = [a["path"] for a in json.loads(rendered(doc)[0][adapters.ADAPTERS_KEY])["adapters"]]
    assert paths == ["/models-cache/adapters/s3/bucket/etc/x_y", "/models-cache/adapters/hf/org/main"]


# -- the fetch scripts, on a real filesystem ---------------------------------------------------------------
def _hf_script(monkeypatch: pytest.MonkeyPatch, files: dict[str, str], calls: list[str]) -> dict[str, Any]:
    """fetch-adapters.py's functions, with a stand-in huggingface_hub that writes `files`."""
    def snapshot_download(repo: str, revision: str | None, local_dir: Path) -> str:
        calls.append(f"{repo}@{revision}")
        local_dir.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (local_dir / name).write_text(text)
        return str(local_dir)

    monkeypatch.setitem(sys.modules, "huggingface_hub", types.SimpleNamespace(snapshot_download=snapshot_download))
    scope: dict[str, Any] = {"__name__": "fetch_adapters"}
    exec(adapters.FETCH_ADAPTERS_SCRIPT, scope)
    return scope


def test_hf_fetch_renames_a_complete_adapter_into_place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    script = _hf_script(monkeypatch, {"adapter_config.json": "{}", "adapter_model.safetensors": "w"}, calls)
    adapter = {"name": "sql", "repo": "org/sql-lora", "revision": "v1", "dir": str(tmp_path / "hf/org/sql-lora/v1")}
    assert script["fetch"](adapter) is True
    final = Path(adapter["dir"])
    assert sorted(p.name for p in final.iterdir()) == [".sluice-complete", "adapter_config.json",
                                                       "adapter_model.safetensors"]
    assert [p.name for p in final.parent.iterdir()] == ["v1"]  # no staging directory left
    assert script["fetch"](adapter) is False and calls == ["org/sql-lora@v1"]  # complete: no network again
    # The operator's list, as the sidecar reads it.
    listed = tmp_path / "list.json"
    listed.write_text(json.dumps({"adapters": [adapter]}))
    assert script["wanted"](str(listed)) == [adapter]
    assert script["wanted"](str(tmp_path / "missing.json")) == []


def test_hf_fetch_refuses_a_repository_that_is_no_adapter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = _hf_script(monkeypatch, {"config.json": "{}"}, [])
    adapter = {"name": "x", "repo": "org/model", "revision": "", "dir": str(tmp_path / "x")}
    with pytest.raises(RuntimeError, match="no adapter_config.json"):
        script["fetch"](adapter)
    assert not Path(adapter["dir"]).exists()  # the engine never sees it


def test_hf_fetch_loses_a_race_gracefully(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two pods on one cache: the second's rename fails on the first's complete directory, and it cleans up."""
    script = _hf_script(monkeypatch, {"adapter_config.json": "{}", "adapter_model.safetensors": "w"}, [])
    final = tmp_path / "v1"
    adapter = {"name": "sql", "repo": "org/sql-lora", "revision": "v1", "dir": str(final)}
    real_rename = Path.rename

    def first_pod_wins(self: Path, target: Any) -> Any:
        real_rename(Path(str(self)).with_name("other"), target)  # the other pod's complete download
        return real_rename(self, target)

    other = tmp_path / "other"
    other.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors", ".sluice-complete"):
        (other / name).write_text("x")
    monkeypatch.setattr(Path, "rename", first_pod_wins)
    assert script["fetch"](adapter) is True
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v1"]


def test_s3_fetch_script(tmp_path: Path) -> None:
    """fetch-adapters-s3's loop with a stand-in `aws` (a copy from a local directory): a complete adapter is
    renamed into place, a prefix without adapter_config.json is not."""
    bucket = tmp_path / "bucket"
    (bucket / "chat").mkdir(parents=True)
    (bucket / "chat" / "adapter_config.json").write_text("{}")
    (bucket / "chat" / "adapter_model.safetensors").write_text("w")
    (bucket / "empty").mkdir()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    aws = bin_dir / "aws"
    aws.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        # aws s3 sync --only-show-errors s3://bucket/<prefix> <dir>
        src="{bucket}/${{4#s3://bucket/}}"; mkdir -p "$5"; cp -r "$src"/. "$5"/
        """))
    aws.chmod(0o755)
    cache = tmp_path / "cache"
    listing = tmp_path / "list.tsv"
    listing.write_text(f"chat\t{cache}/s3/bucket/chat\ts3://bucket/chat\n"
                       f"empty\t{cache}/s3/bucket/empty\ts3://bucket/empty\n")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    proc = subprocess.run(["timeout", "3", "sh", "-c", adapters.FETCH_ADAPTERS_S3_SCRIPT, str(listing)],
                          env=env, capture_output=True, text=True)
    assert proc.returncode == 124, proc.stderr  # it runs until stopped
    assert f"adapter chat ready in {cache}/s3/bucket/chat" in proc.stdout
    assert "adapter empty: s3://bucket/empty failed" in proc.stdout
    assert sorted(p.name for p in (cache / "s3/bucket/chat").iterdir()) == [
        ".sluice-complete", "adapter_config.json", "adapter_model.safetensors"]
    assert not (cache / "s3/bucket/empty").exists()
    assert proc.stdout.count("adapter chat ready") == 1  # complete: not fetched again


# -- status ------------------------------------------------------------------------------------------------
NOW = "2026-01-01T00:00:00Z"


def _ep(*names: str) -> Any:
    doc = doc_with(adapters=[{"name": n, "source": f"hf://org/{n}"} for n in names])
    doc["metadata"]["generation"] = 3
    return parse_endpoint(doc)


def test_adapter_status_per_replica() -> None:
    ep = _ep("sql", "chat")
    probes = {"pod-a": frozenset({"base", "sql", "chat"}), "pod-b": frozenset({"base", "sql"})}
    listed = adapter_status(ep, probes)
    assert listed == [
        {"name": "sql", "loaded": True, "loadedReplicas": 2, "message": "loaded on 2/2 ready replicas"},
        {"name": "chat", "loaded": False, "loadedReplicas": 1, "message": "loaded on 1/2 ready replicas; not on pod-b yet"}]
    assert adapters_ready(listed, probes) == ("False", "AdaptersLoading", "chat: loaded on 1/2 ready replicas; not on pod-b yet")
    everywhere = {"pod-a": frozenset({"sql", "chat"}), "pod-b": frozenset({"sql", "chat"})}
    assert adapters_ready(adapter_status(ep, everywhere), everywhere)[:2] == ("True", "AdaptersLoaded")
    # A replica that could not be asked: unknown, not "not loaded".
    partly = {"pod-a": frozenset({"sql", "chat"}), "pod-b": "GET http://10.0.0.2:8000/v1/models: timeout"}
    listed = adapter_status(ep, partly)
    assert [a["loaded"] for a in listed] == [False, False]
    assert "could not ask pod-b (pod-b: GET http://10.0.0.2:8000/v1/models: timeout)" in listed[0]["message"]
    assert adapters_ready(listed, partly)[:2] == ("Unknown", "ReplicasNotAsked")
    assert adapters_ready(adapter_status(ep, {}), {})[:2] == ("False", "NoReadyReplicas")
    assert adapters_ready(adapter_status(ep, None), None)[:2] == ("Unknown", "PodsNotObserved")
    assert adapter_status(_ep(), {"pod-a": frozenset()}) is None  # no adapters: no status.adapters


def test_endpoint_status_carries_adapters_and_asks_again_while_loading() -> None:
    from operator_schemas import crd_schema as schema_of

    status_schema = schema_of(load_yaml(CRD_FILE))["properties"]["status"]
    from operator_schemas import schema_errors

    ep = _ep("sql")
    deploy = {"spec": {"replicas": 1}, "status": {"replicas": 1, "readyReplicas": 1}}
    st = endpoint_status(ep, serving=deploy, pods=[], now=NOW, adapters={"pod-a": frozenset({"base"})})
    assert st["adapters"][0]["loaded"] is False and schema_errors(status_schema, st) == []
    assert adapters_pending(st)
    st = endpoint_status(ep, serving=deploy, pods=[], now=NOW, adapters={"pod-a": frozenset({"base", "sql"})})
    assert not adapters_pending(st)
    # Without adapters the field is gone, and the write removes it from a status that had it.
    from sluice_operator.status import changed, status_patch

    plain = endpoint_status(_ep(), serving=deploy, pods=[], now=NOW)
    assert "adapters" not in plain and not any(c["type"] == "AdaptersReady" for c in plain["conditions"])
    assert status_patch(plain, st)["adapters"] is None and changed(plain, {**plain, "adapters": st["adapters"]})
    assert not changed(plain, plain)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeEngines:
    """Engines' /v1/models on 127.0.0.1: the adapters each has loaded, settable by the test."""

    def __init__(self) -> None:
        self.loaded: list[str] = []
        self.key: str | None = None
        self.port = 0
        self.requests = 0

    async def models(self, request: web.Request) -> web.Response:
        self.requests += 1
        if self.key and request.headers.get("Authorization") != f"Bearer {self.key}":
            return web.json_response({"error": "unauthorized"}, status=401)
        ids = ["base", *self.loaded]
        return web.json_response({"object": "list", "data": [{"id": i, "object": "model"} for i in ids]})

    async def __aenter__(self) -> FakeEngines:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        self.port = _free_port()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._runner.cleanup()


def ready_pod(name: str, port: int, endpoint: str = "demo", env: list[dict[str, Any]] | None = None,
              ready: bool = True, ip: str | None = "127.0.0.1") -> dict[str, Any]:
    engine: dict[str, Any] = {"name": "engine", "image": "sluice-engine",
                              "ports": [{"name": "http", "containerPort": port, "protocol": "TCP"}]}
    if env:
        engine["env"] = env
    status: dict[str, Any] = {"phase": "Running", "conditions": [
        {"type": "PodScheduled", "status": "True"}, {"type": "Ready", "status": "True" if ready else "False"}]}
    if ip:
        status["podIP"] = ip
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "default", "labels": {
                "sluice.dev/endpoint": endpoint, "sluice.dev/role": "serving", "sluice.dev/serves": "true"}},
            "spec": {"containers": [engine]}, "status": status}


@pytest.mark.asyncio
async def test_probe_asks_each_ready_pod() -> None:
    import logging

    log = logging.getLogger("test")
    async with FakeEngines() as engines:
        engines.loaded = ["sql"]
        pods = [ready_pod("a", engines.port), ready_pod("loading", engines.port, ready=False),
                ready_pod("no-ip", engines.port, ip=None), ready_pod("gone", _free_port())]
        out = await probe(pods, log)
        assert out["a"] == frozenset({"base", "sql"}) and "loading" not in out
        assert out["no-ip"] == "no pod IP" and out["gone"].startswith("GET http://127.0.0.1:")
        # An engine with an API key: asked with it when the pod spec holds its value; a Secret is not read.
        engines.key = "s3cret"
        keyed = ready_pod("keyed", engines.port, env=[{"name": "SLUICE_API_KEY", "value": "s3cret"}])
        secret = ready_pod("secret", engines.port, env=[{"name": "SLUICE_API_KEY", "valueFrom": {
            "secretKeyRef": {"name": "engine-key", "key": "key"}}}])
        wrong = ready_pod("wrong", engines.port)
        out = await probe([keyed, secret, wrong], log)
        assert out["keyed"] == frozenset({"base", "sql"})
        assert "which the operator does not read" in out["secret"] and out["wrong"].endswith("HTTP 401")


# -- the loop on kmock -------------------------------------------------------------------------------------
kmock = pytest.importorskip("kmock")
from kopf_harness import (  # noqa: E402 - needs kmock
    CM,
    DEPLOY,
    NS,
    api,
    condition,
    create_endpoint,
    eventually,
    live,
    must,
    operator,
    patch_spec,
    phase_is,
    serve_kinds,
    status_of,
)
from kube_emulator import ApiServer  # noqa: E402

LIVE = {
    "apiVersion": "sluice.dev/v1alpha1",
    "kind": "InferenceEndpoint",
    "metadata": {"name": "lora", "namespace": NS},
    "spec": {"model": {"uri": "hf://HuggingFaceTB/SmolLM2-135M-Instruct", "servedName": "smollm2"},
             "accelerator": {"type": "cpu"}, "replicas": 1,
             "adapters": [{"name": "sql", "source": "hf://org/smollm2-sql-lora"}]},
}


def _listed(k8s: Any, name: str) -> list[str]:
    cm = live(k8s, CM, f"{name}-engine")
    assert cm is not None
    return [a["name"] for a in json.loads(cm["data"][adapters.ADAPTERS_KEY])["adapters"]]


@pytest.mark.kmock(cls=ApiServer)
@pytest.mark.asyncio
@pytest.mark.timeout(90)
async def test_live_endpoint_loads_a_new_adapter_without_a_rollout(kmock: Any) -> None:
    k8s = serve_kinds(kmock)
    name = LIVE["metadata"]["name"]
    async with FakeEngines() as engines, operator(k8s):
        await create_endpoint(k8s, LIVE)
        await eventually(lambda: must_be(_listed(k8s, name), ["sql"]))
        dep = await eventually(lambda: must_get(live(k8s, DEPLOY, name)))
        before = copy.deepcopy(dep)
        assert dep["spec"]["template"]["spec"]["containers"][0]["args"][-1] == "--enable-lora"

        # The kubelet's part: one ready replica, whose engine has loaded sql (the fake answers /v1/models).
        engines.loaded = ["sql"]
        await api(k8s, "POST", f"/api/v1/namespaces/{NS}/pods", ready_pod(f"{name}-1", engines.port, name))
        await api(k8s, "PATCH", f"/apis/apps/v1/namespaces/{NS}/deployments/{name}/status",
                  {"status": {"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1}}, "application/merge-patch+json")
        st = await eventually(lambda: adapters_are(k8s, name, {"sql": True}))
        assert condition(st, "AdaptersReady")["status"] == "True"
        dep = live(k8s, DEPLOY, name)
        before = copy.deepcopy(dep)

        # Add chat: the ConfigMap lists it, the Deployment is not written at all (same template, same version).
        await patch_spec(k8s, name, {"adapters": [*LIVE["spec"]["adapters"], CHAT]})
        await eventually(lambda: must_be(_listed(k8s, name), ["sql", "chat"]))
        await eventually(lambda: must_be(status_of(k8s, name)["observedGeneration"], 2))
        st = await eventually(lambda: adapters_are(k8s, name, {"sql": True, "chat": False}))
        assert (condition(st, "AdaptersReady")["status"], condition(st, "AdaptersReady")["reason"]) == (
            "False", "AdaptersLoading")
        assert st["phase"] == "Ready"  # the base model serves meanwhile
        after = live(k8s, DEPLOY, name)
        assert after["spec"]["template"] == before["spec"]["template"]
        assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]  # no rollout

        # The engine loads it (the sidecar fetched it): nothing in Kubernetes moves, the resync asks again.
        engines.loaded = ["sql", "chat"]
        await eventually(lambda: adapters_are(k8s, name, {"sql": True, "chat": True}), timeout=15)

        # Remove sql: unloaded on the running pods, again without touching the Deployment.
        engines.loaded = ["chat"]
        await patch_spec(k8s, name, {"adapters": [CHAT]})
        await eventually(lambda: must_be(_listed(k8s, name), ["chat"]))
        await eventually(lambda: adapters_are(k8s, name, {"chat": True}), timeout=15)
        after = live(k8s, DEPLOY, name)
        assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]

        # No adapters left: status.adapters and AdaptersReady go (LoRA turns off: that is a rollout).
        await patch_spec(k8s, name, {"adapters": []})
        await eventually(lambda: must("adapters" not in status_of(k8s, name)))
        assert "AdaptersReady" not in {c["type"] for c in status_of(k8s, name)["conditions"]}
        assert "--enable-lora" not in live(k8s, DEPLOY, name)["spec"]["template"]["spec"]["containers"][0]["args"]
        assert engines.requests > 0


@pytest.mark.kmock(cls=ApiServer)
@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_bad_adapter_spec_is_refused_with_the_reason(kmock: Any) -> None:
    """kmock has no CEL (the API server's would refuse it at admission): the operator refuses it the same way."""
    k8s = serve_kinds(kmock)
    bad = copy.deepcopy(LIVE)
    bad["metadata"]["name"] = "bad-lora"
    bad["spec"]["adapters"] = [SQL, {**CHAT, "name": "sql"}, {"name": "smollm2", "source": "hf://org/x"}]
    async with operator(k8s):
        await create_endpoint(k8s, bad)
        st = await eventually(lambda: phase_is(k8s, "bad-lora", "Failed"))
    ready = condition(st, "Ready")
    assert ready["reason"] == "InvalidSpec"
    assert "adapters[].name must be unique" in ready["message"]
    assert live(k8s, DEPLOY, "bad-lora") is None and live(k8s, CM, "bad-lora-engine") is None


def must_be(value: Any, expected: Any) -> bool:
    assert value == expected, f"{value!r} != {expected!r}"
    return True


def must_get(obj: Any) -> Any:
    assert obj is not None
    return obj


def adapters_are(k8s: Any, name: str, loaded: dict[str, bool]) -> dict[str, Any]:
    st = status_of(k8s, name)
    assert {a["name"]: a["loaded"] for a in st.get("adapters") or []} == loaded, st.get("adapters")
    return st

