"""`sluice serve` end to end with two attention backends (issue 15): the same greedy tokens from
--attention-backend triton and --attention-backend torch on one random-weight model.

    python benchmarks/serve_backends.py --model-dir /dev/shm/llama8b                     # CUDA, bf16
    TRITON_INTERPRET=1 python benchmarks/serve_backends.py --preset tiny --device cpu    # CPU: interpreter

One server per backend, one after the other (python -m sluice_engine.entrypoints.cli serve, a free port), each sent the
same /v1/completions request: --prompts prompts of fixed random token ids (seed 0, lengths 5 to ~300),
max_tokens --max-tokens, temperature 0, ignore_eos, logprobs 2, tokens returned as ids. Random weights make
logits nearly flat, so an honest kernel difference can flip a near-tie: where the two token streams first
differ, the position is tolerated (and listed) when either server's top-2 logprob gap there is below the tie
tolerance; the rest of that completion is then not compared. Any other difference fails (exit 1), and so does
a chosen-token logprob that moves by more than twice the tie tolerance before any divergence. The tie tolerance
is --tie-tol or, if larger, TIE_ULPS units of the serving dtype's rounding at the logprob's magnitude
(|logprob| x 2^-8 in bf16): two correct bf16 kernels that sum in different orders disagree by a few such
units (the H200's first run: top-2 gaps of 0.03-0.06 flipped at logprobs near -11, where a bf16 step is
0.06; a 1e-3 tolerance called them failures). Then the same request is sent again and timed: tok/s per backend
(a small batch; a smoke figure, not a throughput benchmark). --json writes the figures. Needs only the
standard library on this side (urllib); the servers need the engine's serving packages (fastapi, uvicorn).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def serve(model_dir: Path, backend: str, args, log_path: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "sluice_engine.entrypoints.cli", "serve", "--model", str(model_dir), "--port", str(port),
           "--served-model-name", "random", "--attention-backend", backend, "--device", args.device,
           "--kv-cache-memory", args.kv_cache_memory, "--max-num-seqs", "8", "--cuda-graph-max-batch", "8",
           "--max-model-len", "1024", *(["--dtype", args.dtype] if args.dtype else [])]
    log = open(log_path, "w")  # noqa: SIM115 - the child holds it; closed with the process
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.ready_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{backend}: sluice serve exited with {proc.returncode}; log:\n"
                               + log_path.read_text()[-4000:])
        try:
            with urllib.request.urlopen(f"{url}/ready", timeout=1) as r:
                if r.status == 200:
                    return proc, url
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    stop(proc)
    raise TimeoutError(f"{backend}: not ready after {args.ready_timeout}s; log:\n" + log_path.read_text()[-4000:])


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def completions(url: str, prompts: list[list[int]], max_tokens: int) -> list[tuple[list[int], list[float], list[float]]]:
    """Per prompt: (token ids, chosen-token logprobs, top-2 gaps)."""
    body = {"model": "random", "prompt": prompts, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "logprobs": 2, "return_tokens_as_token_ids": True}
    out = post(f"{url}/v1/completions", body, timeout=300)
    results = []
    for ch in sorted(out["choices"], key=lambda c: c["index"]):
        lp = ch["logprobs"]
        ids = [int(t.removeprefix("token_id:")) for t in lp["tokens"]]
        gaps = []
        for top in lp["top_logprobs"]:
            v = sorted((top or {}).values(), reverse=True)
            gaps.append(v[0] - v[1] if len(v) > 1 else float("inf"))
        results.append((ids, [x if x is not None else float("nan") for x in lp["token_logprobs"]], gaps))
    return results


# Relative rounding step of each serving dtype (2^-mantissa bits), and how many such steps at a logprob's magnitude
# count as a tie between two correct kernels.
DTYPE_EPS = {"bfloat16": 2.0**-8, "float16": 2.0**-11, "float32": 2.0**-24}
TIE_ULPS = 4


def tie_tolerance(logprob: float, eps: float, floor: float) -> float:
    """The top-2 gap below which a flip at this logprob is a near-tie for this dtype (eps: DTYPE_EPS)."""
    return max(floor, TIE_ULPS * eps * max(abs(logprob), 1.0))


def compare(a, b, tie_tol: float, eps: float = 0.0) -> tuple[bool, list[str], float]:
    """(all equal up to tolerated near-ties, notes, max |dlogprob| before any divergence). eps: the serving
    dtype's relative rounding step (DTYPE_EPS; 0 keeps tie_tol alone)."""
    ok, notes, max_d = True, [], 0.0
    for i, ((ia, la, ga), (ib, lb, gb)) in enumerate(zip(a, b, strict=True)):
        for pos, (x, y) in enumerate(zip(ia, ib, strict=False)):
            tol = tie_tolerance(max(abs(la[pos]), abs(lb[pos])), eps, tie_tol)
            if x != y:
                gap = min(ga[pos], gb[pos])
                tied = gap < tol
                ok &= tied
                notes.append(f"prompt {i} position {pos}: {x} vs {y}, top-2 gap {gap:.2e} (tie below {tol:.2e}) "
                             f"-> {'tolerated (near-tie)' if tied else 'DIFFERENT'}")
                break
            d = abs(la[pos] - lb[pos])
            max_d = max(max_d, d)
            if d > 2 * tol:
                ok = False
                notes.append(f"prompt {i} position {pos}: same token {x}, logprobs {la[pos]:.4f} vs {lb[pos]:.4f} "
                             f"differ by {d:.2e} (> {2 * tol:.2e}) -> DIFFERENT")
                break
        if len(ia) != len(ib):
            ok = False
            notes.append(f"prompt {i}: {len(ia)} vs {len(ib)} tokens")
    return ok, notes, max_d


def main() -> int:
    import random_model

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=list(random_model.PRESETS), default="llama-8b")
    p.add_argument("--model-dir", default=None, help="random model directory (default: /tmp/sluice-random-<preset>)")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--dtype", default=None)
    p.add_argument("--backends", default="triton,torch")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--tie-tol", type=float, default=1e-3)
    p.add_argument("--kv-cache-memory", default="2G")
    p.add_argument("--ready-timeout", type=float, default=180)
    p.add_argument("--log-dir", default=None, help="server logs (default: next to the model)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the figures as JSON")
    args = p.parse_args()
    dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")  # the engine's default per device

    model_dir = Path(args.model_dir or f"/tmp/sluice-random-{args.preset}")
    gen_device = "cpu" if args.device == "cpu" else "auto"
    t0 = time.perf_counter()
    random_model.create(model_dir, args.preset, device=gen_device)
    print(f"model {model_dir} ready in {time.perf_counter() - t0:.1f}s", flush=True)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    lengths = [5, 32, 97, 300, 17, 64, 150, 8][: args.prompts]
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]
    log_dir = Path(args.log_dir) if args.log_dir else model_dir
    log_dir.mkdir(parents=True, exist_ok=True)

    runs, figures = {}, {}
    for backend in args.backends.split(","):
        t0 = time.perf_counter()
        proc, url = serve(model_dir, backend, args, log_dir / f"serve-{backend}.log")
        up = time.perf_counter() - t0
        try:
            t1 = time.perf_counter()
            runs[backend] = completions(url, prompts, args.max_tokens)
            first = time.perf_counter() - t1
            t1 = time.perf_counter()
            completions(url, prompts, args.max_tokens)  # the same request again, warm: the timed one
            warm = time.perf_counter() - t1
            n_tok = sum(len(ids) for ids, _, _ in runs[backend])
            figures[backend] = {"ready_s": up, "first_request_s": first, "request_s": warm, "tokens": n_tok,
                                "tok_per_s": n_tok / warm}
            print(f"{backend}: ready in {up:.1f}s, {len(prompts)} completions in {first:.2f}s (again: {warm:.2f}s, "
                  f"{n_tok / warm:.0f} tok/s); first tokens {[ids[:6] for ids, _, _ in runs[backend]]}", flush=True)
        finally:
            stop(proc)
    names = list(runs)
    ok, notes, max_d = compare(runs[names[0]], runs[names[1]], args.tie_tol, DTYPE_EPS.get(dtype, 0.0))
    n_tok = sum(len(ids) for ids, _, _ in runs[names[0]])
    distinct = len({t for ids, _, _ in runs[names[0]] for t in ids})
    print(f"{names[0]} vs {names[1]} ({dtype}): {n_tok} tokens, {distinct} distinct, max |dlogprob| before any "
          f"divergence {max_d:.2e}")
    for n in notes:
        print("  " + n)
    print("OK" if ok else "FAILED")
    if args.json:
        Path(args.json).write_text(json.dumps({"dtype": dtype, "backends": figures, "ok": ok, "notes": notes,
                                               "max_dlogprob": max_d}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
