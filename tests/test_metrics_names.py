"""Exported metric names: what Ray's Serve LLM dashboard and deploy/grafana query is what we export.

The dashboard side is read from the installed ray (its panel definitions) and from the JSON in
deploy/grafana; our side from workers.worker_metrics' tables and the router's source, never from
a hand-kept list.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import ray.dashboard.modules.metrics.dashboards as ray_dashboards
import yaml
from test_router_state import ABC, TOKENS_A, lookup, state

from prefixserve.router.decision_types import Outcome
from prefixserve.router.request import TokenDelta
from prefixserve.workers.engine_types import EngineStats, LoRAStats
from prefixserve.workers.kv_tiers.base import TierCounters
from prefixserve.workers.worker_metrics import COUNTERS, TAG_KEYS, WorkerMetrics, exported_series

ROOT = Path(__file__).resolve().parent.parent
PANELS = Path(ray_dashboards.__file__).parent / "serve_llm_dashboard_panels.py"
PANELS_BASE = PANELS.with_name("serve_llm_grafana_dashboard_base.json")
ROUTING_DASHBOARD = ROOT / "deploy" / "grafana" / "prefixserve-routing.json"
KUBERAY = ROOT / "deploy" / "kuberay"
# What the vLLM engine has and prefixserve's does not: disaggregated-prefill transfers (NIXL),
# the offload connector's transfer-size histograms, per-direction buffer usage and lookup
# delay, swapping (gone in vLLM V1 too).
NOT_APPLICABLE = ("ray_vllm_nixl_", "ray_vllm_kv_offload_store_size",
                  "ray_vllm_kv_offload_load_size", "ray_vllm_kv_offload_cpu_cache_read",
                  "ray_vllm_kv_offload_cpu_cache_write", "ray_vllm_kv_offload_lookup_sync",
                  "ray_vllm_num_requests_swapped")
CORE = {
    "ray_vllm_prompt_tokens_total", "ray_vllm_generation_tokens_total",
    "ray_vllm_request_success_total", "ray_vllm_prefix_cache_queries_total",
    "ray_vllm_prefix_cache_hits_total", "ray_vllm_time_to_first_token_seconds",
    "ray_vllm_request_time_per_output_token_seconds", "ray_vllm_e2e_request_latency_seconds",
    "ray_vllm_request_queue_time_seconds_sum", "ray_vllm_num_requests_running",
    "ray_vllm_num_requests_waiting", "ray_vllm_kv_cache_usage_perc",
}


def queried(text: str, prefix: str) -> set[str]:
    return set(re.findall(rf"\b{prefix}[a-z0-9_]+", text))


def is_exported(name: str, exported: set[str]) -> bool:
    """A series, or a histogram's base name (the panels' helpers add _bucket/_sum/_count)."""
    return name in exported or f"{name}_bucket" in exported


def test_every_applicable_serve_llm_panel_series_is_exported() -> None:
    names = queried(PANELS.read_text() + PANELS_BASE.read_text(), "ray_vllm_")
    assert names >= CORE  # the parse still finds what the dashboard is known to query
    wanted = {n for n in names if not n.startswith(NOT_APPLICABLE)}
    exported = exported_series()
    assert {n for n in wanted if not is_exported(n, exported)} == set()


def test_labels_the_panels_filter_and_group_on() -> None:
    text = PANELS.read_text()
    assert 'model_name=~"$vllm_model_name"' in text and "model_name" in TAG_KEYS
    # WorkerId is Ray's own tag on every series a worker process records (the cluster test sees
    # it); a tag of ours by that name would clash with it.
    assert 'WorkerId=~"$workerid"' in text and "WorkerId" not in TAG_KEYS
    assert "by(finished_reason, WorkerId) (increase(ray_vllm_request_success_total" in text
    m = WorkerMetrics("r1", "m")
    assert "finished_reason" in m.counters["vllm_request_success"]._tag_keys
    assert set(COUNTERS) == set(m.counters)


# ------------------------------------------------------------------ observed values


class Recorder:
    def __init__(self) -> None:
        self.values: list[tuple[float, dict[str, str] | None]] = []

    def inc(self, value: float = 1.0, tags: dict[str, str] | None = None) -> None:
        self.values.append((value, tags))

    observe = set = inc

    def total(self) -> float:
        return sum(v for v, _ in self.values)


def recorded() -> WorkerMetrics:
    m = WorkerMetrics("r1", "m")
    m.host_usage = Recorder()
    for table in (m.counters, m.gauges, m.histograms, m.tier_counters):
        for name in table:
            table[name] = Recorder()
    return m


def out(index: int, tokens: int, finished: bool = False, reason: str | None = None
        ) -> TokenDelta:
    return TokenDelta(index, list(range(tokens)), None, finished, reason, 10, 4, "w")


def values(m: WorkerMetrics, name: str) -> list[Any]:
    table = m.histograms if name in m.histograms else m.counters
    return [v for v, _ in table[name].values]


def test_request_timings_from_arrival_schedule_and_deltas() -> None:
    m = recorded()
    r = m.request(arrival=100.0, n=2)
    r.delivered(100.5, [out(0, 1), out(1, 1)], scheduled_at=100.2)
    r.delivered(101.0, [out(0, 2, True, "stop"), out(1, 1)], scheduled_at=100.2)
    r.delivered(102.5, [out(1, 3, True, "length")], scheduled_at=100.2)
    assert values(m, "vllm_time_to_first_token_seconds") == [pytest.approx(0.5)]
    assert values(m, "vllm_request_queue_time_seconds") == [pytest.approx(0.2)]
    assert values(m, "vllm_request_prefill_time_seconds") == [pytest.approx(0.3)]
    assert values(m, "vllm_inter_token_latency_seconds") == [pytest.approx(0.5),
                                                             pytest.approx(1.5)]
    assert values(m, "vllm_prompt_tokens") == [10]  # once per request
    assert m.counters["vllm_generation_tokens"].total() == 8
    assert values(m, "vllm_e2e_request_latency_seconds") == [pytest.approx(1.0),
                                                             pytest.approx(2.5)]
    # sample 0: 3 tokens, first at 100.5, last at 101.0; sample 1: 5 tokens, 100.5 .. 102.5
    assert values(m, "vllm_request_time_per_output_token_seconds") == [
        pytest.approx(0.25), pytest.approx(0.5)]
    assert values(m, "vllm_request_decode_time_seconds") == [pytest.approx(0.5),
                                                             pytest.approx(2.0)]
    assert values(m, "vllm_request_generation_tokens") == [3, 5]
    reasons = [t["finished_reason"] for _, t in m.counters["vllm_request_success"].values]
    assert reasons == ["stop", "length"]
    r.abandoned(103.0, "abort")  # nothing left unfinished: nothing counted twice
    assert len(m.counters["vllm_request_success"].values) == 2


def test_abandoned_samples_count_once_with_the_reason() -> None:
    m = recorded()
    r = m.request(arrival=0.0, n=3)
    r.delivered(1.0, [out(0, 1), out(1, 0, True, "abort"), out(2, 1)], scheduled_at=None)
    r.abandoned(2.0, "abort")
    reasons = sorted(t["finished_reason"] for _, t in m.counters["vllm_request_success"].values)
    assert reasons == ["abort", "abort", "abort"]
    assert values(m, "vllm_request_queue_time_seconds") == []  # never seen scheduled
    assert values(m, "vllm_request_time_per_output_token_seconds") == []  # 1 token each


def test_snapshot_counters_take_increments_of_the_engine_totals() -> None:
    m = recorded()
    stats = EngineStats(100, 40, 0.5, 3, 2, 0, 0.0, 0.0, 10, 20, num_preemptions=1,
                        lora=LoRAStats(loads=3, reads=2, evictions=1))
    m.update(stats)
    m.update(EngineStats(150, 40, 0.25, 1, 0, 0, 0.0, 0.0, 15, 20, num_preemptions=1,
                         lora=LoRAStats(loads=5, reads=2, evictions=2)))
    assert values(m, "vllm_prefix_cache_queries") == [100, 50]
    assert values(m, "vllm_prefix_cache_hits") == [40]
    assert values(m, "vllm_num_preemptions") == [1]
    assert values(m, "prefixserve_lora_loads") == [3, 2]
    assert values(m, "prefixserve_lora_reads") == [2]
    assert values(m, "prefixserve_lora_evictions") == [1, 1]
    assert [v for v, _ in m.gauges["vllm_kv_cache_usage_perc"].values] == [0.5, 0.25]


def test_kv_tier_counters_take_increments_per_medium_and_reason() -> None:
    m = recorded()
    first = TierCounters(offloaded_bytes=Counter(host=100), loaded_bytes=Counter(disk=40),
                         load_failures=Counter(checksum=1), host_usage=0.5)
    m.update(EngineStats(10, 0, 0.0, 0, 0, 0, 0.0, 0.0, 1, 2, external_tokens_queried=10,
                         external_tokens_hit=8, tiers=first))
    second = TierCounters(offloaded_bytes=Counter(host=150, disk=30),
                          loaded_bytes=Counter(disk=40), load_failures=Counter(checksum=1,
                                                                               missing=2))
    m.update(EngineStats(20, 0, 0.0, 0, 0, 0, 0.0, 0.0, 1, 2, external_tokens_queried=18,
                         external_tokens_hit=8, tiers=second))
    assert m.tier_counters["vllm_kv_offload_store_bytes"].values == [
        (100, {"medium": "host"}), (50, {"medium": "host"}), (30, {"medium": "disk"})]
    assert m.tier_counters["vllm_kv_offload_load_bytes"].values == [(40, {"medium": "disk"})]
    assert m.tier_counters["prefixserve_kv_offload_load_failures"].values == [
        (1, {"reason": "checksum"}), (2, {"reason": "missing"})]
    assert values(m, "vllm_external_prefix_cache_queries") == [10, 8]
    assert values(m, "vllm_external_prefix_cache_hits") == [8]
    assert [v for v, _ in m.host_usage.values] == [0.5, 0.0]


def test_lora_requests_info_names_the_running_and_waiting_adapters() -> None:
    """vLLM's gauge: the adapters in its labels, when they were updated as its value; an
    engine without adapters leaves it unset."""
    m = recorded()
    m.lora_info = Recorder()
    m.update(EngineStats(0, 0, 0.0, 0, 0, 0, 0.0, 0.0, 10, 20))
    assert m.lora_info.values == []
    m.update(EngineStats(0, 0, 0.0, 2, 1, 0, 0.0, 0.0, 10, 20,
                         lora=LoRAStats(registered=5, max_loras=3),
                         running_loras=("a", "b"), waiting_loras=("c",)))
    [(value, tags)] = m.lora_info.values
    assert tags == {"running_lora_adapters": "a,b", "waiting_lora_adapters": "c",
                    "max_lora": "3"}
    assert value > 1.7e9  # a Unix time
    assert "ray_vllm_lora_requests_info" in exported_series()


# ------------------------------------------------------------------ router: spill


def test_outcome_spill_reasons_from_the_ranking() -> None:
    st = state()
    ctx = st.context(1, [*TOKENS_A, 1, 2, 3], None, now=0.0)
    ranking = st.rank(1, ctx, ABC, lookup(a=0, b=6, c=2), now=0.0)
    st.note_routed(1, ranking[0].key, ctx, "r1", now=0.0)  # b, the deepest
    assert st.outcome(1, "b") == Outcome(6, None)
    assert st.outcome(1, "c") == Outcome(2, "serve")  # Serve passed over the first choice
    st.note_routed(1, "a", ctx, "r1", now=0.0)  # had the ranking put a (no match) first
    assert st.outcome(1, "a") == Outcome(0, "cost")
    assert st.outcome(99, "a") is None  # never ranked here (not a generate call)


def test_no_spill_when_nothing_matched() -> None:
    st = state()
    ctx = st.context(1, TOKENS_A, None, now=0.0)
    st.rank(1, ctx, ABC, lookup(a=0, b=0, c=0), now=0.0)
    st.note_routed(1, "a", ctx, "r1", now=0.0)
    assert st.outcome(1, "c") == Outcome(0, None)


# ------------------------------------------------------------------ deploy/grafana


def router_series() -> set[str]:
    """Series the router exports, from its ray.util.metrics constructors."""
    source = (ROOT / "router" / "request_router.py").read_text()
    series = set()
    for kind, name in re.findall(r'metrics\.(Counter|Histogram|Gauge)\(\s*"([a-z0-9_]+)"',
                                 source):
        series |= {"Counter": {f"ray_{name}_total"}, "Gauge": {f"ray_{name}"},
                   "Histogram": {f"ray_{name}_{s}" for s in ("bucket", "sum", "count")}}[kind]
    return series


def test_router_metric_names_follow_the_conventions() -> None:
    series = router_series()
    assert {"ray_prefixserve_router_latency_seconds_bucket",
            "ray_prefixserve_router_spill_total",
            "ray_prefixserve_router_index_failopen_total"} <= series
    assert not any(s.endswith(("_ms_bucket", "_total_total")) for s in series)


def test_routing_dashboard_queries_only_exported_series() -> None:
    dashboard = json.loads(ROUTING_DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["query"]["query"] for v in dashboard["templating"]["list"]
              if v["type"] == "query"]
    names = set(re.findall(r"\b(ray_[a-z0-9_]+)\{", "\n".join(exprs)))  # selectors only
    assert len(names) >= 8
    assert names - (exported_series() | router_series()) == set()
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for topic in ("hit rate per worker", "routing latency", "spill", "fail-open",
                  "lookup errors", "index truth", "event lag"):
        assert topic in titles
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])


def test_podmonitor_scrapes_the_metrics_port_of_head_and_workers() -> None:
    monitor = yaml.safe_load((KUBERAY / "podmonitor.yaml").read_text())
    assert monitor["kind"] == "PodMonitor"
    selector = monitor["spec"]["selector"]
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    cluster = yaml.safe_load((KUBERAY / "rayservice.yaml").read_text())["spec"]["rayClusterConfig"]
    for group in (cluster["headGroupSpec"], *cluster["workerGroupSpecs"]):
        template = group["template"]
        assert selector["matchLabels"].items() <= template["metadata"]["labels"].items()
        (container,) = template["spec"]["containers"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports[endpoint["port"]] == 8080  # KubeRay's default --metrics-export-port
