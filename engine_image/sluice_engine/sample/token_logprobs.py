"""The logprobs of one sampled token, as plain data (no torch: the API process imports it)."""

# (logprob of the chosen token, [(token_id, logprob) for the top-k, most likely first])
TokenLogprobs = tuple[float, list[tuple[int, float]]]
