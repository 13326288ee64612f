"""When each request is sent: offsets in seconds from the start of a run.

Open loop (`--request-rate R`): inter-arrival gaps drawn from a gamma distribution with shape B
(`--burstiness`) and scale 1 / (R * B), so the mean gap is 1 / R whatever B is. B = 1 is a Poisson process
(exponential gaps); B < 1 is burstier (clusters and lulls), B > 1 more even. vLLM's `bench serve` uses the
same parametrisation. Rate inf sends everything at once.

Closed loop (`--max-concurrency C`): at most C requests in flight; a request that arrives while C are in
flight waits for one to finish. With rate inf this is C clients each sending their next request as soon as
the previous one completes.
"""

from __future__ import annotations

import math
import random


def arrival_times(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send offsets of n requests: the first at 0, then gamma(B, 1 / (rate * B)) gaps."""
    assert n >= 0 and rate > 0 and burstiness > 0, "need rate > 0 and burstiness > 0"
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(f"sluice-bench-{seed}-arrivals")
    scale = 1.0 / (rate * burstiness)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(burstiness, scale)
    return out


def parse_rate(text: str) -> float:
    """'inf' or a positive number of requests per second."""
    rate = float(text)
    if not rate > 0:
        raise ValueError(f"request rate must be > 0 (or inf), got {text!r}")
    return rate


def describe(rate: float, burstiness: float, max_concurrency: int | None) -> str:
    if math.isinf(rate):
        load = "all requests at once" if max_concurrency is None else f"closed loop, {max_concurrency} in flight"
    else:
        shape = "Poisson" if burstiness == 1 else f"gamma, burstiness {burstiness:g}"
        load = f"{rate:g} req/s ({shape})"
        if max_concurrency is not None:
            load += f", at most {max_concurrency} in flight"
    return load
