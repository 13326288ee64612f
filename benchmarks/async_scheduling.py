"""Issue 25's async-scheduling check, in one sitting: the same engine with steps one at a time
(`--no-async-scheduling`) and with the next step scheduled while this one computes, loaded with the same batch
of requests, alternating, `--reps` times each. Prints per batch size, medians over the reps:

- ms per step and output tok/s;
- the host's work per step (schedule + prepare + outputs, ms), the share of it that ran while a forward
  was computing (0 by construction when steps run one at a time), and the host's work left on the step's
  critical path ("crit"): one at a time, all of it plus the sampling; async, the time the step thread waited
  for the engine's thread (the next step not queued yet, or the step before's outputs not applied yet);
- whether both modes gave the same tokens (greedy, seeded sampling; with --spec, ngram speculative decoding;
  with --grammar, a JSON schema).

    .venv/bin/python benchmarks/async_scheduling.py                        # the bundled model on CPU, ~3 min
    .venv/bin/python benchmarks/async_scheduling.py --model /tmp/llama8b --batch 64 --kv-cache-memory 2G   # a GPU

On CPU the step thread runs the forward itself (torch releases the GIL in its kernels) while the engine's thread
schedules and applies outputs. On a GPU the forward's span is its launch (the host's view): the hidden share is
of the host's work that ran while the step thread was queueing a forward, a lower bound of what the device
hides.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from sluice_engine.entrypoints.llm import LLM
from sluice_engine.sampling_params import SamplingParams
from sluice_engine.step_timeline import StepTimeline

PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,", "Once upon a time",
           "Explain what a KV cache is.", "List three prime numbers:", "def fibonacci(n):", "Translate 'cat' to French:"]


def run(llm: LLM, prompts: list[str], params: SamplingParams) -> tuple[float, int, list[list[int]], dict]:
    eng = llm.engine
    timeline = StepTimeline()
    eng.set_timeline(timeline)
    steps0 = eng.stats.steps
    t = time.perf_counter()
    out = llm.generate(prompts, params)
    wall = time.perf_counter() - t
    eng.set_timeline(None)
    steps = eng.stats.steps - steps0
    return wall, steps, [c.token_ids for c in out], timeline.report(steps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    p.add_argument("--batch", default="1,8,32", help="requests per run (all sent at once)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--spec", action="store_true", help="also check ngram speculative decoding gives the same tokens")
    p.add_argument("--grammar", action="store_true", help="also check a JSON-schema request gives the same tokens")
    p.add_argument("--device", default="auto")
    p.add_argument("--kv-cache-memory", default=None, help="per engine (both are loaded at once), e.g. 2G")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    kw = dict(max_num_seqs=max(batches), device=args.device)
    if args.kv_cache_memory:
        units = {"K": 2**10, "M": 2**20, "G": 2**30}
        v = args.kv_cache_memory
        kw["kv_cache_memory"] = int(float(v[:-1]) * units[v[-1]]) if v[-1] in units else int(v)
    figures: dict = {"batches": {}}
    llms = {mode: LLM(args.model, async_scheduling=mode, **kw) for mode in (False, True)}
    for llm in llms.values():
        llm.engine.warm_up()
    assert llms[True].engine.async_scheduling
    print(f"# {os.uname().machine}, {os.cpu_count()} cores, model {args.model or 'bundled SmolLM2-135M'}, "
          f"{args.max_tokens} tokens per request, median of {args.reps}")
    print(f"{'batch':>5} {'mode':>5} {'ms/step':>8} {'tok/s':>8} {'host ms':>8} {'sched':>6} {'prep':>6} "
          f"{'outs':>6} {'fwd ms':>7} {'hidden':>7} {'crit ms':>8}")
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    for b in batches:
        prompts = [PROMPTS[i % len(PROMPTS)] + f" ({i})" for i in range(b)]
        rows: dict[bool, list] = {False: [], True: []}
        tokens: dict[bool, list] = {}
        for _ in range(args.reps):
            for mode, llm in llms.items():
                wall, steps, toks, rep = run(llm, prompts, greedy)
                rows[mode].append((wall, steps, rep))
                tokens[mode] = toks
        figures["batches"][b] = {"same_greedy": tokens[False] == tokens[True]}
        for mode in (False, True):
            runs = rows[mode]

            def med(f, runs=runs):
                return statistics.median(f(r) for r in runs)

            wall = med(lambda r: r[0])
            steps = med(lambda r: r[1])
            figures["batches"][b]["async" if mode else "sync"] = {
                "ms_per_step": 1e3 * wall / steps, "tok_per_s": b * args.max_tokens / wall,
                **{k: med(lambda r, k=k: r[2][k]) for k in ("host_ms", "schedule_ms", "prepare_ms", "outputs_ms",
                                                            "forward_ms", "sample_ms", "hidden_share", "critical_ms")}}
            print(f"{b:>5} {'async' if mode else 'sync':>5} {1e3 * wall / steps:8.1f} "
                  f"{b * args.max_tokens / wall:8.1f} {med(lambda r: r[2]['host_ms']):8.2f} "
                  f"{med(lambda r: r[2]['schedule_ms']):6.2f} {med(lambda r: r[2]['prepare_ms']):6.2f} "
                  f"{med(lambda r: r[2]['outputs_ms']):6.2f} {med(lambda r: r[2]['forward_ms']):7.1f} "
                  f"{med(lambda r: r[2]['hidden_share']):7.0%} {med(lambda r: r[2]['critical_ms']):8.2f}")
        print(f"{b:>5} same greedy tokens: {tokens[False] == tokens[True]}")
    # Exactness beyond greedy: seeded sampling (and, when asked, speculative decoding and a grammar).
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(8)]
    seeded = SamplingParams(max_tokens=args.max_tokens, temperature=0.9, top_p=0.95, seed=7)
    same = {m: run(llm, prompts, seeded)[2] for m, llm in llms.items()}
    print(f"same seeded-sampling tokens: {same[False] == same[True]}")
    figures["same_seeded"] = same[False] == same[True]
    if args.grammar:
        schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                  "required": ["name", "age"]}
        from sluice_engine.structured import StructuredOutputs
        from sluice_engine.structured.grammar import GrammarSpec

        outs = {}
        for m, llm in llms.items():
            eng = llm.engine
            so = StructuredOutputs(eng.tokenizer, eng.model_info.vocab_size, eng.model_info.eos_token_ids)
            compiled = so.compiled_now(GrammarSpec("json_schema", json.dumps(schema), "guided_json"))
            ids = []
            for i, text in enumerate(prompts):
                rid = f"g{i}"
                eng.add_request(rid, eng.tokenizer.encode(text), SamplingParams(max_tokens=48, temperature=0),
                                [so.constraint(compiled)])
                ids.append(rid)
            got: dict[str, list[int]] = {r: [] for r in ids}
            while eng.has_unfinished():
                for o in eng.step():
                    got[o.request_id].extend(o.new_token_ids)
            outs[m] = [got[r] for r in ids]
        print(f"same grammar tokens: {outs[False] == outs[True]}")
        figures["same_grammar"] = outs[False] == outs[True]
    for llm in llms.values():
        llm.engine.shutdown()
    if args.spec:
        spec = {m: LLM(args.model, async_scheduling=m, speculative_method="ngram", **kw) for m in (False, True)}
        rep = "Repeat after me: the cat sat on the mat, the cat sat on the mat, the cat sat on the mat,"
        outs = {m: [c.token_ids for c in llm.generate([rep] * 4 + prompts[:4], greedy)] for m, llm in spec.items()}
        print(f"same ngram speculative-decoding tokens: {outs[False] == outs[True]}")
        figures["same_spec"] = outs[False] == outs[True]
        for llm in spec.values():
            llm.engine.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)
    same = [v["same_greedy"] for v in figures["batches"].values()]
    same += [v for k, v in figures.items() if k.startswith("same_")]
    if not all(same):
        raise SystemExit("async scheduling changed the tokens")


if __name__ == "__main__":
    main()
