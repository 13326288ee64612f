"""Engine metrics: what the engine records while it runs, and the Prometheus view of it.

`EngineMetrics` is the engine's recorder. The engine calls `on_step` once per step; it walks the step's
requests, turns their token counts into per-request timings (TTFT, inter-token latency, TPOT, queue,
prefill, decode, end-to-end), goodput against the endpoint's SLO, and busy time split between prefill and
decode work. Its histograms are plain bucket counts (a bisect and an increment per observation); nothing
here takes a lock. Everything else (queue depths, KV usage, token and prefix-cache counters, preemptions)
is kept by the scheduler, KV manager and `EngineStats`.

The engine thread publishes all of it as one `StatsSnapshot` of plain values after each step (and each
batch of adds and aborts), before the step's outputs leave; `PrometheusExporter` renders the latest
snapshot into a per-app registry (so several engines can live in one process) and never reads a live
engine object from the HTTP thread. The snapshot is what an engine core in its own process will send.
docs/metrics.md lists every metric with its vLLM counterpart.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from .config import EngineConfig
from .objectives import Objectives, ObjectivesFile

# Buckets (upper bounds, seconds or tokens). vLLM's (vllm/v1/metrics/loggers.py), with finer low ends
# where a small model on a GPU would otherwise land everything in the first bucket.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
# vLLM's inter-token / per-output-token buckets start at 10 ms; 1, 2.5 and 5 ms added below them.
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                         0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                           60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

FINISHED_REASONS = ("stop", "length", "abort", "error")
COMPLETED_REASONS = frozenset(("stop", "length"))  # served to the end: the requests timed and SLO-checked


class Histogram:
    """Bucket counts plus a sum. Written by the engine thread only; read at scrape time."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        # bisect_left: a value equal to a bound belongs to that bucket (le is inclusive).
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def copy(self) -> Histogram:
        h = Histogram.__new__(Histogram)
        h.bounds, h.counts, h.sum = self.bounds, list(self.counts), self.sum
        return h

    def cumulative(self) -> tuple[list[tuple[str, int]], float]:
        counts, total = list(self.counts), self.sum  # a consistent-enough snapshot; count is from counts
        out, acc = [], 0
        for bound, c in zip(self.bounds, counts, strict=False):
            acc += c
            out.append((repr(float(bound)), acc))
        out.append(("+Inf", acc + counts[-1]))
        return out, total


@dataclass(slots=True)
class RequestTimes:
    """Per-request metrics state, hung on `Request.metrics` the first time a step schedules it."""

    num_output_tokens: int = 0  # output tokens already accounted for
    first_token_time: float | None = None
    last_token_time: float = 0.0
    prefilling: bool = True  # computing prompt (or recomputing after preemption), no token yet


@dataclass(slots=True)
class EngineMetrics:
    """What the engine records as it runs. One per engine; `on_step` is its only per-step entry point."""

    slo_ttft: float | None = None  # seconds
    slo_tpot: float | None = None
    gpu_hour_usd: float = 0.0
    num_gpus: int = 0
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    inter_token_latency: Histogram = field(default_factory=lambda: Histogram(TOKEN_LATENCY_BUCKETS))
    time_per_output_token: Histogram = field(default_factory=lambda: Histogram(TOKEN_LATENCY_BUCKETS))
    e2e_latency: Histogram = field(default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS))
    queue_time: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    prefill_time: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    decode_time: Histogram = field(default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS))
    iteration_tokens: Histogram = field(default_factory=lambda: Histogram(ITERATION_TOKENS_BUCKETS))
    busy_prefill_seconds: float = 0.0
    busy_decode_seconds: float = 0.0
    requests_slo_checked: int = 0
    requests_goodput: int = 0
    requests_met_ttft: int = 0
    requests_met_tpot: int = 0
    # Per LoRA adapter (by name; the base model's requests are not in them): tokens as they are made, and
    # completed requests and those that met the objectives, so cost and goodput split by adapter.
    lora_prompt_tokens: dict[str, int] = field(default_factory=dict)
    lora_generation_tokens: dict[str, int] = field(default_factory=dict)
    lora_requests: dict[str, int] = field(default_factory=dict)
    lora_goodput: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_config(cls, cfg: EngineConfig, num_gpus: int) -> EngineMetrics:
        ms = 1e-3
        return cls(
            slo_ttft=None if cfg.slo_ttft_ms is None else cfg.slo_ttft_ms * ms,
            slo_tpot=None if cfg.slo_tpot_ms is None else cfg.slo_tpot_ms * ms,
            gpu_hour_usd=cfg.gpu_hour_usd or 0.0,
            # The accelerators of the whole replica: every rank's device (TP x PP on CUDA), 0 on CPU.
            num_gpus=num_gpus,
        )

    def set_objectives(self, o: Objectives) -> None:
        """New objectives and price (--objectives-file); requests completing from now on are judged by them.
        Plain attribute stores: the engine thread reads each whole, old or new."""
        self.slo_ttft = None if o.slo_ttft_ms is None else o.slo_ttft_ms * 1e-3
        self.slo_tpot = None if o.slo_tpot_ms is None else o.slo_tpot_ms * 1e-3
        self.gpu_hour_usd = o.gpu_hour_usd or 0.0

    # -- from the engine ---------------------------------------------------------------------
    def on_step(self, scheduled: list, preempted: list, started: float) -> None:
        """After a step's outputs are built: `scheduled` holds the step's (request, tokens computed),
        `preempted` the requests it preempted, `started` the monotonic time the step began.
        Timestamps are the step's end, when its tokens leave the engine."""
        now = time.monotonic()
        prefill_tokens = decode_tokens = 0
        for req in preempted:
            if req.metrics is not None:
                req.metrics.prefilling = True  # its recompute is prefill work again
        for req, num_tokens in scheduled:
            rt = req.metrics
            if rt is None:
                rt = req.metrics = RequestTimes()
            if rt.prefilling:
                prefill_tokens += num_tokens
            else:
                decode_tokens += num_tokens
            if req.num_output_tokens > rt.num_output_tokens:  # one or more new tokens this step
                adapter = req.lora_name
                if adapter is not None:
                    _add(self.lora_generation_tokens, adapter, req.num_output_tokens - rt.num_output_tokens)
                    if rt.first_token_time is None:
                        _add(self.lora_prompt_tokens, adapter, req.num_prompt_tokens)
                rt.num_output_tokens = req.num_output_tokens
                rt.prefilling = False
                if rt.first_token_time is None:
                    rt.first_token_time = now
                    self.ttft.observe(now - req.arrival_time)
                else:
                    self.inter_token_latency.observe(now - rt.last_token_time)
                rt.last_token_time = now
            if req.finish_reason is not None and req.finish_reason.value in COMPLETED_REASONS:
                self._on_completed(req, rt, now)
        total = prefill_tokens + decode_tokens
        if total:
            self.iteration_tokens.observe(total)
            # NOTE: the step's time is split between prefill and decode work by tokens computed; this is
            # the attribution the cost-per-token PromQL in docs/metrics.md builds on.
            elapsed = now - started
            self.busy_prefill_seconds += elapsed * prefill_tokens / total
            self.busy_decode_seconds += elapsed * decode_tokens / total

    def on_finished(self, req) -> None:
        """A request finished between steps, completed (its text reached a stop string): timed now."""
        rt = req.metrics
        if rt is not None and rt.first_token_time is not None:
            self._on_completed(req, rt, time.monotonic())

    def _on_completed(self, req, rt: RequestTimes, now: float) -> None:
        first = rt.first_token_time
        ttft = first - req.arrival_time
        self.e2e_latency.observe(now - req.arrival_time)
        scheduled = req.first_scheduled_time if req.first_scheduled_time is not None else req.arrival_time
        self.queue_time.observe(scheduled - req.arrival_time)
        self.prefill_time.observe(first - scheduled)
        self.decode_time.observe(now - first)
        n = req.num_output_tokens
        tpot = (now - first) / (n - 1) if n > 1 else None  # vLLM's: the first token excluded
        if tpot is not None:
            self.time_per_output_token.observe(tpot)
        # Goodput: a request meets the SLO when it meets every objective that is set; a request with one
        # output token has no TPOT and meets a TPOT objective trivially.
        met_ttft = self.slo_ttft is None or ttft <= self.slo_ttft
        met_tpot = self.slo_tpot is None or tpot is None or tpot <= self.slo_tpot
        self.requests_slo_checked += 1
        self.requests_met_ttft += met_ttft
        self.requests_met_tpot += met_tpot
        self.requests_goodput += met_ttft and met_tpot
        if req.lora_name is not None:
            _add(self.lora_requests, req.lora_name, 1)
            _add(self.lora_goodput, req.lora_name, met_ttft and met_tpot)


def _add(counts: dict[str, int], key: str, n: int) -> None:
    counts[key] = counts.get(key, 0) + n

HISTOGRAMS = ("ttft", "inter_token_latency", "time_per_output_token", "e2e_latency", "queue_time", "prefill_time",
              "decode_time", "iteration_tokens")


@dataclass(frozen=True, slots=True)
class StatsSnapshot:
    """The engine's counters and gauges at the end of a step: plain values, copied, never shared with the
    engine thread (LLMEngine.stats_snapshot builds it)."""

    num_running: int
    num_waiting: int  # in the scheduler's queue (not those submitted but not yet taken: the AsyncEngine adds them)
    kv_usage: float
    kv_num_blocks: int
    graphs_captured: int
    graphs_state: str
    graphs_reason: str
    prompt_tokens: int
    generation_tokens: int
    prefix_queries: int
    prefix_hits: int
    num_preemptions: int
    finished: dict[str, int]
    abandoned: dict[str, int]
    scheduled_after_client_left: int
    requests_slo_checked: int
    requests_goodput: int
    requests_met_ttft: int
    requests_met_tpot: int
    busy_prefill_seconds: float
    busy_decode_seconds: float
    spec_num_drafts: int
    spec_draft_tokens: int
    spec_accepted_tokens: int
    spec_accepted_per_pos: tuple[int, ...]
    histograms: dict[str, Histogram]  # HISTOGRAMS, copies
    adds_taken: int = 0  # the engine loop's count of submitted requests taken in, when it was made
    # The objectives and price in force (flags, or the objectives file as last read): /metrics shows them.
    slo_ttft: float | None = None
    slo_tpot: float | None = None
    gpu_hour_usd: float = 0.0
    num_gpus: int = 0
    # LoRA (with --enable-lora; max_lora 0 without): the adapters of the running and of the waiting requests,
    # the device slots, and the per-adapter counters of EngineMetrics (copies).
    max_lora: int = 0
    lora_running: tuple[str, ...] = ()
    lora_waiting: tuple[str, ...] = ()
    lora_prompt_tokens: dict[str, int] = field(default_factory=dict)
    lora_generation_tokens: dict[str, int] = field(default_factory=dict)
    lora_requests: dict[str, int] = field(default_factory=dict)
    lora_goodput: dict[str, int] = field(default_factory=dict)
    # The KV offload tier (with --kv-offload-bytes; all 0 without): its size and use in blocks, blocks stored and
    # loaded, prompt tokens served from it, evicted blocks not stored, bytes per block (rank 0's shard), and the
    # host time rank 0 spent on its copies.
    kv_offload_blocks: int = 0
    kv_offload_used: int = 0
    kv_offload_stored: int = 0
    kv_offload_loaded: int = 0
    kv_offload_hits: int = 0
    kv_offload_dropped: int = 0
    kv_offload_block_bytes: int = 0
    kv_offload_store_seconds: float = 0.0
    kv_offload_load_seconds: float = 0.0
    kv_offload_received: int = 0  # blocks other engines pushed here (kv_transfer/)
    # Pushes of finished requests' prompt blocks to other engines (kv_transfer_params.push_to): ok, failed.
    kv_pushes: dict[str, int] = field(default_factory=dict)
    # A KV receiver's (--kv-role decode|both) refused batches by reason (kv_transfer/tcp.py), every reason present;
    # empty without a receiver. In-flight bytes: payloads read or being read, not yet taken into the tier.
    kv_receiver_refusals: dict[str, int] = field(default_factory=dict)
    kv_receiver_inflight_bytes: int = 0
    prompt_tokens_pending: int = 0  # prompt tokens of waiting and running requests not computed yet
    taken_at: float = 0.0  # wall-clock time (time.time()) the snapshot was made; 0: never (StatsSnapshot.zero)

    @classmethod
    def zero(cls) -> StatsSnapshot:
        """An engine that has done nothing (graphs off): every counter 0, every histogram empty."""
        fresh = EngineMetrics()
        return cls(0, 0, 0.0, 0, 0, "off", "", 0, 0, 0, 0, 0, {}, {}, 0, 0, 0, 0, 0, 0.0, 0.0, 0, 0, 0, (),
                   {name: getattr(fresh, name) for name in HISTOGRAMS})


# -- scrape time -------------------------------------------------------------------------------
class _EngineCollector:
    def __init__(self, engine, async_engine=None, prefill_hops=None):
        """engine: the LLMEngine when it runs in this process, else None (an engine-core process: everything
        comes from the snapshots it publishes, and it reads the objectives file itself)."""
        if engine is not None:
            self.served_model_name = engine.served_model_name
            cfg = engine.cfg
            self.recorder: EngineMetrics | None = engine.metrics
        else:
            self.served_model_name = async_engine.model_info.served_model_name
            cfg = async_engine.cfg
            self.recorder = None
        self.endpoint_label = cfg.endpoint_label
        self.block_size = cfg.block_size
        self.prefill_hops = prefill_hops
        # The latest snapshot: the AsyncEngine's (published by its engine loop), or, with none (the offline
        # LLM, tests), one taken at scrape time.
        self.latest = async_engine.stats if async_engine is not None else engine.stats_snapshot
        self.num_waiting = async_engine.waiting_in if async_engine is not None else (lambda snap: snap.num_waiting)
        path = getattr(cfg, "objectives_file", None)
        self.objectives = ObjectivesFile(path) if path and self.recorder is not None else None

    def collect(self):
        m = self.recorder
        # Objectives edited while the engine runs (a ConfigMap update) take effect from this scrape on.
        if self.objectives is not None and (o := self.objectives.changed()) is not None:
            m.set_objectives(o)
        snap: StatsSnapshot = self.latest()
        if m is None:  # the objectives and price as the engine core last published them
            m = snap
        names = ["model_name"]
        values = [self.served_model_name]
        if self.endpoint_label:
            names.append("endpoint")
            values.append(self.endpoint_label)

        def gauge(name: str, doc: str, v: float) -> GaugeMetricFamily:
            return gauge_family(name, doc, names, values, v)

        def counter(name: str, doc: str, v: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=names)
            c.add_metric(values, v)
            return c

        def counters(name: str, doc: str, label: str, by_value: dict[str, float]) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=[*names, label])
            for key, v in by_value.items():
                c.add_metric([*values, key], v)
            return c

        def histogram(name: str, doc: str, h: Histogram) -> HistogramMetricFamily:
            buckets, total = h.cumulative()
            f = HistogramMetricFamily(name, doc, labels=names)
            f.add_metric(values, buckets, total)
            return f

        hist = snap.histograms
        num_waiting = self.num_waiting(snap)
        # Gauges
        yield gauge("sluice_num_requests_running", "Requests in the running batch.", snap.num_running)
        yield gauge("sluice_num_requests_waiting", "Requests waiting to be scheduled, including those "
                    "submitted but not yet seen by the engine thread.", num_waiting)
        yield gauge("sluice_num_prompt_tokens_waiting", "Prompt tokens of waiting and running requests not computed "
                    "yet: the prefill backlog (what scales a disaggregated endpoint's prefill pool).",
                    snap.prompt_tokens_pending)
        yield gauge("sluice_kv_cache_usage_perc", "Fraction of KV cache blocks held by requests (0-1).",
                    snap.kv_usage)
        yield gauge("sluice_kv_cache_num_blocks", "KV cache blocks in the pool.", snap.kv_num_blocks)
        yield gauge("sluice_slo_ttft_seconds", "The endpoint's time-to-first-token objective (0: none).",
                    m.slo_ttft or 0.0)
        yield gauge("sluice_slo_tpot_seconds", "The endpoint's time-per-output-token objective (0: none).",
                    m.slo_tpot or 0.0)
        yield gauge("sluice_gpu_hour_usd", "Price of one GPU-hour in USD (--gpu-hour-usd; 0: not set).",
                    m.gpu_hour_usd)
        yield gauge("sluice_num_gpus", "GPUs the replica holds: every rank's device (TP x PP on CUDA), 0 on CPU.",
                    m.num_gpus)
        yield gauge("sluice_cuda_graphs_captured", "Decode CUDA graphs captured (batch sizes x split counts); 0 "
                    "when steps run eagerly.", snap.graphs_captured)
        info = GaugeMetricFamily("sluice_cuda_graphs_info", "1, labelled with whether decode steps replay CUDA "
                                 "graphs (state on|off|failed) and why not (reason).",
                                 labels=[*names, "state", "reason"])
        info.add_metric([*values, snap.graphs_state, _label_text(snap.graphs_reason)], 1)
        yield info
        # Counters
        yield counter("sluice_prompt_tokens", "Prompt tokens of requests that produced their first token "
                      "(prefix-cache hits included).", snap.prompt_tokens)
        yield counter("sluice_generation_tokens", "Tokens generated.", snap.generation_tokens)
        yield counter("sluice_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      snap.prefix_queries)
        yield counter("sluice_prefix_cache_hits", "Prompt tokens served from the prefix cache.", snap.prefix_hits)
        yield counter("sluice_num_preemptions", "Requests preempted by recompute.", snap.num_preemptions)
        if snap.kv_offload_blocks:
            yield from self._kv_offload_metrics(snap, gauge, counter, counters)
        if self.prefill_hops is not None:
            yield counters("sluice_kv_prefill_hops", "Requests whose prompts were first sent to the prefill engines "
                           "(--prefill-url) by outcome: ok (their blocks pushed here), failed (computed here), "
                           "skipped (prompts shorter than --prefill-min-prompt-tokens).", "outcome",
                           {o: self.prefill_hops.get(o, 0) for o in ("ok", "failed", "skipped")})
        if snap.kv_pushes:
            yield counters("sluice_kv_pushes", "Pushes of finished requests' prompt KV blocks to another engine "
                           "(kv_transfer_params.push_to), by result.", "result",
                           {r: snap.kv_pushes.get(r, 0) for r in ("ok", "failed")})
        if snap.kv_receiver_refusals:
            yield counters("sluice_kv_receiver_refusals", "Batches of KV blocks this engine's receiver refused, by "
                           "reason: unauthenticated (no or another KV key), malformed, layout, busy (connections or "
                           "in-flight bytes at their cap), timeout, disconnected.", "reason", snap.kv_receiver_refusals)
            yield gauge("sluice_kv_receiver_inflight_bytes", "Payload bytes of KV batches being received or not yet "
                        "taken into the offload tier (capped at the tier's size).", snap.kv_receiver_inflight_bytes)
        yield counters("sluice_request_success", "Finished requests by reason.", "finished_reason",
                       {r: snap.finished.get(r, 0) for r in FINISHED_REASONS})
        yield counters("sluice_request_abandoned", "Requests aborted because their client left, by how far "
                       "they had got when it left.", "phase",
                       {ph: snap.abandoned.get(ph, 0) for ph in ("queued", "prefill", "decode")})
        yield counter("sluice_request_scheduled_after_client_left", "Abandoned requests first scheduled after "
                      "their client had left (work done for nobody; should stay 0).",
                      snap.scheduled_after_client_left)
        yield counter("sluice_request_slo", "Completed requests (stop or length) checked against the SLO.",
                      snap.requests_slo_checked)
        yield counter("sluice_request_goodput", "Completed requests that met every SLO objective set.",
                      snap.requests_goodput)
        yield counters("sluice_request_slo_met", "Completed requests that met one objective (met trivially "
                       "when it is not set).", "objective",
                       {"ttft": snap.requests_met_ttft, "tpot": snap.requests_met_tpot})
        yield counters("sluice_engine_busy_seconds", "Time spent in engine steps, split between prefill and "
                       "decode work by tokens computed.", "phase",
                       {"prefill": snap.busy_prefill_seconds, "decode": snap.busy_decode_seconds})
        yield counter("sluice_spec_decode_num_drafts", "Draft sequences verified.", snap.spec_num_drafts)
        yield counter("sluice_spec_decode_num_draft_tokens", "Draft tokens proposed.", snap.spec_draft_tokens)
        yield counter("sluice_spec_decode_num_accepted_tokens", "Draft tokens accepted.", snap.spec_accepted_tokens)
        yield counters("sluice_spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by position "
                       "in the draft.", "position", {str(i): v for i, v in enumerate(snap.spec_accepted_per_pos)})
        # Histograms
        yield histogram("sluice_time_to_first_token_seconds", "Time from arrival to the first output token.",
                        hist["ttft"])
        yield histogram("sluice_inter_token_latency_seconds", "Time between a request's successive output "
                        "steps.", hist["inter_token_latency"])
        yield histogram("sluice_request_time_per_output_token_seconds", "Per completed request: (e2e - ttft) "
                        "/ (output tokens - 1).", hist["time_per_output_token"])
        yield histogram("sluice_e2e_request_latency_seconds", "Per completed request: arrival to last token.",
                        hist["e2e_latency"])
        yield histogram("sluice_request_queue_time_seconds", "Per completed request: arrival to first "
                        "scheduled.", hist["queue_time"])
        yield histogram("sluice_request_prefill_time_seconds", "Per completed request: first scheduled to "
                        "first token.", hist["prefill_time"])
        yield histogram("sluice_request_decode_time_seconds", "Per completed request: first token to last "
                        "token.", hist["decode_time"])
        yield histogram("sluice_iteration_tokens", "Tokens computed per engine step.", hist["iteration_tokens"])
        if snap.max_lora:
            yield from self._lora(snap, names, values)
        yield from self._model_server_protocol(snap, num_waiting, names, values)

    def _model_server_protocol(self, snap: StatsSnapshot, num_waiting: int, names: list[str], values: list[str]):
        """The metrics the Gateway API Inference Extension's endpoint pickers (its reference EPP, llm-d) read from a
        model server, under vLLM's names: the same values as the sluice_ gauges above, not computed again."""
        yield gauge_family("vllm:num_requests_waiting", "Requests waiting to be scheduled (sluice_num_requests_"
                           "waiting).", names, values, num_waiting)
        yield gauge_family("vllm:num_requests_running", "Requests in the running batch (sluice_num_requests_"
                           "running).", names, values, snap.num_running)
        yield gauge_family("vllm:kv_cache_usage_perc", "Fraction of KV cache blocks held by requests, 0-1 "
                           "(sluice_kv_cache_usage_perc).", names, values, snap.kv_usage)
        info = GaugeMetricFamily("vllm:cache_config_info", "1, labelled with the KV cache's block size in tokens "
                                 "(block_size) and its number of blocks (num_gpu_blocks).",
                                 labels=[*names, "block_size", "num_gpu_blocks"])
        info.add_metric([*values, str(self.block_size), str(snap.kv_num_blocks)], 1)
        yield info
        if snap.max_lora:
            # NOTE: the protocol's value is the time of the last update (an EPP keeps the newest series): the
            # snapshot's, so a stalled engine shows an old one.
            lora = GaugeMetricFamily("vllm:lora_requests_info", "Unix time of the last update, labelled with the "
                                     "LoRA adapters of the running and the waiting requests (comma-separated) "
                                     "and the adapters resident at once (max_lora).",
                                     labels=[*names, "max_lora", "running_lora_adapters", "waiting_lora_adapters"])
            lora.add_metric([*values, str(snap.max_lora), ",".join(snap.lora_running), ",".join(snap.lora_waiting)],
                            snap.taken_at or time.time())
            yield lora

    @staticmethod
    def _lora(snap: StatsSnapshot, names: list[str], values: list[str]):
        # vLLM's gauge, by the same name and labels (dashboards built for vLLM read it): the adapters running
        # and waiting, comma-separated, and the slots.
        info = GaugeMetricFamily("sluice_lora_requests_info", "1, labelled with the LoRA adapters of the running "
                                 "and the waiting requests (comma-separated) and the adapters resident at once "
                                 "(max_lora).", labels=[*names, "running_lora_adapters", "waiting_lora_adapters",
                                                        "max_lora"])
        info.add_metric([*values, ",".join(snap.lora_running), ",".join(snap.lora_waiting), str(snap.max_lora)], 1)
        yield info
        for name, doc, counts in (
                ("sluice_lora_prompt_tokens", "Prompt tokens of requests on each LoRA adapter (counted at their "
                 "first token).", snap.lora_prompt_tokens),
                ("sluice_lora_generation_tokens", "Tokens generated on each LoRA adapter.", snap.lora_generation_tokens),
                ("sluice_lora_requests", "Completed requests (stop or length) on each LoRA adapter.",
                 snap.lora_requests),
                ("sluice_lora_request_goodput", "Completed requests on each LoRA adapter that met every SLO "
                 "objective set.", snap.lora_goodput)):
            c = CounterMetricFamily(name, doc, labels=[*names, "adapter"])
            for adapter, v in sorted(counts.items()):
                c.add_metric([*values, adapter], v)
            yield c


    @staticmethod
    def _kv_offload_metrics(snap: StatsSnapshot, gauge, counter, counters):
        b = snap.kv_offload_block_bytes
        yield gauge("sluice_kv_offload_blocks", "KV blocks the offload tier holds at most (--kv-offload-bytes).",
                    snap.kv_offload_blocks)
        yield gauge("sluice_kv_offload_blocks_used", "KV blocks in the offload tier now.", snap.kv_offload_used)
        yield counter("sluice_kv_offload_hits", "Prompt tokens loaded from the offload tier instead of computed "
                      "(also counted in sluice_prefix_cache_hits).", snap.kv_offload_hits)
        yield counters("sluice_kv_offload_blocks_moved", "KV blocks copied to the offload tier (store: evicted from "
                       "the device's prefix cache) and back (load: a prefix hit in the tier).", "direction",
                       {"store": snap.kv_offload_stored, "load": snap.kv_offload_loaded,
                        "receive": snap.kv_offload_received})
        yield counters("sluice_kv_offload_bytes", "Bytes of KV copied to and from the offload tier (rank 0's "
                       "shard; every rank moves its own).", "direction",
                       {"store": snap.kv_offload_stored * b, "load": snap.kv_offload_loaded * b})
        yield counters("sluice_kv_offload_seconds", "Host time rank 0 spent on offload-tier copies (on a GPU, issuing "
                       "them); divided by sluice_kv_offload_blocks_moved, the time per block.", "direction",
                       {"store": snap.kv_offload_store_seconds, "load": snap.kv_offload_load_seconds})
        yield counter("sluice_kv_offload_dropped_blocks", "Evicted prefix blocks not stored because every tier "
                      "slot was being loaded by the same step.", snap.kv_offload_dropped)


def gauge_family(name: str, doc: str, names: list[str], values: list[str], v: float) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc, labels=names)
    g.add_metric(values, v)
    return g


def _label_text(text: str, limit: int = 200) -> str:
    """One line of at most `limit` characters (an exception's text can be long and span lines)."""
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


class PrometheusExporter:
    """`/metrics` for one engine, from its own registry (never the process-global one)."""

    def __init__(self, engine, async_engine=None, prefill_hops=None):
        """prefill_hops: the API process's counts of prefill hops by outcome (a decode engine with --prefill-url)."""
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, async_engine, prefill_hops))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
