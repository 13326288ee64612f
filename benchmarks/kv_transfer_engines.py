"""KV transfer between two engines on one device (issue 43's GPU check, `--part features`): a prefill engine and a
decode engine (`sluice serve --kv-role prefill` / `--kv-role decode --prefill-url ...`, transfers sealed with an
endpoint key, as the operator wires a disaggregated endpoint), both on the same GPU (or CPU). Long prompts sent to
the decode engine hop to the prefill engine, which computes them and pushes their KV blocks back (device -> host
-> TCP -> the decode engine's host tier -> its device); short ones stay where they are.

Per long prompt (random token ids, distinct prompts, one at a time, greedy): the TTFT through the hop (the client
streams from the decode engine), and the TTFT of a prompt of the same length computed on the prefill engine
directly (no hop) for comparison. Then the same prompts on the prefill engine alone, whose greedy tokens the hop's
must equal (the transferred blocks are the ones the prefill engine computed). Reported: TTFT p50 both ways, the
pushes and the decode engine's tier hits (from /metrics), and whether the tokens agree; exit 1 if they do not, or
if no prompt was served from transferred blocks.

    python benchmarks/kv_transfer_engines.py --model /dev/shm/llama8b --prompt-tokens 4000 --prompts 6 \\
        --kv-cache-memory 4G --kv-offload-bytes 8GiB      # a GPU, the random 8B (benchmarks/gpu_check.sh)
    .venv/bin/python benchmarks/kv_transfer_engines.py --model /tmp/tiny --device cpu --prompt-tokens 300
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from server_process import Server, free_port


def prompt_ids(seed: int, tokens: int, vocab: int) -> list[int]:
    """Random ids from a seed >= 0 (random.Random seeds by |seed|: -1 would repeat 1's prompt)."""
    g = random.Random(seed)
    return [g.randrange(3, vocab) for _ in range(tokens)]  # ids 0-2: the random models' special tokens


def stream_completion(url: str, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
    """(seconds to the first streamed token, the generated token ids) of one greedy completion."""
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "logprobs": 0, "return_tokens_as_token_ids": True}  # the ids, as "token_id:N" strings
    t0, ttft, ids = time.perf_counter(), None, []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = (json.loads(line[6:]).get("choices") or [{}])[0]
            got = [int(t.split(":", 1)[1]) for t in (choice.get("logprobs") or {}).get("tokens") or []]
            if got and ttft is None:
                ttft = time.perf_counter() - t0
            ids.extend(got)
    return (ttft if ttft is not None else float("nan")), ids


def counters(url: str, name: str) -> dict[str, float]:
    """A counter's samples in a server's /metrics, by their label set ("" for none)."""
    out = {}
    for ln in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if ln.startswith(name) and ln[len(name)] in "{ ":
            labels, value = ln[len(name):].rsplit(" ", 1)
            out[labels.strip()] = float(value)
    return out


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="an HF directory (e.g. benchmarks/random_model.py's)")
    p.add_argument("--device", default="auto")
    p.add_argument("--prompts", type=int, default=6, help="long prompts through the hop (and as many computed directly)")
    p.add_argument("--prompt-tokens", type=int, default=4000)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--kv-cache-memory", default=None, help="per engine (both on one device), e.g. 4G")
    p.add_argument("--kv-offload-bytes", default="2GiB", help="the decode engine's host tier (received blocks land there)")
    p.add_argument("--log-dir", default=None)
    p.add_argument("--json")
    a = p.parse_args()

    vocab = json.loads((Path(a.model) / "config.json").read_text())["vocab_size"]
    logs = Path(a.log_dir or tempfile.mkdtemp(prefix="kv-transfer-"))
    logs.mkdir(parents=True, exist_ok=True)
    key_file = logs / "kv-secret"  # the endpoint's key, as the operator mounts it into both pools: pushes are sealed
    key_file.write_text(os.urandom(32).hex())
    pport, dport, kvport = free_port(), free_port(), free_port()
    common = ["--model", a.model, "--device", a.device, "--served-model-name", "m", "--host", "127.0.0.1",
              "--log-level", "warning", "--max-model-len", str(a.prompt_tokens + a.max_tokens + 64),
              "--kv-secret-file", str(key_file),
              *(["--kv-cache-memory", a.kv_cache_memory] if a.kv_cache_memory else [])]
    cli = [sys.executable, "-m", "sluice_engine.entrypoints.cli", "serve"]
    env = dict(os.environ)
    servers = [Server("prefill", [*cli, *common, "--port", str(pport), "--kv-role", "prefill"], env,
                      logs / "prefill.log", f"http://127.0.0.1:{pport}", "/ready"),
               Server("decode", [*cli, *common, "--port", str(dport), "--kv-role", "decode", "--kv-host", "127.0.0.1",
                                 "--kv-port", str(kvport), "--kv-offload-bytes", a.kv_offload_bytes,
                                 "--prefill-url", f"http://127.0.0.1:{pport}",
                                 "--prefill-min-prompt-tokens", str(min(256, a.prompt_tokens))], env,
                      logs / "decode.log", f"http://127.0.0.1:{dport}", "/ready")]
    prefill, decode = (s.url for s in servers)
    try:
        for s in servers:
            s.wait_ready(900)
        stream_completion(decode, prompt_ids(2 * 10**6, a.prompt_tokens, vocab), a.max_tokens)  # warm-up: both engines, the hop
        stream_completion(prefill, prompt_ids(2 * 10**6 + 1, a.prompt_tokens, vocab), a.max_tokens)
        hits0 = counters(decode, "sluice_kv_offload_hits_total")
        hops0 = counters(decode, "sluice_kv_prefill_hops_total")
        pushes0 = counters(prefill, "sluice_kv_pushes_total")
        hop_ttft, local_ttft, hop_tokens = [], [], []
        for i in range(a.prompts):
            t, ids = stream_completion(decode, prompt_ids(i, a.prompt_tokens, vocab), a.max_tokens)
            hop_ttft.append(t)
            hop_tokens.append(ids)
            local_ttft.append(stream_completion(prefill, prompt_ids(10**6 + i, a.prompt_tokens, vocab), a.max_tokens)[0])
        hits = sum(delta(counters(decode, "sluice_kv_offload_hits_total"), hits0).values())
        hops = delta(counters(decode, "sluice_kv_prefill_hops_total"), hops0)
        pushes = delta(counters(prefill, "sluice_kv_pushes_total"), pushes0)
        # The reference: the same prompts on the prefill engine itself (from its own cache of what it computed).
        ref_tokens = [stream_completion(prefill, prompt_ids(i, a.prompt_tokens, vocab), a.max_tokens)[1]
                      for i in range(a.prompts)]
    finally:
        for s in servers:
            s.stop()
    same = hop_tokens == ref_tokens
    res = {"prompt_tokens": a.prompt_tokens, "prompts": a.prompts,
           "hop_ttft_p50_ms": statistics.median(hop_ttft) * 1e3, "local_ttft_p50_ms": statistics.median(local_ttft) * 1e3,
           "decode_tier_hit_tokens": hits, "hops": hops, "pushes": pushes, "same_tokens": same}
    print(f"{a.prompts} prompts of {a.prompt_tokens} tokens, one at a time: TTFT p50 through the hop "
          f"{res['hop_ttft_p50_ms']:.1f} ms, computed directly {res['local_ttft_p50_ms']:.1f} ms; the decode engine "
          f"loaded {hits:.0f} prompt tokens from transferred blocks; hops {hops}; pushes {pushes}; greedy tokens "
          f"{'agree' if same else 'DIFFER'}")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    block = 16  # the engines' --block-size (default)
    expected = a.prompts * ((a.prompt_tokens - 1) // block) * block  # every full block of each prompt
    if not same or hits < expected:
        raise SystemExit("the hop's tokens differ from the prefill engine's" if not same
                         else f"{hits:.0f} prompt tokens loaded from transferred blocks, not {expected}")


if __name__ == "__main__":
    main()
