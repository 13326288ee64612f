"""Prometheus metrics. Values are read from the engine's own counters at scrape time, so keeping
them never costs the engine loop anything."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST


class _EngineCollector:
    def __init__(self, engine, async_engine):
        self.engine = engine
        self.async_engine = async_engine

    def collect(self):
        e = self.engine
        labels = ["model_name"]
        value = [e.served_model_name]

        def gauge(name: str, doc: str, v: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(value, v)
            return g

        def counter(name: str, doc: str, v: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(value, v)
            return c

        yield gauge("sluice_num_requests_running", "Requests in the running batch.", e.scheduler.num_running)
        yield gauge("sluice_num_requests_waiting", "Requests waiting to be scheduled.", self.async_engine.num_waiting)
        yield gauge("sluice_kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).", e.kv.usage())
        yield gauge("sluice_kv_cache_blocks_total", "KV cache blocks in the pool.", e.kv.num_blocks)
        yield counter("sluice_prompt_tokens", "Prompt tokens processed.", e.stats.prompt_tokens)
        yield counter("sluice_generation_tokens", "Generation tokens produced.", e.stats.generation_tokens)
        yield counter("sluice_num_preemptions", "Requests preempted by recompute.", e.scheduler.num_preemptions)
        yield counter("sluice_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", e.kv.prefix_queries)
        yield counter("sluice_prefix_cache_hits", "Prompt tokens served from the prefix cache.", e.kv.prefix_hits)
        fin = CounterMetricFamily("sluice_request_success", "Finished requests by reason.",
                                  labels=["model_name", "finished_reason"])
        for reason in ("stop", "length", "abort", "error"):
            fin.add_metric([e.served_model_name, reason], e.stats.finished.get(reason, 0))
        yield fin


class EngineMetrics:
    def __init__(self, engine, async_engine):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, async_engine))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
