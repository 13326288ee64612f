"""benchmarks/gpu_check.sh's control flow on CPU: the dry run passes end to end (wheel install included), and the
check never passes falsely: no torch, a skipped core step, or two versions of one wheel each fail it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
ALL_STEPS = ["env", "decode-step", "serve", "async", "attention", "fused", "quant-gemm", "triton-tests"]


def run_check(tmp_path: Path, *args: str, python: str | None = None, wheels: Path | None = None,
              timeout: float = 600) -> tuple[int, dict, str]:
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": python or sys.executable,
           "WHEELS": str(wheels or tmp_path / "no-wheels")}
    proc = subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=timeout)
    summary = json.loads((out / "summary.json").read_text())
    return proc.returncode, summary, proc.stdout + proc.stderr


def statuses(summary: dict) -> dict[str, str]:
    return {s["step"]: s["status"] for s in summary["steps"]}


@pytest.mark.slow
def test_dry_run_passes_with_the_wheels_installed(tmp_path):
    """What CI proves: every step runs on CPU (tiny model, Triton's interpreter) and passes; the GPU wheel set
    (benchmarks/gpu_wheels.sh, downloaded here from PyPI) installs into a temp target for CPython 3.12."""
    wheels = tmp_path / "whl"
    got = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_wheels.sh"), str(wheels)], capture_output=True,
                         text=True, timeout=300)
    assert got.returncode == 0, got.stdout + got.stderr
    rc, summary, log = run_check(tmp_path, "--cpu-dry-run", wheels=wheels)
    assert rc == 0, log[-4000:]
    assert statuses(summary) == dict.fromkeys(ALL_STEPS, "PASS"), summary
    assert summary["passed"] and summary["mode"] == "cpu-dry-run"
    env_log = (tmp_path / "out" / "env.log").read_text()
    assert f"wheels: {len(list(wheels.glob('*.whl')))} from {wheels} install" in env_log
    assert summary["figures"]["triton-tests"]["passed"] > 0
    assert summary["figures"]["serve"]["ok"] is True
    assert "GPU CHECK PASSED" in log


@pytest.mark.slow
def test_the_features_part_runs_every_step_on_the_random_model(tmp_path):
    """`--part features` (issue 43): env, the prefill tile sweep (interpreter), then the LoRA, offload-tier,
    structured-output and KV-transfer benchmarks on the tiny random model (byte-level tokenizer), the same control
    flow a GPU runs with the 8B one; their figures reach the summary (adapters against the base model; the tier
    served prefixes and gave the recomputed first tokens; the schema's output opened a JSON object; every full block
    of the hop's prompts came from the prefill engine, whose tokens the decode engine gave)."""
    rc, summary, log = run_check(tmp_path, "--cpu-dry-run", "--part", "features", timeout=300)
    assert rc == 0, log[-4000:]
    assert statuses(summary) == dict.fromkeys(["env", "prefill-tiles", "lora", "offload", "structured", "kv-transfer"],
                                              "PASS"), summary
    assert summary["figures"]["structured"]["rows"][0]["batch"] == 1
    assert summary["part"] == "features" and summary["passed"]
    lora = {(r["requests_on"], r["engine"], r["path"]): r for r in summary["figures"]["lora"]["rows"]}
    assert lora[("base only", "LoRA on, 16 slots", "default")]["vs_base"] == 1.0
    assert lora[("4 adapters", "LoRA on, 16 slots", "default")]["tok_per_s"] > 0
    offload = summary["figures"]["offload"]
    assert offload["same_tokens"] is True
    assert offload["rows"]["offload tier"]["prefix_hits"] > 0 and offload["rows"]["recompute"]["prefix_hits"] == 0
    kvt = summary["figures"]["kv-transfer"]
    assert kvt["same_tokens"] is True and kvt["decode_tier_hit_tokens"] == 3 * (299 // 16) * 16
    assert "offload: TTFT p50" in log and "kv-transfer: 3 prompts" in log and "GPU CHECK PASSED" in log


def test_no_torch_fails_and_skips_every_other_step(tmp_path):
    """A Python without torch (a bare venv): env FAILS naming it, every other step is skipped, exit non-zero."""
    bare = tmp_path / "bare"
    venv.create(bare, with_pip=False)
    rc, summary, log = run_check(tmp_path, "--cpu-dry-run", python=str(bare / "bin" / "python"), timeout=120)
    assert rc != 0
    st = statuses(summary)
    assert st["env"] == "FAIL" and "torch" in summary["steps"][0]["reason"]
    assert all(st[s] == "SKIP" for s in ALL_STEPS[1:]), st
    assert "GPU CHECK FAILED" in log


def test_no_c_compiler_fails_env(tmp_path, monkeypatch):
    """Triton builds its launcher with a C compiler and Python's headers at the first kernel launch: env checks
    both up front and FAILS naming what is missing (CC points the check at a compiler that is not there)."""
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    skip = ",".join(ALL_STEPS[1:])
    rc, summary, _ = run_check(tmp_path, "--cpu-dry-run", "--skip", skip, "--allow-skips", timeout=120)
    assert rc != 0
    assert statuses(summary)["env"] == "FAIL" and "no C compiler" in summary["steps"][0]["reason"]


def test_a_skipped_core_step_fails_unless_allowed(tmp_path):
    skip = ",".join(ALL_STEPS[1:])
    rc, summary, log = run_check(tmp_path, "--cpu-dry-run", "--skip", skip, timeout=120)
    assert rc != 0 and statuses(summary)["env"] == "PASS", log[-3000:]
    assert "core step serve was skipped" in log and not summary["passed"]
    rc, summary, log = run_check(tmp_path, "--cpu-dry-run", "--skip", skip, "--allow-skips", timeout=120)
    assert rc == 0 and summary["passed"], log[-3000:]


def test_two_versions_of_one_wheel_fail_env(tmp_path):
    wheels = tmp_path / "whl"
    wheels.mkdir()
    for v in ("4.14.0", "4.14.9"):
        (wheels / f"platformdirs-{v}-py3-none-any.whl").write_bytes(b"")
    skip = ",".join(ALL_STEPS[1:])
    rc, summary, _ = run_check(tmp_path, "--cpu-dry-run", "--skip", skip, "--allow-skips", wheels=wheels,
                               timeout=120)
    assert rc != 0
    assert statuses(summary)["env"] == "FAIL" and "wheels" in summary["steps"][0]["reason"]
