"""Op by op, bit by bit: sluice serving a GGUF in its blocks against llama.cpp on the same token ids.

Runs .tools/bin/llama-dump (benchmarks/build_llama_cpp_dump.sh) for the prompt and a few greedy steps, runs
sluice's engine on the same ids with hooks on each layer's modules, and prints per step and op how many
floats differ from llama.cpp's and the largest difference, down to the first op that differs. Needs the
llama.cpp build of scripts/get-llama-server.sh.

    .venv/bin/python benchmarks/ggml_check/compare_dump.py --tokens 1,504,3287,282,4649,314,253,1345,30 --n-gen 4
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]


def hf_index(e: int, d: int) -> int:
    return (e >> 1) + (e & 1) * (d >> 1)


def llama_dump(model: Path, tokens: list[int], n_gen: int, out: Path) -> dict[tuple[int, str], np.ndarray]:
    subprocess.run([str(ROOT / ".tools/bin/llama-dump"), "--model", str(model), "--tokens", ",".join(map(str, tokens)),
                    "--n-gen", str(n_gen), "--out", str(out)], check=True, capture_output=True)
    tensors = {}
    for line in (out / "index.tsv").read_text().splitlines()[1:]:
        step, _, name, op, typ, ne, file = line.split("\t")
        if file == "-" or "f32" not in typ:
            continue
        shape = [int(x) for x in ne.split(",")]
        data = np.fromfile(out / file, dtype=np.float32)
        rows = int(np.prod(shape[1:]))
        tensors.setdefault((int(step), f"{name}|{op}"), data.reshape(rows, shape[0]))
    return tensors


def sluice_run(tokens: list[int], n_gen: int):
    from sluice_engine.entrypoints.llm import LLM
    from sluice_engine.sampling_params import SamplingParams

    llm = LLM(device="cpu", kv_cache_memory=64 << 20, warmup="off", enable_prefix_caching=False)
    model = llm.engine.runner.model
    calls: dict[str, list[np.ndarray]] = defaultdict(list)

    def keep(name, which):
        def hook(mod, args, out=None):
            t = args[-1] if which == "in" else out  # the attention's inputs are (cos_sin, x)
            calls[name].append(t.detach().float().reshape(-1, t.shape[-1]).numpy().copy())
        return hook

    for i, layer in enumerate(model.layers):
        layer.self_attn.register_forward_pre_hook(keep(f"attn_norm-{i}", "in"))
        layer.self_attn.qkv_proj.register_forward_hook(keep(f"qkv-{i}", "out"))
        layer.self_attn.o_proj.register_forward_pre_hook(keep(f"kqv_out-{i}", "in"))
        layer.self_attn.o_proj.register_forward_hook(keep(f"attn_out-{i}", "out"))
        layer.mlp.register_forward_pre_hook(keep(f"ffn_norm-{i}", "in"))
        layer.mlp.gate_up_proj.register_forward_hook(keep(f"gate_up-{i}", "out"))
        layer.mlp.down_proj.register_forward_pre_hook(keep(f"ffn_swiglu-{i}", "in"))
        layer.mlp.down_proj.register_forward_hook(keep(f"ffn_out-{i}", "out"))
    out = llm.generate([tokens], SamplingParams(temperature=0, max_tokens=n_gen + 1))
    return calls, out[0].token_ids, model.cfg


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,504,3287,282,4649,314,253,1345,30")
    ap.add_argument("--n-gen", type=int, default=4)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--all", action="store_true", help="every op, not only up to the first that differs")
    args = ap.parse_args()
    from sluice_engine.model_fetch import gguf_source

    gguf = args.model or gguf_source(None)
    tokens = [int(x) for x in args.tokens.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        ref = llama_dump(gguf, tokens, args.n_gen, Path(tmp))
    calls, generated, cfg = sluice_run(tokens, args.n_gen)
    print("sluice generated:", generated)
    hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    inter = cfg.intermediate_size
    perm_q = np.array([h * d + hf_index(e, d) for h in range(hq) for e in range(d)])
    perm_k = np.array([h * d + hf_index(e, d) for h in range(hkv) for e in range(d)])
    first_bad = None
    for step in range(args.n_gen + 1):
        for i in range(cfg.num_layers):
            qkv = calls[f"qkv-{i}"][step]
            gu = calls[f"gate_up-{i}"][step]
            ours = {
                f"attn_norm-{i}|MUL": calls[f"attn_norm-{i}"][step],
                f"Qcur-{i}|MUL_MAT": qkv[:, : hq * d][:, perm_q],
                f"Kcur-{i}|MUL_MAT": qkv[:, hq * d : (hq + hkv) * d][:, perm_k],
                f"Vcur-{i}|MUL_MAT": qkv[:, (hq + hkv) * d :],
                f"kqv_out-{i}|RESHAPE": calls[f"kqv_out-{i}"][step],
                f"attn_out-{i}|MUL_MAT": calls[f"attn_out-{i}"][step],
                f"ffn_norm-{i}|MUL": calls[f"ffn_norm-{i}"][step],
                f"ffn_gate-{i}|MUL_MAT": gu[:, :inter],
                f"ffn_up-{i}|MUL_MAT": gu[:, inter:],
                f"ffn_swiglu-{i}|SWIGLU": calls[f"ffn_swiglu-{i}"][step],
                f"ffn_out-{i}|MUL_MAT": calls[f"ffn_out-{i}"][step],
            }
            for name, mine in ours.items():
                theirs = ref.get((step, name))
                if theirs is None:
                    continue
                if i == cfg.num_layers - 1 and step == 0 and theirs.shape[0] != mine.shape[0]:
                    mine = mine[-theirs.shape[0]:]  # llama.cpp keeps only the output row in the last layer
                if theirs.shape != mine.shape:
                    print(f"step {step} {name}: shapes {theirs.shape} vs {mine.shape}")
                    continue
                bad = int((mine.view(np.uint32) != theirs.view(np.uint32)).sum())
                if bad or args.all:
                    print(f"step {step} {name:28s} {bad:6d}/{mine.size} differ, max |diff| "
                          f"{float(np.abs(mine - theirs).max()):.3g}")
                if bad and first_bad is None:
                    first_bad = (step, name)
                    if not args.all:
                        print("first difference:", first_bad)
                        return 1
    print("first difference:", first_bad or "none: every compared op bit-identical")
    return 0 if first_bad is None else 1


if __name__ == "__main__":
    torch.set_num_threads(2)
    raise SystemExit(main())
