"""`sluice render`: prints exactly reconcile()'s manifests; invalid input names the field and fails."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml
from operator_schemas import EXAMPLES, ROOT, load_yaml

from sluice_engine.entrypoints.cli import main
from sluice_operator.reconcile import reconcile
from sluice_operator.spec import parse_endpoint


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_render_yaml_is_reconcile(path, capsys):
    assert main(["render", "-f", str(path)]) == 0
    out = capsys.readouterr().out
    assert list(yaml.safe_load_all(out)) == reconcile(parse_endpoint(load_yaml(path)))
    assert "&id" not in out and "*id" not in out  # no YAML anchors/aliases: plain, reviewable documents


def test_render_json_is_a_list(capsys):
    path = EXAMPLES[0]
    assert main(["render", "-f", str(path), "-o", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["kind"] == "List" and doc["items"] == reconcile(parse_endpoint(load_yaml(path)))


def test_render_several_documents(tmp_path, capsys):
    both = tmp_path / "both.yaml"
    both.write_text("\n---\n".join(p.read_text() for p in EXAMPLES[:2]))
    assert main(["render", "-f", str(both)]) == 0
    kinds = [d["metadata"]["name"] for d in yaml.safe_load_all(capsys.readouterr().out)]
    assert len(kinds) == sum(len(reconcile(parse_endpoint(load_yaml(p)))) for p in EXAMPLES[:2])


def _serve_args(manifests: list[dict]) -> list[str]:
    workload = next(m for m in manifests if m["kind"] in ("Deployment", "LeaderWorkerSet"))
    containers = workload["spec"]["template"]["spec"]["containers"]
    engine = next(c for c in containers if c["name"] == "engine")
    return engine["args"]


def test_quantization_renders_the_engine_flag_only_when_set(tmp_path, capsys):
    base = ("apiVersion: sluice.dev/v1alpha1\nkind: InferenceEndpoint\nmetadata: {name: q, namespace: ml}\n"
            "spec: {model: {uri: 'hf://org/m'}%s}\n")
    unset = reconcile(parse_endpoint(yaml.safe_load(base % "")))
    assert "--quantization" not in _serve_args(unset)
    for engine, accelerator, value in (("{quantization: awq}", "", "awq"),
                                       ("{quantization: q8_0}", ", accelerator: {type: cpu}", "q8_0"),
                                       ("{quantization: auto}", "", "auto")):
        path = tmp_path / "q.yaml"
        path.write_text(base % (f", engine: {engine}{accelerator}"))
        assert main(["render", "-f", str(path)]) == 0
        args = _serve_args(list(yaml.safe_load_all(capsys.readouterr().out)))
        i = args.index("--quantization")
        assert args[i + 1] == value
        # Everything else is as without the field: setting it changes only this flag.
        path.write_text(base % accelerator)
        main(["render", "-f", str(path)])
        without = _serve_args(list(yaml.safe_load_all(capsys.readouterr().out)))
        assert args[:i] + args[i + 2:] == without


def test_kv_cache_dtype_renders_the_engine_flag_only_when_set():
    base = ("apiVersion: sluice.dev/v1alpha1\nkind: InferenceEndpoint\nmetadata: {name: q, namespace: ml}\n"
            "spec: {model: {uri: 'hf://org/m'}%s}\n")
    without = _serve_args(reconcile(parse_endpoint(yaml.safe_load(base % ""))))
    assert "--kv-cache-dtype" not in without
    for value in ("fp8", "auto"):
        args = _serve_args(reconcile(parse_endpoint(yaml.safe_load(base % f", engine: {{kvCacheDtype: {value}}}"))))
        i = args.index("--kv-cache-dtype")
        assert args[i + 1] == value
        assert args[:i] + args[i + 2:] == without  # setting it changes only this flag


@pytest.mark.parametrize(("text", "message"), [
    ("apiVersion: sluice.dev/v1alpha1\nkind: InferenceEndpoint\nmetadata: {name: x}\n"
     "spec: {model: {uri: 'hf://a/b'}, scaling: {minReplicas: 3, maxReplicas: 2}}\n",
     "spec.scaling: scaling.minReplicas must not exceed scaling.maxReplicas"),
    ("apiVersion: sluice.dev/v1alpha1\nkind: InferenceEndpoint\nmetadata: {name: x}\n"
     "spec: {model: {uri: 'hf://a/b'}, engine: {args: {device: cpu}}}\n",
     "spec.engine.args: 'device' is set by the operator from accelerator.type"),
    ("apiVersion: sluice.dev/v1alpha1\nkind: InferenceEndpoint\nmetadata: {name: x}\n"
     "spec: {model: {uri: 'hf://a/b'}, engine: {quantization: gptq}, accelerator: {type: cpu}}\n",
     "spec: engine.quantization fp8, awq and gptq run on GPUs only (Triton kernels) and accelerator.type is cpu"),
    ("apiVersion: sluice.dev/v1alpha1\nkind: InferenceEndpoint\nmetadata: {name: x}\n"
     "spec: {model: {uri: 'hf://a/b'}, engine: {kvCacheDtype: fp8}, accelerator: {type: cpu}}\n",
     "spec: engine.kvCacheDtype fp8 runs on GPUs only (the Triton attention kernels) and accelerator.type is cpu"),
    ("apiVersion: sluice.dev/v1\nkind: InferenceEndpoint\nmetadata: {name: x}\nspec: {model: {uri: 'hf://a/b'}}\n",
     "apiVersion: Input should be 'sluice.dev/v1alpha1'"),
    ("spec: [unclosed", "not valid YAML"),
    ("", "no InferenceEndpoint found"),
])
def test_invalid_input_names_the_field(tmp_path, capsys, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    assert main(["render", "-f", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("sluice render: error: ") and message in captured.err


def test_scale_to_zero_without_a_gateway_fails_with_the_reason(tmp_path, capsys, monkeypatch):
    """The operator's settings (here: no gateway, as the chart's gateway.enabled=false sets them) can rule out
    an endpoint the schema accepts; `sluice render` says so and exits non-zero, like the operator's Ready
    condition (test_operator_loop)."""
    path = tmp_path / "zero.yaml"
    path.write_text("apiVersion: sluice.dev/v1alpha1\nkind: InferenceEndpoint\nmetadata: {name: x}\n"
                    "spec: {model: {uri: 'hf://a/b'}, scaling: {minReplicas: 0, maxReplicas: 2}}\n")
    assert main(["render", "-f", str(path)]) == 0  # with the default gateway it is fine
    capsys.readouterr()
    monkeypatch.setenv("SLUICE_GATEWAY_SCALER_ADDRESS", "")
    assert main(["render", "-f", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("sluice render: error: InferenceEndpoint 'x': scaling.minReplicas is 0, but "
                                   "this operator has no gateway")
    assert "Set scaling.minReplicas to 1 or more, or install the gateway." in captured.err


def test_missing_file(capsys):
    assert main(["render", "-f", "/nonexistent/endpoint.yaml"]) == 2
    assert "cannot read /nonexistent/endpoint.yaml" in capsys.readouterr().err


def test_console_script_reads_stdin():
    """The installed entry point, end to end in a subprocess (stdin, exit status)."""
    exe = ROOT / ".venv" / "bin" / "sluice"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "sluice_engine.entrypoints.cli"]
    ok = subprocess.run([*cmd, "render", "-f", "-"], input=EXAMPLES[0].read_text(), capture_output=True,
                        text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert len(list(yaml.safe_load_all(ok.stdout))) == len(reconcile(parse_endpoint(load_yaml(EXAMPLES[0]))))
    bad = subprocess.run([*cmd, "render", "-f", "-"], input="kind: Nope\n", capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "apiVersion: Field required" in bad.stderr
