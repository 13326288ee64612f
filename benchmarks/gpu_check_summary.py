"""The end of benchmarks/gpu_check.sh: its steps (steps.tsv) and the figures of each step's JSON, as a table on
stdout and $OUT/summary.json. Standard library only (it runs wherever the check's Python runs).

    python benchmarks/gpu_check_summary.py OUT MODE ALLOW_SKIPS [PART]

summary.json: {"mode", "part", "allow_skips", "passed", "steps": [{"step", "status", "seconds", "reason", "figures"}],
"figures": {...}} where figures are the headline numbers docs/BENCHMARKS.md quotes: decode ms/step eager vs
graphs per batch against the weight-read floor, attention GB/s as a share of HBM, serve tok/s per backend,
the quantized GEMMs' weight bandwidth, the tests' counts; in the features part, LoRA tok/s against the base model
the offload tier's TTFT gain, and the KV hop's TTFT against computing the prompt.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def decode_figures(d: dict) -> dict:
    floor = d.get("floor_ms")
    out = {"floor_ms": floor, "batches": {}}
    for mode, rows in d.get("results", {}).items():
        for r in rows:
            b = out["batches"].setdefault(str(r["batch"]), {})
            b[f"{mode}_ms"] = r["median_ms"]
            b[f"{mode}_tok_s"] = r["tok_s"]
            if floor:
                b[f"{mode}_floor_share"] = floor / r["median_ms"]
    out["targets"] = d.get("targets", [])
    return out


def attention_figures(d: dict) -> dict:
    return {"rows": [{k: r.get(k) for k in ("batch", "context", "splits", "triton_us", "triton_eager_us",
                                             "triton_tbps", "triton_peak_pct", "sdpa_tbps")}
                     for r in d.get("decode", [])]}


def quant_figures(d: dict) -> dict:
    return {"rows": [{k: r.get(k) for k in ("M", "K", "N", "kernel", "ms", "weight_gbps", "speedup_vs_bf16")}
                     for r in d.get("rows", [])]}


def fused_figures(d: dict) -> dict:
    return {"layer": [{k: r.get(k) for k in ("batch", "unfused_graph_us", "fused_graph_us", "rel_err")}
                      for r in d.get("rows", []) if r.get("op") == "layer"]}


def test_counts(xml_path: Path) -> dict | None:
    try:
        root = ET.parse(xml_path).getroot()
    except (OSError, ET.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    keys = ("tests", "failures", "errors", "skipped")
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in keys}
    failed = [f"{c.get('classname')}::{c.get('name')}" for s in suites for c in s.iter("testcase")
              if c.find("failure") is not None or c.find("error") is not None]
    return {**counts, "passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
            "failed": failed}


FIGURES = {"decode-step": ("decode_step.json", decode_figures), "serve": ("serve.json", lambda d: d),
           "attention": ("attention.json", attention_figures), "fused": ("fused.json", fused_figures),
           "quant-gemm": ("quant_gpu.json", quant_figures), "async": ("async.json", lambda d: d),
           "lora": ("lora.json", lambda d: d), "offload": ("kv_offload.json", lambda d: d),
           "kv-transfer": ("kv_transfer.json", lambda d: d), "prefill-tiles": ("prefill_tiles.json", lambda d: d),
           "structured": ("structured.json", lambda d: d)}


def headline(figures: dict) -> list[str]:
    lines = []
    dec = figures.get("decode-step")
    if dec:
        floor = dec.get("floor_ms")
        for b, v in dec["batches"].items():
            g, e = v.get("graphs_ms"), v.get("eager_ms")
            share = f" (the {floor:.2f} ms weight-read floor is {100 * floor / g:.0f}% of it)" if floor and g else ""
            parts = ([f"graphs {g:.3f} ms/step{share}"] if g else []) + ([f"eager {e:.3f} ms/step"] if e else [])
            lines.append(f"decode b{b}: " + ", ".join(parts))
    for r in (figures.get("attention") or {}).get("rows", []):
        pct = r.get("triton_peak_pct")
        lines.append(f"attention b{r['batch']} ctx {r['context']}: {r['triton_tbps'] * 1000:.0f} GB/s"
                     + (f" ({pct:.0f}% of HBM)" if pct is not None else "") + f", SDPA {r['sdpa_tbps'] * 1000:.0f}")
    serve = figures.get("serve")
    if serve:
        lines.append("serve tok/s: " + ", ".join(f"{b} {v['tok_per_s']:.0f}" for b, v in serve["backends"].items())
                     + f" (greedy {'agrees' if serve.get('ok') else 'DIFFERS'})")
    for b, v in ((figures.get("async") or {}).get("batches") or {}).items():
        sy, asy = v["sync"], v["async"]
        lines.append(f"async scheduling b{b}: {sy['ms_per_step']:.2f} -> {asy['ms_per_step']:.2f} ms/step, host work on the "
                     f"critical path {sy['critical_ms']:.2f} -> {asy['critical_ms']:.2f} ms "
                     f"(tokens {'agree' if v['same_greedy'] else 'DIFFER'})")
    for shape, v in ((figures.get("prefill-tiles") or {}).get("best") or {}).items():
        lines.append(f"prefill {shape} (batch x new x cached): best {v['config']}, {v['gain_over_default']:.2f}x the "
                     f"default, {v['share_of_sdpa']:.2f}x SDPA")
    for r in (figures.get("lora") or {}).get("rows", []):
        lines.append(f"lora: {r['requests_on']} ({r['engine']}, {r['path']}): {r['tok_per_s']:.0f} tok/s, "
                     f"{r['vs_base']:.2f}x base")
    off = figures.get("offload")
    if off:
        rows = off["rows"]
        lines.append(f"offload: TTFT p50 {rows['recompute']['ttft_p50_ms']:.1f} ms recomputed, "
                     f"{rows['offload tier']['ttft_p50_ms']:.1f} ms from the tier ({off['speedup']:.2f}x; first "
                     f"tokens {'agree' if off['same_tokens'] else 'DIFFER'})")
    for r in (figures.get("structured") or {}).get("rows", []):
        lines.append(f"structured b{r['batch']}: TPOT {r['tpot_plain_ms']:.2f} ms plain, {r['tpot_json_ms']:.2f} ms with a "
                     f"JSON schema (mask {r['mask_ms_per_step']:.3f} ms a step)")
    kvt = figures.get("kv-transfer")
    if kvt:
        lines.append(f"kv-transfer: {kvt['prompts']} prompts of {kvt['prompt_tokens']} tokens, TTFT p50 through the hop "
                     f"{kvt['hop_ttft_p50_ms']:.1f} ms, computed directly {kvt['local_ttft_p50_ms']:.1f} ms "
                     f"(tokens {'agree' if kvt['same_tokens'] else 'DIFFER'})")
    tests = figures.get("triton-tests")
    if tests:
        lines.append(f"tests: {tests['passed']} passed, {tests['failures'] + tests['errors']} failed, "
                     f"{tests['skipped']} skipped")
    return lines


def main(argv: list[str]) -> int:
    out, mode, allow_skips = Path(argv[1]), argv[2], argv[3] == "1"
    part = argv[4] if len(argv) > 4 else "main"
    steps = []
    for line in (out / "steps.tsv").read_text().splitlines():
        name, status, secs, reason = (line.split("\t") + [""] * 4)[:4]
        steps.append({"step": name, "status": status, "seconds": int(secs or 0), "reason": reason})
    figures = {}
    for s in steps:
        if s["step"] in FIGURES:
            name, extract = FIGURES[s["step"]]
            d = _load(out / name)
            if d is not None:
                figures[s["step"]] = s["figures"] = extract(d)
        elif s["step"] == "triton-tests":
            counts = test_counts(out / "triton-tests.xml")
            if counts is not None:
                figures[s["step"]] = s["figures"] = counts
    passed = all(s["status"] == "PASS" or (s["status"] == "SKIP" and allow_skips) for s in steps)
    (out / "summary.json").write_text(json.dumps({"mode": mode, "part": part, "allow_skips": allow_skips, "passed": passed,
                                                  "steps": steps, "figures": figures}, indent=1))
    print(f"{'step':<14} {'status':<8} {'secs':>6}  reason")
    for s in steps:
        print(f"{s['step']:<14} {s['status']:<8} {s['seconds']:>6}  {s['reason'][:150]}")
    for line in headline(figures):
        print("  " + line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
