"""Moving KV blocks between engines (issue 28; docs/architecture.md, "KV beyond one engine"): the blocks of a
prompt, named by their prefix-cache names, exported from one engine's cache, sent over TCP, and taken into another
engine's offload tier, where its scheduler finds them as prefix hits. The seam prefill/decode disaggregation
stands on."""
