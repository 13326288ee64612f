"""Per-request timings and the summary of a run, with vLLM `bench serve`'s definitions:

- TTFT: request sent -> first chunk carrying output.
- ITL: the gap between consecutive output chunks, all requests' gaps pooled. A chunk carrying several
  tokens (speculative decoding) is one gap.
- TPOT: (E2E - TTFT) / (output tokens - 1): the first token excluded; requests of one token have none.
- E2E: request sent -> stream finished.
- Throughput: over the run's duration, first send to last completion (warm-up excluded). Total tok/s
  counts prompt tokens too.
- Goodput: successful requests that met every SLO given (TTFT and/or TPOT), per second of the run. A
  one-token request meets any TPOT objective (as in vLLM).
Percentiles interpolate linearly between order statistics (numpy's default).
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from dataclasses import dataclass, field

PERCENTILES = (50, 90, 99)


@dataclass(slots=True)
class RequestRecord:
    index: int
    max_tokens: int
    prompt_tokens: int  # the server's usage.prompt_tokens, else the workload's count
    success: bool = False
    error: str | None = None
    send_s: float = 0.0  # when it was sent, seconds from the start of the run
    ttft_s: float | None = None
    e2el_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    output_tokens_from: str = "usage"  # "usage": the final usage chunk; "chunks": counted (no usage sent)
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, when the server reports it
    output_text: str = ""

    @property
    def tpot_s(self) -> float | None:
        if not self.success or self.output_tokens < 2 or self.ttft_s is None or self.e2el_s is None:
            return None
        return (self.e2el_s - self.ttft_s) / (self.output_tokens - 1)


def percentile(xs: list[float], q: float) -> float | None:
    """q in [0, 100]; linear interpolation between closest ranks; None for no data."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def distribution_ms(xs_s: list[float]) -> dict[str, float | None]:
    """mean, std, median and PERCENTILES of seconds, in milliseconds."""
    ms = [x * 1e3 for x in xs_s]
    out: dict[str, float | None] = {
        "mean": statistics.fmean(ms) if ms else None,
        "std": statistics.pstdev(ms) if ms else None,
        "median": percentile(ms, 50),
    }
    out |= {f"p{q}": percentile(ms, q) for q in PERCENTILES if q != 50}
    return out


def meets_slo(r: RequestRecord, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> bool:
    if not r.success:
        return False
    if slo_ttft_ms is not None and (r.ttft_s is None or r.ttft_s * 1e3 > slo_ttft_ms):
        return False
    tpot = r.tpot_s
    return slo_tpot_ms is None or tpot is None or tpot * 1e3 <= slo_tpot_ms


def summarize(records: list[RequestRecord], duration_s: float, slo_ttft_ms: float | None = None,
              slo_tpot_ms: float | None = None) -> dict:
    ok = [r for r in records if r.success]
    total_in = sum(r.prompt_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    dur = max(duration_s, 1e-9)
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    s: dict = {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration_s,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / dur,
        "output_throughput": total_out / dur,
        "total_token_throughput": (total_in + total_out) / dur,
        "ttft_ms": distribution_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_ms": distribution_ms([t for r in ok if (t := r.tpot_s) is not None]),
        "itl_ms": distribution_ms([x for r in ok for x in r.itl_s]),
        "e2el_ms": distribution_ms([r.e2el_s for r in ok if r.e2el_s is not None]),
        # Requests that got fewer tokens than max_tokens: with ignore_eos, a server that ignores it.
        "short_outputs": sum(1 for r in ok if r.output_tokens < r.max_tokens),
        "output_tokens_counted_from_chunks": sum(1 for r in ok if r.output_tokens_from == "chunks"),
        "cached_prompt_tokens": sum(cached) if cached else None,
        "errors": dict(Counter(r.error for r in records if not r.success).most_common(5)),
    }
    if slo_ttft_ms is not None or slo_tpot_ms is not None:
        good = sum(1 for r in records if meets_slo(r, slo_ttft_ms, slo_tpot_ms))
        s["good_requests"] = good
        s["request_goodput"] = good / dur
        s["slo_attainment"] = good / len(records) if records else None
    return s
