"""The replica's Prometheus series (through Ray's metrics API), tagged with worker and model.

Counters and gauges follow the engine's stats snapshot (`update`, once a second from the
replica); the latency histograms are observed by `generate` as tokens go out.
"""

from __future__ import annotations

from typing import Any

from ray.util import metrics

from workers.engine_types import EngineStats

_TTFT_BUCKETS = [0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0]
_ITL_BUCKETS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                1.0, 2.5, 5.0]


class WorkerMetrics:
    def __init__(self, worker: str, model_name: str) -> None:
        tags = {"worker": worker, "model_name": model_name}
        keys = ("worker", "model_name")

        def tagged(metric: Any) -> Any:
            return metric.set_default_tags(tags)

        self._queries = tagged(metrics.Counter(
            "prefixserve_prefix_cache_queries",
            description="Prompt tokens looked up in the prefix cache (vLLM prefix_cache_queries).",
            tag_keys=keys))
        self._hits = tagged(metrics.Counter(
            "prefixserve_prefix_cache_hits",
            description="Prompt tokens served from the prefix cache (vLLM prefix_cache_hits).",
            tag_keys=keys))
        self._kv_usage = tagged(metrics.Gauge(
            "prefixserve_kv_cache_usage_perc", description="KV cache blocks in use (0-1).",
            tag_keys=keys))
        self._running = tagged(metrics.Gauge(
            "prefixserve_num_requests_running", description="Sequences in the running batch.",
            tag_keys=keys))
        self._waiting = tagged(metrics.Gauge(
            "prefixserve_num_requests_waiting", description="Sequences waiting to be scheduled.",
            tag_keys=keys))
        self.ttft = tagged(metrics.Histogram(
            "prefixserve_time_to_first_token_seconds",
            description="Time from arrival at the worker to the first generated token.",
            boundaries=_TTFT_BUCKETS, tag_keys=keys))
        self.itl = tagged(metrics.Histogram(
            "prefixserve_inter_token_latency_seconds",
            description="Time between consecutive token deltas of one request.",
            boundaries=_ITL_BUCKETS, tag_keys=keys))
        # The engine's counts are cumulative; Prometheus counters take increments.
        self._queried = self._hit = 0

    def update(self, s: EngineStats) -> None:
        """Bring the counters and gauges up to a stats snapshot."""
        if s.prompt_tokens_queried > self._queried:
            self._queries.inc(s.prompt_tokens_queried - self._queried)
        if s.prompt_tokens_hit > self._hit:
            self._hits.inc(s.prompt_tokens_hit - self._hit)
        self._queried, self._hit = s.prompt_tokens_queried, s.prompt_tokens_hit
        self._kv_usage.set(s.kv_usage)
        self._running.set(s.num_running)
        self._waiting.set(s.num_waiting)
