"""Prometheus metrics under vLLM's names with a `poot:` prefix (`vllm:num_requests_running` is
`poot:num_requests_running`), through prometheus_client.

Engine state (running and waiting requests, KV-pool use, recurrent state slots in use, prefix-cache queries and
hits, preemptions) is read at scrape time from the engine thread's last snapshot; per-request figures (tokens,
latencies, finish reasons) are recorded as each request's items reach the event loop, labelled by model and
tenant.
Prefix-cache queries and hits count full KV blocks looked up and found.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from poot_core.server.bridge import EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# vLLM's buckets
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)


class _EngineCollector(Collector):
    def __init__(self, model: str, stats: Callable[[], EngineStats]) -> None:
        self.model, self.stats = model, stats

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        labels = ["model_name"]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"poot:{name}", doc, labels=labels)
            g.add_metric([self.model], value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(f"poot:{name}", doc, labels=labels)
            c.add_metric([self.model], value)
            return c

        yield gauge("num_requests_running", "Requests in the engine's running set.", s.running)
        yield gauge("num_requests_waiting", "Requests waiting to be admitted.", s.waiting)
        yield gauge("kv_cache_usage_perc", "Fraction of KV-pool blocks held by sequences (1 = full).",
                    s.held / s.blocks if s.blocks else 0.0)
        yield gauge("kv_cache_blocks", "KV-pool blocks in all.", s.blocks)
        yield gauge("recurrent_state_slots", "Recurrent state slots in all (hybrid models; 0 without).", s.state_slots)
        yield gauge("recurrent_state_usage_perc", "Fraction of recurrent state slots held by sequences (1 = full).",
                    s.state_held / s.state_slots if s.state_slots else 0.0)
        yield counter("prefix_cache_queries", "Full KV blocks looked up in the prefix cache.", s.cache_queries)
        yield counter("prefix_cache_hits", "Full KV blocks found in the prefix cache.", s.cache_hits)
        yield counter("num_preemptions", "Sequences preempted (recomputed later) for want of KV blocks.",
                      s.preemptions)
        yield counter("engine_steps", "Engine steps run.", s.steps)


class Metrics:
    def __init__(self, model: str, stats: Callable[[], EngineStats]) -> None:
        self.model = model
        self.registry = CollectorRegistry()
        labels = ["model_name", "tenant"]
        r = self.registry
        self.prompt_tokens = Counter("poot:prompt_tokens", "Prompt tokens of accepted requests.", labels, registry=r)
        self.generation_tokens = Counter("poot:generation_tokens", "Generated tokens.", labels, registry=r)
        self.request_success = Counter("poot:request_success", "Finished requests by finish reason.",
                                       [*labels, "finished_reason"], registry=r)
        self.rejected = Counter("poot:request_rejected", "Requests refused with a 429 (queue or tenant limit).",
                                [*labels, "reason"], registry=r)
        self.ttft = Histogram("poot:time_to_first_token_seconds", "Time to first token.", labels,
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("poot:inter_token_latency_seconds", "Time between two tokens of a request.", labels,
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("poot:e2e_request_latency_seconds", "Submit to the last token.", labels,
                             buckets=REQUEST_BUCKETS, registry=r)
        self.queue_time = Histogram("poot:request_queue_time_seconds", "Submit to the first step that ran it.",
                                    labels, buckets=REQUEST_BUCKETS, registry=r)
        r.register(_EngineCollector(model, stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)
