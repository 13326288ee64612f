"""`sluice bench`: an OpenAI-compatible load generator modelled on vLLM's `bench serve`.

workloads.py  seeded request lists (conversational, fixed, shared-prefix, echo, jsonl) with token lengths
corpus.py     the natural-text paragraphs prompts are cut from
arrivals.py   when each request is sent (Poisson / gamma at a rate; closed loop at a max concurrency)
client.py     one streaming request and what the client saw (TTFT, chunk gaps, usage)
runner.py     one run: warm-up, then the workload against one server at one load point
metrics.py    per-request records and a run's summary (throughput, percentiles, goodput)
report.py     the printed blocks and tables, ratios between servers, the JSON document
plots.py      latency CDFs and sweep curves (matplotlib, imported only there)
machine.py    other processes' CPU during a run (contention on shared machines)
hf_server.py  a peer: HF transformers `generate` with static batching behind an OpenAI API
entrypoints/cli.py        the flags and the command
"""
