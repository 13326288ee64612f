"""Numerical parity of `sluice serve --quantization q4_1` with llama.cpp's `llama-server` on the bundled
model's own GGUF (SmolLM2-135M-Instruct, Q4_1 decoder linears, Q8_0 tied embedding/output), on CPU.
Issue 16's acceptance item: greedy outputs identical for >= 16 of 20 prompts, perplexity within 2%.

    .venv/bin/python benchmarks/llama_cpp_parity.py                      # ~5-10 min on 2 shared cores
    .venv/bin/python benchmarks/llama_cpp_parity.py --json bench-results/parity.json
    .venv/bin/python benchmarks/llama_cpp_parity.py --skip-perplexity    # greedy parity only
    .venv/bin/python benchmarks/llama_cpp_parity.py --noise-floor        # + the two reference checks below

Needs llama.cpp's `llama-server` and `llama-perplexity` (scripts/get-llama-server.sh builds them into
.tools/bin). Both are run with --no-repack: on AMX CPUs llama.cpp's repacked AMX path crashes on
quantized GGUFs when built with GCC 12.

What it measures
- Greedy parity. Both servers run at once (llama-server --threads 2 --parallel 1 --ctx-size 4096;
  sluice with OMP_NUM_THREADS=2). 20 fixed prompts (PROMPTS: prose, code, lists, questions, and chat
  turns rendered with the model's chat template) are tokenized ONCE, by llama.cpp (/tokenize), and both
  servers get that same list of token ids as the OpenAI `prompt`, so tokenization can never count as an
  output difference (the script also reports whether sluice's own tokenizer and chat template would
  have produced the same ids). Each is asked through the `openai` client's completions.create for
  max_tokens=32 at temperature 0 with logprobs=2, and the generated token ids are compared: identical,
  or the first differing position, the two tokens there, and each server's top-1 minus top-2 logprob
  at that position (its margin: how close the argmax was to flipping; the prefixes agree up to there,
  so both distributions condition on the same context). Exit status 1 below 16/20.
  EOS: allowed on both (generation may stop before 32 tokens), rather than ignore_eos, because the two
  servers define ignore_eos differently: llama.cpp masks the end-of-generation tokens (a -inf logit
  bias, so greedy picks the runner-up), sluice (vLLM's meaning) still emits them and just does not
  stop. With EOS allowed both stop at the same tokens: llama.cpp stops at its EOG set for this vocab,
  {0 <|endoftext|>, 2 <|im_end|>}; sluice stops at eos_token_id 2, and gets stop_token_ids [0] so the
  sets agree. The stop token itself is part of the compared sequence.
  Fairness: no prefix reuse on either side (llama.cpp cache_prompt false, sluice --no-prefix-caching),
  so every prompt is computed from scratch whatever ran before it; logprobs are the raw (pre-sampling)
  distribution on both (llama.cpp's post_sampling_probs is off by default; sluice's are raw).
  The same 20 prompts also run on sluice fp32 (--quantization none: the GGUF dequantized once at
  conversion) for reference; only q4_1 gates.
  --noise-floor adds two reference comparisons (not gated) that say how much of a q4_1 difference is
  llama.cpp's own rounding: llama-server with flash attention off against llama-server as above (the
  same GGUF and weights, llama.cpp against itself), and llama-server on the GGUF dequantized to F32
  (llama-quantize --allow-requantize ... F32: bit-identical to sluice fp32's weights) against sluice
  fp32. llama.cpp multiplies Q4_1/Q8_0 weights by activations it first rounds to 8-bit blocks (Q8_1 /
  Q8_0, scales in fp16), and that rounding flips near-ties; on the F32 file it computes in fp32 as
  sluice does. It also runs llama-perplexity on that F32 file: with the same fp32 math on both sides
  it should equal sluice fp32's perplexity, which checks this script's scoring against llama.cpp's.
- Perplexity of benchmarks/data/perplexity.txt (original prose written for this check), scored
  exactly as `llama-perplexity -f FILE -c 512 -b 512` scores it (tools/perplexity/perplexity.cpp): the
  file, less one trailing newline, tokenized once with add_special (this vocab adds no BOS; with one
  that did, each chunk's first token would be replaced by BOS); floor(n_tokens / 512) disjoint chunks
  of 512 tokens, each evaluated from an empty cache; in each, only the second half is scored: the
  logits at positions 256..510 predicting tokens 257..511 (255 per chunk); PPL = exp(mean NLL). The
  token ids come from llama-server's /tokenize (the same llama.cpp tokenizer; the chunk count
  llama-perplexity prints is checked against them); sluice gets each chunk as a token-id prompt with
  echo=True, logprobs=0, max_tokens=1, whose token_logprobs are log P(token j | tokens < j). Sluice q4_1
  and sluice fp32 are both scored; the gate is sluice-q4_1 / llama.cpp-q4_1 within 2%.

Plain HTTP is used only for llama.cpp-specific endpoints: /health, /tokenize, /apply-template (its
chat template rendering, compared with sluice's). Everything generated goes through the openai client;
llama.cpp's `cache_prompt` rides in extra_body. If llama.cpp's OpenAI logprobs ever leave out a token
(it omits entries for tokens that end inside a UTF-8 character), that prompt is re-asked on its native
/completion with return_tokens, which lists every generated id.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path

from server_process import Server, free_port

REPO = Path(__file__).resolve().parents[1]
TOOLS_BIN = REPO / ".tools" / "bin"
PPL_TEXT = REPO / "benchmarks" / "data" / "perplexity.txt"

THREADS = 2
MAX_TOKENS = 32
TOP = 2  # logprobs per position: top-1 and top-2, for the margin
PASS_COUNT = 16  # of 20: the acceptance bar
PPL_TOLERANCE = 0.02
PPL_CTX = 512  # llama-perplexity -c 512 -b 512
LLAMA_EOG_EXTRA = [0]  # <|endoftext|>: end-of-generation to llama.cpp, not sluice's eos_token_id (2)

# -- prompts ----------------------------------------------------------------------------------------
# ("text", s): a raw completion prompt; ("chat", messages): rendered with the model's chat template
# (generation prompt added).
PROMPTS: list[tuple[str, object]] = [
    ("text", "The history of the printing press begins in the fifteenth century, when"),
    ("text", "Once upon a time, in a small village by the sea, there lived"),
    ("text", 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'),
    ("text", "#include <stdio.h>\n\nint main(void) {\n"),
    ("text", "Ingredients for a simple pancake batter:\n1."),
    ("text", "Q: What is the capital of France?\nA:"),
    ("chat", [{"role": "user", "content": "Explain photosynthesis in simple terms."}]),
    ("chat", [{"role": "user", "content": "Write a short poem about autumn leaves."}]),
    ("chat", [{"role": "user", "content": "Give me three tips for learning a new language."}]),
    ("chat", [{"role": "system", "content": "You are a concise assistant that answers in one sentence."},
              {"role": "user", "content": "Why is the sky blue?"}]),
    ("text", "SELECT customer_id, COUNT(*) AS order_count\nFROM orders\n"),
    ("text", '{"name": "Alice", "age": 30, "hobbies": ['),
    ("text", "To solve the equation 2x + 3 = 11, we first"),
    ("text", "Dear Sir or Madam,\n\nI am writing to"),
    ("text", "Mount Everest is the highest mountain above sea level. It is located in"),
    ("text", "How to change a flat tire:\nStep 1:"),
    ("text", "# Project Title\n\nA short description of"),
    ("text", '"Where are you going?" asked the old man, leaning on his stick.'),
    ("chat", [{"role": "user", "content": "What are the benefits of regular exercise?"}]),
    ("text", "class Stack:\n    def __init__(self):\n"),
]


# -- pure parts (tests/engine/test_llama_cpp_parity.py) ------------------------------------------------------
def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where the two token sequences differ (a position one of them lacks
    counts), or None when they are identical."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def margin(top: list[float] | None) -> float | None:
    """Top-1 minus top-2 logprob of one position's top list (any order), or None without two entries."""
    if not top or len(top) < 2:
        return None
    first, second = sorted(top, reverse=True)[:2]
    return first - second


def perplexity_chunks(tokens: list[int], n_ctx: int, bos: int | None = None) -> list[list[int]]:
    """llama-perplexity's chunks: floor(len / n_ctx) disjoint windows of n_ctx tokens (it refuses a text
    of fewer than 2 * n_ctx tokens); with a vocab that adds BOS (`bos` given), each window's first token
    is replaced by BOS, as perplexity.cpp does for the first batch of each chunk."""
    if len(tokens) < 2 * n_ctx:
        raise ValueError(f"perplexity needs at least {2 * n_ctx} tokens for n_ctx {n_ctx}, got {len(tokens)}")
    chunks = [list(tokens[i * n_ctx:(i + 1) * n_ctx]) for i in range(len(tokens) // n_ctx)]
    if bos is not None:
        for c in chunks:
            c[0] = bos
    return chunks


def chunk_nll(token_logprobs: list[float | None], n_ctx: int) -> tuple[float, int]:
    """(sum of negative log-likelihoods, count) that llama-perplexity adds for one chunk.
    token_logprobs[j] = log P(token j | tokens < j) for the chunk's n_ctx tokens ([0] is None: nothing
    predicts it). Scored: the logits at positions first .. n_ctx - 2 (first = n_ctx / 2) predicting
    tokens first + 1 .. n_ctx - 1, i.e. n_ctx - first - 1 tokens."""
    if len(token_logprobs) < n_ctx:
        raise ValueError(f"{len(token_logprobs)} logprobs for a chunk of {n_ctx} tokens")
    first = n_ctx // 2
    scored = token_logprobs[first + 1:n_ctx]
    if any(lp is None for lp in scored):
        raise ValueError("a scored position has no logprob")
    return -math.fsum(scored), n_ctx - first - 1


def perplexity(chunks_logprobs: list[list[float | None]], n_ctx: int) -> float:
    """exp(mean NLL) over every chunk's scored tokens, as llama-perplexity's final estimate."""
    total, count = 0.0, 0
    for lps in chunks_logprobs:
        nll, n = chunk_nll(lps, n_ctx)
        total += nll
        count += n
    return math.exp(total / count)


def parse_llama_perplexity(output: str) -> tuple[float, int]:
    """(final PPL, chunk count) from llama-perplexity's output."""
    m = re.search(r"Final estimate: PPL = ([0-9.]+)", output)
    c = re.search(r"calculating perplexity over (\d+) chunks", output)
    if not m or not c:
        raise RuntimeError(f"no final estimate in llama-perplexity's output:\n{output[-3000:]}")
    return float(m.group(1)), int(c.group(1))


# -- results ------------------------------------------------------------------------------------------
@dataclass
class Generation:
    ids: list[int]
    top: list[dict[int, float] | None]  # per generated position: {token id: logprob} of the top-2
    finish_reason: str | None


@dataclass
class PromptResult:
    index: int
    kind: str
    prompt: str  # shortened, for the table
    prompt_tokens: int
    identical: bool
    llama_ids: list[int]
    sluice_ids: list[int]
    diff_pos: int | None = None
    llama_token: int | None = None
    sluice_token: int | None = None
    llama_margin: float | None = None
    sluice_margin: float | None = None
    note: str = ""
    # the largest |difference| of the chosen token's logprob between the two, over the positions before
    # the first difference (how close the two distributions are where the outputs agree)
    max_top1_delta: float | None = None


@dataclass
class Report:
    cpu: str
    gguf: str
    commands: dict[str, str] = field(default_factory=dict)
    tokenization: dict = field(default_factory=dict)
    parity_q4_1: list[PromptResult] = field(default_factory=list)
    parity_fp32: list[PromptResult] = field(default_factory=list)
    identical_q4_1: int = 0
    identical_fp32: int = 0
    # --noise-floor: llama.cpp against itself (flash attention off), and llama.cpp on the GGUF
    # dequantized to F32 against sluice fp32
    noise_floor: dict = field(default_factory=dict)
    perplexity: dict = field(default_factory=dict)
    passed: dict = field(default_factory=dict)


# -- servers ---------------------------------------------------------------------------------------
def start_llama_server(bin_dir: Path, gguf: Path, log_dir: Path, extra: tuple[str, ...] = (),
                       tag: str = "") -> Server:
    port = free_port()
    cmd = [str(bin_dir / "llama-server"), "-m", str(gguf), "--no-repack", "--threads", str(THREADS),
           "--ctx-size", "4096", "--parallel", "1", "--host", "127.0.0.1", "--port", str(port), *extra]
    return Server(f"llama-server{tag}", cmd, dict(os.environ), log_dir / f"llama-server{tag}.log",
                  f"http://127.0.0.1:{port}", "/health")


def dequantized_gguf(bin_dir: Path, gguf: Path, out: Path) -> Path:
    """The GGUF with every tensor dequantized to F32 (llama-quantize --allow-requantize ... F32): the
    same weights sluice fp32 serves (the GGUF dequantized at load), for llama.cpp to run
    without its int8 activation path."""
    cmd = [str(bin_dir / "llama-quantize"), "--allow-requantize", str(gguf), str(out), "F32"]
    print(f"running: {shlex.join(cmd)}", flush=True)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        raise RuntimeError(f"llama-quantize exited with {p.returncode}:\n{(p.stdout + p.stderr)[-3000:]}")
    return out


def start_sluice(quantization: str, log_dir: Path, numerics: str = "exact") -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "sluice_engine.entrypoints.cli", "serve", "--quantization", quantization,
           "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", "--no-prefix-caching"]
    if quantization != "none":
        cmd += ["--numerics", numerics]
    env = {**os.environ, "OMP_NUM_THREADS": str(THREADS), "MKL_NUM_THREADS": str(THREADS)}
    return Server(f"sluice serve ({quantization})", cmd, env, log_dir / f"sluice-{quantization}.log",
                  f"http://127.0.0.1:{port}", "/ready")


def openai_client(url: str):
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key="x", timeout=900, max_retries=0)


def served_model(client) -> str:
    return client.models.list().data[0].id


# -- tokenization (llama.cpp's ids are the ones sent) ------------------------------------------------
def llama_tokenize(url: str, text: str, add_special: bool, parse_special: bool) -> list[int]:
    import httpx

    r = httpx.post(url + "/tokenize", json={"content": text, "add_special": add_special,
                                            "parse_special": parse_special}, timeout=120)
    r.raise_for_status()
    return r.json()["tokens"]


def llama_apply_template(url: str, messages: list[dict]) -> str | None:
    import httpx

    r = httpx.post(url + "/apply-template", json={"messages": messages}, timeout=60)
    return r.json().get("prompt") if r.status_code == 200 else None


def prepare_prompts(llama_url: str, tokenizer) -> tuple[list[tuple[str, str, list[int]]], dict]:
    """[(kind, prompt text, llama.cpp's token ids)], and how sluice's tokenizer/template compare."""
    out, notes = [], {"token_mismatches": [], "template_mismatches": []}
    for i, (kind, p) in enumerate(PROMPTS):
        if kind == "chat":
            text = tokenizer.apply_chat_template(p, add_generation_prompt=True)  # what sluice's chat API renders
            theirs = llama_apply_template(llama_url, p)
            if theirs != text:
                notes["template_mismatches"].append({"prompt": i, "sluice": text, "llama.cpp": theirs})
            ours = tokenizer.encode(text, add_special_tokens=False)
        else:
            text = p
            ours = tokenizer.encode(text)  # what sluice's /v1/completions does with a string prompt
        ids = llama_tokenize(llama_url, text, add_special=True, parse_special=True)  # as llama-server's string prompts
        if ids != ours:
            notes["token_mismatches"].append({"prompt": i, "llama.cpp": ids, "sluice": ours})
        out.append((kind, text, ids))
    return out, notes


# -- generation --------------------------------------------------------------------------------------
def _top_dict(entries) -> dict[int, float]:
    return {int(e["id"]): float(e["logprob"]) for e in entries}


def llama_generate(client, url: str, ids: list[int]) -> Generation:
    r = client.completions.create(model="gguf", prompt=ids, max_tokens=MAX_TOKENS, temperature=0, logprobs=TOP,
                                  extra_body={"cache_prompt": False})
    ch = r.choices[0]
    content = (ch.logprobs.model_extra or {}).get("content") or [] if ch.logprobs else []
    if len(content) == r.usage.completion_tokens:
        return Generation([int(e["id"]) for e in content], [_top_dict(e["top_logprobs"]) for e in content],
                          ch.finish_reason)
    # Entries missing (tokens ending inside a UTF-8 character): the native endpoint lists every id.
    import httpx

    body = {"prompt": ids, "n_predict": MAX_TOKENS, "temperature": 0, "n_probs": TOP, "return_tokens": True,
            "cache_prompt": False}
    d = httpx.post(url + "/completion", json=body, timeout=900).json()
    toks = [int(t) for t in d["tokens"]]
    probs = d.get("completion_probabilities") or []
    top: list[dict[int, float] | None] = []
    j = 0
    for t in toks:  # the entries are a subsequence of the tokens
        if j < len(probs) and int(probs[j]["id"]) == t:
            top.append(_top_dict(probs[j]["top_logprobs"]))
            j += 1
        else:
            top.append(None)
    return Generation(toks, top, "stop" if d.get("stop_type") in ("eos", "word") else "length")


def sluice_generate(client, model: str, ids: list[int]) -> Generation:
    r = client.completions.create(model=model, prompt=ids, max_tokens=MAX_TOKENS, temperature=0, logprobs=TOP,
                                  extra_body={"return_tokens_as_token_ids": True, "stop_token_ids": LLAMA_EOG_EXTRA})
    ch = r.choices[0]

    def tid(s: str) -> int:
        assert s.startswith("token_id:"), s
        return int(s[len("token_id:"):])

    toks = [tid(t) for t in ch.logprobs.tokens]
    top = [{tid(k): v for k, v in d.items()} if d else None for d in ch.logprobs.top_logprobs]
    return Generation(toks, top, ch.finish_reason)


def compare(index: int, kind: str, text: str, n_prompt: int, a: Generation, b: Generation) -> PromptResult:
    """a: the reference (llama.cpp), b: the one checked. text: what the table shows of the prompt."""
    short = text.replace("\n", "\\n")
    short = short if len(short) <= 48 else short[:45] + "..."
    pos = first_difference(a.ids, b.ids)
    res = PromptResult(index, kind, short, n_prompt, pos is None, a.ids, b.ids)
    shared = [(ta, tb) for ta, tb in zip(a.top[:pos], b.top[:pos], strict=False) if ta and tb]
    if shared:  # the chosen (top-1) token's logprob, which both report, over the positions that agree
        res.max_top1_delta = max(abs(max(ta.values()) - max(tb.values())) for ta, tb in shared)
    if pos is None:
        return res
    res.diff_pos = pos
    res.llama_token = a.ids[pos] if pos < len(a.ids) else None
    res.sluice_token = b.ids[pos] if pos < len(b.ids) else None
    ta = a.top[pos] if pos < len(a.top) else None
    tb = b.top[pos] if pos < len(b.top) else None
    res.llama_margin = margin(list(ta.values()) if ta else None)
    res.sluice_margin = margin(list(tb.values()) if tb else None)
    if ta and tb and set(ta) == set(tb):
        res.note = "same top-2, order swapped"
    elif ta and tb:
        res.note = "top-2 sets differ"
    return res


def generate_all(prompts, gen, label: str) -> list[Generation]:
    """gen(ids) -> Generation for every prompt, in order."""
    out = []
    for i, (_, _, ids) in enumerate(prompts):
        out.append(gen(ids))
        print(f"  [{label}] prompt {i + 1}/{len(prompts)}: {len(out[-1].ids)} tokens", flush=True)
    return out


def compare_all(prompts, ref: list[Generation], other: list[Generation]) -> list[PromptResult]:
    results = []
    for i, ((kind, text, ids), a, b) in enumerate(zip(prompts, ref, other, strict=True)):
        shown = PROMPTS[i][1][-1]["content"] if kind == "chat" else text  # a chat prompt: its last turn
        results.append(compare(i, kind, shown, len(ids), a, b))
    return results


def print_parity(results: list[PromptResult], ref_name: str, name: str, tokenizer, note: str = "") -> int:
    def tok(t: int | None) -> str:
        return "-" if t is None else f"{t} {tokenizer.decode([t], skip_special_tokens=False)!r}"

    def f(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    n = sum(r.identical for r in results)
    print(f"\n### Greedy parity, {name} vs {ref_name}{note}: {n}/{len(results)} identical "
          f"(max_tokens {MAX_TOKENS}, EOS allowed)\n")
    print(f"| # | kind | prompt | prompt tok | gen tok ({ref_name} / {name}) | result | {ref_name} token | {name} token "
          f"| margin {ref_name} | margin {name} | note | max \\|Δ top-1 lp\\| before |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        same = r.identical
        res = "identical" if same else f"differs at {r.diff_pos}"
        print(f"| {r.index} | {r.kind} | `{r.prompt}` | {r.prompt_tokens} | {len(r.llama_ids)}/{len(r.sluice_ids)} "
              f"| {res} | {'' if same else tok(r.llama_token)} | {'' if same else tok(r.sluice_token)} "
              f"| {'' if same else f(r.llama_margin)} | {'' if same else f(r.sluice_margin)} | {r.note} "
              f"| {f(r.max_top1_delta)} |")
    return n


# -- perplexity --------------------------------------------------------------------------------------
def ppl_text() -> str:
    text = PPL_TEXT.read_text()
    return text[:-1] if text.endswith("\n") else text  # llama.cpp's -f drops one trailing newline


def run_llama_perplexity(bin_dir: Path, gguf: Path, log_dir: Path, tag: str = "") -> tuple[float, int, str]:
    cmd = [str(bin_dir / "llama-perplexity"), "-m", str(gguf), "-f", str(PPL_TEXT), "--no-repack",
           "-c", str(PPL_CTX), "-b", str(PPL_CTX), "--threads", str(THREADS)]
    print(f"running: {shlex.join(cmd)}", flush=True)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    (log_dir / f"llama-perplexity{tag}.log").write_text(p.stdout + p.stderr)
    if p.returncode != 0:
        raise RuntimeError(f"llama-perplexity exited with {p.returncode}:\n{(p.stdout + p.stderr)[-3000:]}")
    ppl, n_chunks = parse_llama_perplexity(p.stdout + p.stderr)
    return ppl, n_chunks, shlex.join(cmd)


def sluice_perplexity(client, model: str, chunks: list[list[int]]) -> float:
    lps = []
    for k, chunk in enumerate(chunks):
        r = client.completions.create(model=model, prompt=chunk, max_tokens=1, temperature=0, logprobs=0, echo=True)
        token_lps = r.choices[0].logprobs.token_logprobs[:len(chunk)]  # echo: the prompt's, then the generated one
        lps.append(token_lps)
        print(f"  chunk {k + 1}/{len(chunks)}: running PPL {perplexity(lps, PPL_CTX):.4f}", flush=True)
    return perplexity(lps, PPL_CTX)


# -- main --------------------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--bin-dir", type=Path, default=TOOLS_BIN,
                    help="where llama-server, llama-perplexity and llama-quantize are")
    ap.add_argument("--gguf", type=Path, help="GGUF file (default: the bundled model's)")
    ap.add_argument("--skip-perplexity", action="store_true")
    ap.add_argument("--numerics", choices=("exact", "fast"), default="exact",
                    help="sluice q4_1's GEMM float order (`sluice serve --numerics`): exact is the one gated here")
    ap.add_argument("--skip-fp32", action="store_true", help="no sluice fp32 reference run")
    ap.add_argument("--noise-floor", action="store_true",
                    help="also (not gated): llama-server -fa off vs llama-server (llama.cpp against itself), and "
                         "llama-server on the GGUF dequantized to F32 vs sluice fp32 (~4 min more)")
    ap.add_argument("--log-dir", type=Path, help="server logs (default: a temporary directory)")
    ap.add_argument("--llama-kv", choices=("f16", "f32"), default="f16",
                    help="llama-server's KV cache type (-ctk/-ctv; its default f16, which sluice's q4_1 keeps too, "
                         "computing as llama.cpp does; f32 shows how far another cache type moves it)")
    args = ap.parse_args()
    kv = () if args.llama_kv == "f16" else ("-ctk", args.llama_kv, "-ctv", args.llama_kv)

    from sluice_engine.bench.machine import cpu_name
    from sluice_engine.model_fetch import gguf_source, resolve_model
    from sluice_engine.tokenizer import Tokenizer

    gguf = args.gguf or gguf_source(None)
    model_dir = resolve_model(None)  # the converted bundled model sluice serves (converts once if missing)
    tokenizer = Tokenizer.from_dir(model_dir)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="llama-cpp-parity-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    report = Report(cpu=cpu_name(), gguf=str(gguf))
    print(f"CPU: {report.cpu}\nGGUF: {gguf}\nlogs: {log_dir}", flush=True)
    gens: dict[str, list[Generation]] = {}
    n_chat = sum(k == "chat" for k, _ in PROMPTS)

    def llama_gens(server: Server, label: str) -> list[Generation]:
        client = openai_client(server.url)
        return generate_all(prompts, lambda ids: llama_generate(client, server.url, ids), label)

    def sluice_gens(server: Server, label: str) -> list[Generation]:
        client = openai_client(server.url)
        model = served_model(client)
        return generate_all(prompts, lambda ids: sluice_generate(client, model, ids), label)

    with ExitStack() as stack:
        llama = start_llama_server(args.bin_dir, gguf, log_dir, kv)
        stack.callback(llama.stop)
        sq = start_sluice("q4_1", log_dir, args.numerics)
        stack.callback(sq.stop)
        report.commands["llama-server"] = shlex.join(llama.cmd)
        report.commands["sluice q4_1"] = "OMP_NUM_THREADS=2 " + shlex.join(sq.cmd)
        llama.wait_ready(300)
        sq.wait_ready(900)

        prompts, report.tokenization = prepare_prompts(llama.url, tokenizer)
        tm, pm = report.tokenization["token_mismatches"], report.tokenization["template_mismatches"]
        print(f"tokenization: sluice's tokenizer gives llama.cpp's ids for {len(prompts) - len(tm)}/{len(prompts)} "
              f"prompts; the chat template renders identically for {n_chat - len(pm)}/{n_chat}", flush=True)
        ppl_ids = chunks = None
        if not args.skip_perplexity:
            ppl_ids = llama_tokenize(llama.url, ppl_text(), add_special=True, parse_special=False)
            ours = tokenizer.encode(ppl_text())
            report.tokenization["perplexity_text"] = {
                "llama.cpp_tokens": len(ppl_ids), "sluice_tokens": len(ours), "identical": ours == ppl_ids,
                "first_difference": first_difference(ppl_ids, ours)}
            chunks = perplexity_chunks(ppl_ids, PPL_CTX)

        print("greedy: llama.cpp, then sluice q4_1 ...", flush=True)
        gens["llama"] = llama_gens(llama, "llama.cpp")
        gens["sluice_q4_1"] = sluice_gens(sq, "sluice q4_1")
        llama.stop()  # the rest of the q4_1 work needs only sluice and llama-perplexity

        if chunks is not None:
            print(f"perplexity: {len(ppl_ids)} tokens, {len(chunks)} chunks of {PPL_CTX}; sluice q4_1 ...", flush=True)
            report.perplexity["sluice_q4_1"] = sluice_perplexity(openai_client(sq.url), served_model(openai_client(sq.url)),
                                                                 chunks)
            report.perplexity["tokens"], report.perplexity["chunks"] = len(ppl_ids), len(chunks)
            report.perplexity["scored_tokens"] = len(chunks) * (PPL_CTX - PPL_CTX // 2 - 1)
        sq.stop()

        if chunks is not None:
            ppl, n_chunks, cmd = run_llama_perplexity(args.bin_dir, gguf, log_dir)
            report.commands["llama-perplexity"] = cmd
            if n_chunks != len(chunks):
                raise RuntimeError(f"llama-perplexity scored {n_chunks} chunks, /tokenize's ids make {len(chunks)}: "
                                   "the two tokenizations differ")
            report.perplexity["llama_cpp_q4_1"] = ppl

        if not args.skip_fp32:
            sf = start_sluice("none", log_dir)
            stack.callback(sf.stop)
            report.commands["sluice fp32"] = "OMP_NUM_THREADS=2 " + shlex.join(sf.cmd)
            sf.wait_ready(900)
            print("greedy: sluice fp32 ...", flush=True)
            gens["sluice_fp32"] = sluice_gens(sf, "sluice fp32")
            if chunks is not None:
                print("perplexity: sluice fp32 ...", flush=True)
                report.perplexity["sluice_fp32"] = sluice_perplexity(openai_client(sf.url),
                                                                     served_model(openai_client(sf.url)), chunks)
            sf.stop()

        if args.noise_floor:
            fa = start_llama_server(args.bin_dir, gguf, log_dir, (*kv, "-fa", "off"), "-fa-off")
            stack.callback(fa.stop)
            report.commands["llama-server -fa off"] = shlex.join(fa.cmd)
            fa.wait_ready(300)
            print("greedy: llama.cpp -fa off ...", flush=True)
            gens["llama_fa_off"] = llama_gens(fa, "llama.cpp -fa off")
            fa.stop()
            if "sluice_fp32" in gens:
                f32 = dequantized_gguf(args.bin_dir, gguf, log_dir / "dequantized-f32.gguf")
                lf = start_llama_server(args.bin_dir, f32, log_dir, kv, "-f32")
                stack.callback(lf.stop)
                report.commands["llama-server F32"] = shlex.join(lf.cmd)
                lf.wait_ready(300)
                print("greedy: llama.cpp on the F32 GGUF ...", flush=True)
                gens["llama_f32"] = llama_gens(lf, "llama.cpp F32")
                lf.stop()
                if chunks is not None:  # the same fp32 math: checks this script's scoring against llama-perplexity's
                    report.perplexity["llama_cpp_f32"] = run_llama_perplexity(args.bin_dir, f32, log_dir, "-f32")[0]
                f32.unlink()

    print(f"\nCPU: {report.cpu}")
    report.parity_q4_1 = compare_all(prompts, gens["llama"], gens["sluice_q4_1"])
    report.identical_q4_1 = print_parity(report.parity_q4_1, "llama.cpp", "sluice q4_1", tokenizer)
    if "sluice_fp32" in gens:
        report.parity_fp32 = compare_all(prompts, gens["llama"], gens["sluice_fp32"])
        report.identical_fp32 = print_parity(report.parity_fp32, "llama.cpp", "sluice fp32", tokenizer, " (not gated)")
    for key, ref, other, ref_name, name in (
            ("llama_fa_off_vs_llama", "llama", "llama_fa_off", "llama.cpp", "llama.cpp -fa off"),
            ("sluice_fp32_vs_llama_f32", "llama_f32", "sluice_fp32", "llama.cpp F32 GGUF", "sluice fp32")):
        if ref in gens and other in gens:
            rows = compare_all(prompts, gens[ref], gens[other])
            report.noise_floor[key] = {"identical": print_parity(rows, ref_name, name, tokenizer, " (not gated)"),
                                       "results": [asdict(r) for r in rows]}
    report.passed["parity"] = report.identical_q4_1 >= PASS_COUNT
    print(f"\ngreedy parity q4_1: {report.identical_q4_1}/{len(PROMPTS)} identical (bar {PASS_COUNT}): "
          f"{'PASS' if report.passed['parity'] else 'FAIL'}")
    for key, v in report.noise_floor.items():
        print(f"  for reference, {key}: {v['identical']}/{len(PROMPTS)} identical")
    if report.perplexity:
        p = report.perplexity
        ratio = p["sluice_q4_1"] / p["llama_cpp_q4_1"]
        p["ratio_sluice_q4_1_over_llama_cpp"] = ratio
        report.passed["perplexity"] = abs(ratio - 1) <= PPL_TOLERANCE
        print(f"\n### Perplexity, {PPL_TEXT.relative_to(REPO)}: {p['tokens']} tokens, {p['chunks']} chunks of {PPL_CTX}, "
              f"{p['scored_tokens']} scored\n")
        print("| model | PPL |\n|---|---|")
        print(f"| llama.cpp Q4_1 (llama-perplexity) | {p['llama_cpp_q4_1']:.4f} |")
        print(f"| sluice q4_1 | {p['sluice_q4_1']:.4f} |")
        if "sluice_fp32" in p:
            print(f"| sluice fp32 (the GGUF dequantized) | {p['sluice_fp32']:.4f} |")
        if "llama_cpp_f32" in p:
            print(f"| llama.cpp on the GGUF dequantized to F32 (--noise-floor) | {p['llama_cpp_f32']:.4f} |")
        print(f"\nsluice-q4_1 / llama.cpp-q4_1 = {ratio:.4f} (bar +-{PPL_TOLERANCE:.0%}): "
              f"{'PASS' if report.passed['perplexity'] else 'FAIL'}")
    tk = report.tokenization
    print(f"\ntokenization: {len(tk['token_mismatches'])} prompt(s) where sluice's tokenizer differs from llama.cpp's, "
          f"{len(tk['template_mismatches'])} chat template rendering difference(s); perplexity text: "
          f"{tk.get('perplexity_text')}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(asdict(report), indent=1))
        print(f"wrote {args.json}")
    return 0 if all(report.passed.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
