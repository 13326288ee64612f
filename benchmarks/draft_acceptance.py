"""Draft-model speculation: acceptance of layer-truncated drafts of the bundled model, and a check that
outputs are unchanged. The first N layers of SmolLM2-135M (of 30) stand in for a small sibling model,
which this machine does not have.

    .venv/bin/python benchmarks/draft_acceptance.py                  # layers 30 (itself), 24, 16, 8; ~1 min
    .venv/bin/python benchmarks/draft_acceptance.py --layers 24 12 --max-tokens 64

Workload: 4 chat prompts (an echo, a poem, arithmetic, a list), greedy, --max-tokens each, all four
concurrent, K = --num-speculative-tokens.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from sluice_engine.entrypoints.llm import LLM
from sluice_engine.model_fetch import resolve_model
from sluice_engine.sampling_params import SamplingParams
from sluice_engine.spec_decode.layer_draft import write_layer_draft

PROMPTS = ["Repeat exactly: The quick brown fox jumps over the lazy dog near the quiet river bank.",
           "Write a short poem about the sea.", "What is 2+2? Explain.", "List three colors."]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, nargs="+", default=[30, 24, 16, 8])
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    args = ap.parse_args()
    target = resolve_model(None)
    off = LLM(str(target), kv_cache_memory=64 << 20)
    encoded = [off.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    want = [c.token_ids for c in off.generate(encoded, params)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.layers:
            draft = write_layer_draft(target, Path(tmp) / f"layers-{n}", n)
            on = LLM(str(target), kv_cache_memory=64 << 20, draft_model=str(draft),
                     num_speculative_tokens=args.num_speculative_tokens)
            same = [c.token_ids for c in on.generate(encoded, params)] == want
            st = on.engine.stats
            rows.append((n, st.spec_accepted_tokens, st.spec_draft_tokens, st.spec_accepted_per_pos,
                         st.spec_drafted_per_pos, same))
    print("\n| draft layers | accepted / drafted | accepted by position | drafted by position | output unchanged |")
    print("|---:|---:|---|---|---|")
    for n, acc, drafted, acc_pos, dr_pos, same in rows:
        rate = f"{100 * acc / drafted:.0f}%" if drafted else "-"
        print(f"| {n} | {acc} / {drafted} ({rate}) | {', '.join(map(str, acc_pos))} | "
              f"{', '.join(map(str, dr_pos))} | {'yes' if same else 'NO'} |")


if __name__ == "__main__":
    main()
