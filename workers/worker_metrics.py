"""The replica's Prometheus series, named as vLLM's under Ray so vLLM dashboards read them as-is.

vLLM on Ray Serve LLM records ``vllm:<name>`` through ``ray.util.metrics`` with the colon made an
underscore; Ray's exporter prefixes ``ray_`` and gives counters ``_total``, so
``vllm_prompt_tokens`` is scraped as ``ray_vllm_prompt_tokens_total``. Ray's bundled Serve LLM
dashboard filters those on ``model_name`` and ``WorkerId`` (Ray adds ``WorkerId``, the replica
process, itself); ``worker`` (the Serve replica id, what the router and the index call a worker)
is extra.

Counters and gauges follow the engine's stats snapshot (:meth:`WorkerMetrics.update`, once a
second from the replica); the per-request series are observed by ``generate`` through a
:class:`RequestMetrics` as deltas go out, all times from arrival at the worker (vLLM's
``arrival_time``), so they include the replica's own queueing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ray.util import metrics

from prefixserve.router.request import TokenDelta
from prefixserve.workers.engine_types import EngineStats
from prefixserve.workers.kv_tiers.base import TierCounters

TAG_KEYS = ("model_name", "worker")

# vLLM's bucket bounds, with finer low ends for small models on CPU.
_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
_TOKEN_LATENCY_BUCKETS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                          0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
_REQUEST_LATENCY_BUCKETS = [0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0,
                            20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0,
                            7680.0]
_TOKEN_COUNT_BUCKETS = [float(m * 10**e) for e in range(6) for m in (1, 2, 5)]

# name -> description; the name is vLLM's metric name with ':' made '_'.
COUNTERS = {
    "vllm_prompt_tokens": "Prompt tokens prefilled (cached ones included), per request.",
    "vllm_generation_tokens": "Generated tokens sent out.",
    "vllm_request_success": "Finished requests (samples) by finished_reason: stop, length, "
                            "abort (drained or the caller went away), error (a failed step).",
    "vllm_prefix_cache_queries": "Prompt tokens looked up in the prefix cache.",
    "vllm_prefix_cache_hits": "Prompt tokens served from the prefix cache.",
    "vllm_num_preemptions": "Sequences preempted (their KV blocks taken back) to make room.",
    "vllm_external_prefix_cache_queries": "Prompt tokens looked up in the KV tiers below the "
                                          "pool (those the pool did not hit).",
    "vllm_external_prefix_cache_hits": "Prompt tokens loaded from the KV tiers below the pool.",
    "prefixserve_lora_loads": "LoRA adapters put into a batch slot.",
    "prefixserve_lora_reads": "LoRA adapters read from their files into host memory.",
    "prefixserve_lora_evictions": "LoRA adapters evicted from a batch slot for another.",
}
# The KV tiers' cumulative counts, each by one tag: name -> (description, tag, reader).
TIER_COUNTERS: dict[str, tuple[str, str, Callable[[TierCounters], Mapping[str, float]]]] = {
    "vllm_kv_offload_store_bytes": (
        "KV bytes copied below the pool, by medium (host, disk).", "medium",
        lambda t: t.offloaded_bytes),
    "vllm_kv_offload_store_time": (
        "Seconds the engine thread spent copying them (disk writes: queueing them).", "medium",
        lambda t: t.offload_s),
    "vllm_kv_offload_load_bytes": (
        "KV bytes loaded into the pool from below, by medium.", "medium",
        lambda t: t.loaded_bytes),
    "vllm_kv_offload_load_time": (
        "Seconds from a load's start to its blocks being in the pool, by medium.", "medium",
        lambda t: t.load_s),
    "prefixserve_kv_offload_load_failures": (
        "Blocks found below the pool that did not load (recomputed), by reason: missing, "
        "truncated, corrupt, checksum, layout, read_error.", "reason",
        lambda t: t.load_failures),
    "prefixserve_kv_offload_store_skips": (
        "Blocks not written to the disk tier, by reason: disk_full, disk_busy, write_error, "
        "too_big.", "reason", lambda t: t.store_skips),
}
HOST_USAGE = "vllm_kv_offload_cpu_cache_usage_perc"
# How true the prefix index is (workers/index_truth.py): per request the router sent with its
# expectation, the blocks found less those expected, and the requests off by more than a block.
INDEX_ERROR = "prefixserve_index_error_blocks"
INDEX_OFF = "prefixserve_index_mispredicted"
INDEX_LAG = "prefixserve_index_event_lag_seconds"
_ERROR_BUCKETS = [0.5, 1.5, 2.5, 4.5, 8.5, 16.5, 32.5, 64.5, 128.5, 512.5, 2048.5]
_LAG_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]
GAUGES = {
    "vllm_num_requests_running": "Sequences in the running batch.",
    "vllm_num_requests_waiting": "Sequences waiting to be scheduled.",
    "vllm_kv_cache_usage_perc": "KV cache blocks in use (0-1).",
}
# vLLM's LoRA gauge: its labels name the adapters (comma-joined), its value is when they were
# last updated; set only by an engine with adapters.
LORA_INFO = "vllm_lora_requests_info"
LORA_TAG_KEYS = ("running_lora_adapters", "waiting_lora_adapters", "max_lora")
HISTOGRAMS = {
    "vllm_time_to_first_token_seconds": (
        "Arrival at the worker to the first token sent out.", _TTFT_BUCKETS),
    "vllm_inter_token_latency_seconds": (
        "Time between consecutive token deltas of one request.", _TOKEN_LATENCY_BUCKETS),
    "vllm_request_time_per_output_token_seconds": (
        "Per sample: (last token - first token) / (generated tokens - 1).",
        _TOKEN_LATENCY_BUCKETS),
    "vllm_e2e_request_latency_seconds": (
        "Per sample: arrival at the worker to its finish.", _REQUEST_LATENCY_BUCKETS),
    "vllm_request_queue_time_seconds": (
        "Arrival at the worker to the engine step that first scheduled the request.",
        _REQUEST_LATENCY_BUCKETS),
    "vllm_request_prefill_time_seconds": (
        "First scheduled to the first token sent out.", _REQUEST_LATENCY_BUCKETS),
    "vllm_request_decode_time_seconds": (
        "Per sample: first token to its last token.", _REQUEST_LATENCY_BUCKETS),
    "vllm_request_prompt_tokens": ("Prompt length of each request.", _TOKEN_COUNT_BUCKETS),
    "vllm_request_generation_tokens": (
        "Tokens generated by each finished sample.", _TOKEN_COUNT_BUCKETS),
}


# The counters fed from the engine's cumulative counts (Prometheus counters take increments).
_CUMULATIVE: dict[str, Callable[[EngineStats], int]] = {
    "vllm_prefix_cache_queries": lambda s: s.prompt_tokens_queried,
    "vllm_prefix_cache_hits": lambda s: s.prompt_tokens_hit,
    "vllm_num_preemptions": lambda s: s.num_preemptions,
    "vllm_external_prefix_cache_queries": lambda s: s.external_tokens_queried,
    "vllm_external_prefix_cache_hits": lambda s: s.external_tokens_hit,
    "prefixserve_lora_loads": lambda s: s.lora.loads,
    "prefixserve_lora_reads": lambda s: s.lora.reads,
    "prefixserve_lora_evictions": lambda s: s.lora.evictions,
}


def exported_series() -> set[str]:
    """The series names Ray's Prometheus exporter shows for these metrics."""
    return ({f"ray_{n}_total" for n in (*COUNTERS, INDEX_OFF, *TIER_COUNTERS)}
            | {f"ray_{n}" for n in (*GAUGES, LORA_INFO, HOST_USAGE)}
            | {f"ray_{n}_{s}" for n in (*HISTOGRAMS, INDEX_ERROR, INDEX_LAG)
               for s in ("bucket", "sum", "count")})


class WorkerMetrics:
    """The replica's metric objects, tagged with its model and Serve replica id."""

    def __init__(self, worker: str, model_name: str) -> None:
        tags = {"model_name": model_name, "worker": worker}
        self.counters: dict[str, Any] = {
            n: metrics.Counter(n, description=d, tag_keys=(
                *TAG_KEYS, "finished_reason") if n == "vllm_request_success" else TAG_KEYS,
            ).set_default_tags(tags)
            for n, d in COUNTERS.items()
        }
        self.gauges: dict[str, Any] = {
            n: metrics.Gauge(n, description=d, tag_keys=TAG_KEYS).set_default_tags(tags)
            for n, d in GAUGES.items()
        }
        self.histograms: dict[str, Any] = {
            n: metrics.Histogram(n, description=d, boundaries=b, tag_keys=TAG_KEYS)
            .set_default_tags(tags)
            for n, (d, b) in HISTOGRAMS.items()
        }
        self.lora_info = metrics.Gauge(
            LORA_INFO, description="Running and waiting LoRA adapters (labels); the value is "
            "when they were last updated.", tag_keys=(*TAG_KEYS, *LORA_TAG_KEYS),
        ).set_default_tags(tags)
        self.index_error = metrics.Histogram(
            INDEX_ERROR, description="Per request the router sent with the prefix depth it "
            "expected: how many blocks the worker found more or less than that (direction).",
            boundaries=_ERROR_BUCKETS, tag_keys=(*TAG_KEYS, "direction"),
        ).set_default_tags(tags)
        self.index_off = metrics.Counter(
            INDEX_OFF, description="Requests whose expected prefix depth was off by more than "
            "one block, by cause: failopen, serve, evicted, never_stored, not_indexed.",
            tag_keys=(*TAG_KEYS, "cause"),
        ).set_default_tags(tags)
        self.index_lag = metrics.Histogram(
            INDEX_LAG, description="KV events from the engine step that made them to the index "
            "applying them (where a lookup sees them), per applied batch's oldest event.",
            boundaries=_LAG_BUCKETS, tag_keys=TAG_KEYS,
        ).set_default_tags(tags).observe
        self.tier_counters = {
            n: metrics.Counter(n, description=d, tag_keys=(*TAG_KEYS, tag)).set_default_tags(tags)
            for n, (d, tag, _) in TIER_COUNTERS.items()
        }
        self.host_usage = metrics.Gauge(
            HOST_USAGE, description="Host KV tier slots in use (0-1).", tag_keys=TAG_KEYS,
        ).set_default_tags(tags)
        # The engine's counts are cumulative; Prometheus counters take increments.
        self._seen = dict.fromkeys(_CUMULATIVE, 0)
        self._seen_tiers: dict[tuple[str, str], float] = {}

    def update(self, s: EngineStats) -> None:
        """Bring the snapshot-fed counters and gauges up to a stats snapshot."""
        for name, read in _CUMULATIVE.items():
            total = read(s)
            if total > self._seen[name]:
                self.counters[name].inc(total - self._seen[name])
            self._seen[name] = total
        if s.tiers is not None:
            self._update_tiers(s.tiers)
        self.gauges["vllm_kv_cache_usage_perc"].set(s.kv_usage)
        self.gauges["vllm_num_requests_running"].set(s.num_running)
        self.gauges["vllm_num_requests_waiting"].set(s.num_waiting)
        if s.lora.registered:
            self.lora_info.set(time.time(), tags={
                "running_lora_adapters": ",".join(s.running_loras),
                "waiting_lora_adapters": ",".join(s.waiting_loras),
                "max_lora": str(s.lora.max_loras)})

    def _update_tiers(self, t: TierCounters) -> None:
        for name, (_, tag, read) in TIER_COUNTERS.items():
            for value, total in read(t).items():
                seen = self._seen_tiers.get((name, value), 0)
                if total > seen:
                    self.tier_counters[name].inc(total - seen, tags={tag: value})
                self._seen_tiers[name, value] = total
        self.host_usage.set(t.host_usage)

    def request(self, arrival: float, n: int,
                judge: Callable[[int], tuple[int, str | None]] | None = None) -> RequestMetrics:
        """Per-request timing for one ``generate`` call of ``n`` samples; ``judge`` compares
        the cached tokens found with the router's expectation (workers/index_truth.py)."""
        return RequestMetrics(self, arrival, n, judge)

    def judged(self, diff: int, cause: str | None) -> None:
        direction = "none" if diff == 0 else ("less" if diff < 0 else "more")
        self.index_error.observe(abs(diff), tags={"direction": direction})
        if cause is not None:
            self.index_off.inc(tags={"cause": cause})

    def observe(self, name: str, value: float) -> None:
        self.histograms[name].observe(value)


@dataclass
class RequestMetrics:
    """One request's timestamps (``time.perf_counter``), observed as its deltas go out."""

    metrics: WorkerMetrics
    arrival: float
    n: int  # samples
    judge: Callable[[int], tuple[int, str | None]] | None = None
    first_token: float | None = None
    last_delta: float | None = None
    first_by_sample: dict[int, float] = field(default_factory=dict)
    tokens_by_sample: dict[int, int] = field(default_factory=dict)
    finished: set[int] = field(default_factory=set)

    def delivered(self, now: float, outs: list[TokenDelta], scheduled_at: float | None) -> None:
        """One delta (one output per sample) is going out at ``now``; ``scheduled_at``: when
        the engine step that first scheduled the request began."""
        m = self.metrics
        new_tokens = sum(len(o.token_ids) for o in outs)
        if new_tokens:
            m.counters["vllm_generation_tokens"].inc(new_tokens)
            if self.first_token is None:
                self.first_token = now
                prompt = outs[0].num_prompt_tokens
                m.counters["vllm_prompt_tokens"].inc(prompt)
                m.observe("vllm_request_prompt_tokens", prompt)
                m.observe("vllm_time_to_first_token_seconds", now - self.arrival)
                if self.judge is not None:
                    m.judged(*self.judge(outs[0].num_cached_tokens))
                if scheduled_at is not None:
                    m.observe("vllm_request_queue_time_seconds", scheduled_at - self.arrival)
                    m.observe("vllm_request_prefill_time_seconds", now - scheduled_at)
            else:
                m.observe("vllm_inter_token_latency_seconds", now - self.last_delta)
            self.last_delta = now
        for out in outs:
            if out.token_ids:
                self.first_by_sample.setdefault(out.index, now)
                self.tokens_by_sample[out.index] = (self.tokens_by_sample.get(out.index, 0)
                                                    + len(out.token_ids))
            if out.finished and out.index not in self.finished:
                self._finish(out.index, now, out.finish_reason or "stop")

    def abandoned(self, now: float, reason: str) -> None:
        """The stream ended with samples unfinished: the caller left ("abort") or the engine
        failed them ("error")."""
        for index in range(self.n):
            if index not in self.finished:
                self._finish(index, now, reason)

    def _finish(self, index: int, now: float, reason: str) -> None:
        m = self.metrics
        self.finished.add(index)
        m.counters["vllm_request_success"].inc(tags={"finished_reason": reason})
        m.observe("vllm_e2e_request_latency_seconds", now - self.arrival)
        tokens = self.tokens_by_sample.get(index, 0)
        m.observe("vllm_request_generation_tokens", tokens)
        first = self.first_by_sample.get(index)
        if first is not None:
            m.observe("vllm_request_decode_time_seconds", now - first)
            if tokens > 1:
                m.observe("vllm_request_time_per_output_token_seconds",
                          (now - first) / (tokens - 1))
