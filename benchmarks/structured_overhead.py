"""What a JSON-schema constraint costs per output token: TPOT with and without it, same engine.

    .venv/bin/python benchmarks/structured_overhead.py                    # batch 1 and 4, 9 rounds
    .venv/bin/python benchmarks/structured_overhead.py --rounds 3 --batch-sizes 1   # quick
    python benchmarks/structured_overhead.py --model /dev/shm/llama8b-bytes --batch-sizes 1 32 --rounds 3 \
        --kv-cache-memory 2G --json out.json      # a GPU: a random model with a byte-level tokenizer
        # (benchmarks/random_model.py --tokenizer bytes; the GPU check's features part)

Workload (fixed, spelled out here): the bundled SmolLM2-135M-Instruct, offline engine (no HTTP), greedy,
`ignore_eos`, `max_tokens` OUTPUT_TOKENS, so every request generates exactly that many tokens. The same
chat prompts with and without `response_format` = SCHEMA below, whose `minItems` keeps the grammar
open for longer than OUTPUT_TOKENS: every step of every constrained request fills and applies a mask
(no step takes the cheap "grammar finished" path). The grammar is compiled before timing starts.

The machine is shared and noisy, so runs are interleaved (plain, constrained, constrained, plain, ...)
and each figure is a median over rounds of a per-run number:
- TPOT: the batch's mean of (time between a request's first and last token) / (tokens - 1);
- ITL p50: the median gap between consecutive steps' tokens, which a burst of load from other processes
  moves far less than the mean;
- mask ms/step: the time spent in the grammar itself per step (filling and applying the batch's masks,
  advancing the matchers), measured inside the engine: the overhead without the noise of the forward.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from sluice_engine.entrypoints.llm import LLM
from sluice_engine.sampling_params import SamplingParams
from sluice_engine.structured import GrammarConstraint, StructuredOutputs, grammar_spec

OUTPUT_TOKENS = 64
PROMPTS = [
    "List the items in a small grocery order as JSON.",
    "Give me an inventory of a bookshop's shelf as JSON.",
    "Write the parts list of a bicycle as JSON.",
    "Describe the contents of a toolbox as JSON.",
    "Catalogue a few animals in a zoo as JSON.",
    "List some planets with their moons as JSON.",
    "Give a restaurant menu as JSON.",
    "List the songs on an album as JSON.",
]
SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "minItems": 40, "items": {
    "type": "object", "properties": {
        "name": {"type": "string", "maxLength": 24},
        "quantity": {"type": "integer", "minimum": 0, "maximum": 1000},
        "category": {"enum": ["food", "tool", "book", "other"]},
        "in_stock": {"type": "boolean"}},
    "required": ["name", "quantity", "category", "in_stock"]}}}, "required": ["items"]}


class _Timer:
    """Wraps GrammarConstraint's engine-side methods to add up the time spent in them."""

    def __init__(self):
        self.seconds = 0.0
        for name in ("apply_batch", "accept"):
            orig = getattr(GrammarConstraint, name)
            wrapped = self._wrap(orig.__func__, classmethod) if name == "apply_batch" else self._wrap(orig, None)
            setattr(GrammarConstraint, name, wrapped)

    def _wrap(self, fn, kind):
        timer = self

        def timed(*args, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                timer.seconds += time.perf_counter() - t0

        return kind(timed) if kind else timed


def run_batch(llm: LLM, structured: StructuredOutputs, compiled, batch: int,
              timer: _Timer, tokens: dict[str, list[int]] | None = None) -> tuple[float, float, float]:
    """One batch of `batch` requests; returns (mean TPOT, median ITL, grammar time per step), in ms. tokens: filled
    with each request's output ids."""
    params = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0, ignore_eos=True)
    stamps: dict[str, list[float]] = {}
    for i in range(batch):
        ids = llm.tokenizer.encode_chat([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}])
        rid = f"b{time.monotonic_ns()}-{i}"
        procs = [structured.constraint(compiled)] if compiled is not None else None
        llm.engine.add_request(rid, ids, params, logits_processors=procs)
        stamps[rid] = []
    steps = 0
    timer.seconds = 0.0
    while llm.engine.has_unfinished():
        outs = llm.engine.step()
        steps += 1
        now = time.perf_counter()
        for o in outs:
            stamps[o.request_id].extend([now] * len(o.new_token_ids))
            if tokens is not None:
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    tpots = [(s[-1] - s[0]) / (len(s) - 1) for s in stamps.values()]
    gaps = [b - a for s in stamps.values() for a, b in zip(s, s[1:], strict=False)]
    assert all(len(s) == OUTPUT_TOKENS for s in stamps.values())
    return statistics.mean(tpots) * 1e3, statistics.median(gaps) * 1e3, timer.seconds / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--model", default=None, help="an HF directory (default: the bundled model); its tokenizer must "
                                                   "spell JSON (random_model.py --tokenizer bytes does)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--kv-cache-memory", default="256MiB")
    ap.add_argument("--json", help="write the medians here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from sluice_engine.config import parse_size

    llm = LLM(args.model, kv_cache_memory=parse_size(args.kv_cache_memory), seed=0, device=args.device,
              max_num_seqs=max(args.batch_sizes))
    eng = llm.engine
    structured = StructuredOutputs(eng.tokenizer, eng.runner.model_config.vocab_size, eng.eos_token_ids)

    class _Req:
        response_format = {"type": "json_schema", "json_schema": {"name": "inventory", "schema": SCHEMA}}

    compiled = structured.compile_sync(grammar_spec(_Req()))
    timer = _Timer()
    constrained: dict[str, list[int]] = {}
    run_batch(llm, structured, compiled, 1, timer, constrained)  # warm-up: allocator, first-step costs
    run_batch(llm, structured, None, 1, timer)
    # The constraint held (on a GPU the mask is applied there): the output opens the schema's object.
    text = llm.tokenizer.decode(next(iter(constrained.values())))
    if not text.lstrip().startswith("{"):
        raise SystemExit(f"the constrained output does not open a JSON object: {text[:80]!r}")

    rows = []
    for batch in args.batch_sizes:
        results: dict[str, list[tuple[float, float, float]]] = {"plain": [], "json_schema": []}
        for r in range(args.rounds):
            order = ("plain", "json_schema") if r % 2 == 0 else ("json_schema", "plain")
            for mode in order:
                results[mode].append(run_batch(llm, structured, compiled if mode == "json_schema" else None,
                                               batch, timer))
        med = {mode: [statistics.median(x[k] for x in runs) for k in range(3)] for mode, runs in results.items()}
        rows.append((batch, med["plain"], med["json_schema"]))
        print(json.dumps({"batch": batch, **{f"{mode}_tpot_itl_mask_ms": [[round(v, 3) for v in x] for x in runs]
                                             for mode, runs in results.items()}}))

    print(f"\n{OUTPUT_TOKENS} output tokens/request, {args.rounds} rounds, medians; torch threads {args.threads}\n")
    print("| batch | TPOT plain | TPOT json_schema | diff | ITL p50 plain | ITL p50 json_schema | diff "
          "| mask ms/step | mask / TPOT |")
    print("|---|---|---|---|---|---|---|---|---|")
    for batch, (tp, ip, _), (tc, ic, mask) in rows:
        print(f"| {batch} | {tp:.1f} ms | {tc:.1f} ms | {(tc / tp - 1) * 100:+.1f}% | {ip:.1f} ms | {ic:.1f} ms "
              f"| {(ic / ip - 1) * 100:+.1f}% | {mask:.3f} | {mask / tc * 100:.2f}% |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": [{"batch": b, "tpot_plain_ms": tp, "tpot_json_ms": tc, "itl_plain_ms": ip,
                                 "itl_json_ms": ic, "mask_ms_per_step": mask} for b, (tp, ip, _), (tc, ic, mask) in rows]},
                      f, indent=1)


if __name__ == "__main__":
    main()
