"""Routing-latency figures from Ray's Prometheus text (bench/load/router_metrics.py), no Ray
needed."""

from __future__ import annotations

import asyncio

import pytest

from prefixserve.bench.load.report import format_side_by_side
from prefixserve.bench.load.router_metrics import Histogram, index_truth, parse, summarize
from prefixserve.bench.load.runner import run_sweep

TAGS = 'Component="core_worker",application="a",deployment="LLMWorker"'


def exposition(counts: dict[str, int], total: float, extra_tags: str = "") -> str:
    """Prometheus text of ray_prefixserve_router_latency_seconds with cumulative bucket counts."""
    lines = ["# HELP ray_prefixserve_router_latency_seconds Time to rank replicas",
             "# TYPE ray_prefixserve_router_latency_seconds histogram"]
    for le, n in counts.items():
        lines.append(f'ray_prefixserve_router_latency_seconds_bucket{{{TAGS}{extra_tags},le="{le}"}}'
                     f" {n}.0")
    n = counts["+Inf"]
    lines.append(f"ray_prefixserve_router_latency_seconds_count{{{TAGS}{extra_tags}}} {n}.0")
    lines.append(f"ray_prefixserve_router_latency_seconds_sum{{{TAGS}{extra_tags}}} {total}")
    lines.append('ray_prefixserve_router_matched_blocks_count{Component="x"} 99.0')
    return "\n".join(lines) + "\n"


def test_parse_sums_tag_sets_and_ignores_other_metrics() -> None:
    a = exposition({"1.0": 2, "2.0": 5, "+Inf": 6}, 9.0)
    b = exposition({"1.0": 1, "2.0": 1, "+Inf": 1}, 0.5, extra_tags=',pid="7"')
    hist = parse(a + b)
    assert hist.buckets == {1.0: 3.0, 2.0: 6.0, float("inf"): 7.0}
    assert hist.count == 7.0 and hist.total == 9.5


def test_quantiles_interpolate_inside_buckets_like_prometheus() -> None:
    hist = Histogram({1.0: 0.0, 2.0: 50.0, 5.0: 100.0, float("inf"): 100.0}, 100.0, 250.0)
    assert hist.quantile(0.5) == pytest.approx(2.0)
    assert hist.quantile(0.25) == pytest.approx(1.5)
    assert hist.quantile(0.99) == pytest.approx(2.0 + 3.0 * 49 / 50)
    beyond = Histogram({1.0: 1.0, float("inf"): 10.0}, 10.0, 50.0)
    assert beyond.quantile(0.99) == 1.0          # past the last finite bound: that bound
    assert Histogram().quantile(0.5) is None


def test_summarize_is_the_difference_of_two_scrapes() -> None:
    before = parse(exposition({"0.001": 10, "0.002": 10, "+Inf": 10}, 0.005))
    after = parse(exposition({"0.001": 10, "0.002": 30, "+Inf": 30}, 0.035))  # seconds -> ms
    figures = summarize(before, after)
    assert figures["router_latency_samples"] == 20
    assert figures["mean_router_latency_ms"] == pytest.approx(1.5)
    assert figures["median_router_latency_ms"] == pytest.approx(1.5)
    assert summarize(after, after) == {}       # no samples (pow2: router not instrumented)


def test_side_by_side_shows_rows_only_some_runs_have() -> None:
    base = {"completed": 4, "failed": 0, "duration": 1.0, "mean_ttft_ms": 1.0}
    table = format_side_by_side({"pow2": base,
                                 "prefix": {**base, "median_router_latency_ms": 1.25}})
    row = next(line for line in table.splitlines() if line.startswith("Median routing"))
    assert row.split()[-3:] == ["-", "1.250", "-"]      # pow2, prefix, prefix/pow2


def test_run_sweep_merges_measured_figures(monkeypatch: pytest.MonkeyPatch) -> None:
    import prefixserve.bench.load.runner as runner

    calls: list[str] = []

    async def fake_run_once(spec, workload, label="run"):
        calls.append(f"run {label}")
        return runner.RunResult(label, {"completed": 1}, [], spec.shape.request_rate)

    def measure(name: str, figures: dict):
        async def start():
            calls.append(f"{name} before")

            async def finish() -> dict:
                calls.append(f"{name} after")
                return figures

            return finish

        return start

    monkeypatch.setattr(runner, "run_once", fake_run_once)
    spec = runner.RunSpec(None, runner.LoadShape(), runner.Tokens(256, 0))  # type: ignore[arg-type]
    measures = [measure("a", {"router_latency_samples": 3}), measure("b", {"own_cpu_cores": 1.5})]
    points = asyncio.run(run_sweep(spec, lambda t: [], [1.0, 2.0], label="p", measures=measures))
    once = ["a before", "b before", "run p@{}", "b after", "a after"]
    assert calls == [c.format(1) for c in once] + [c.format(2) for c in once]
    assert all(p.summary == {"completed": 1, "router_latency_samples": 3, "own_cpu_cores": 1.5}
               for p in points)


def truth_exposition(judged: int, off: dict[str, int], lag: dict[str, int]) -> str:
    """The workers' index-truth series as Ray exports them (two workers' tag sets)."""
    lines = []
    for worker, share in (("w1", 1), ("w2", 0)):
        tags = f'Component="core_worker",worker="{worker}"'
        lines.append(f'ray_prefixserve_index_error_blocks_bucket{{{tags},direction="none",'
                     f'le="+Inf"}} {judged * share}.0')
        lines.append(f"ray_prefixserve_index_error_blocks_count{{{tags}}} {judged * share}.0")
        for cause, n in off.items():
            lines.append(f'ray_prefixserve_index_mispredicted_total{{{tags},cause="{cause}"}} '
                         f"{n * share}.0")
        for le, n in lag.items():
            lines.append(f'ray_prefixserve_index_event_lag_seconds_bucket{{{tags},le="{le}"}} '
                         f"{n * share}.0")
        lines.append(f"ray_prefixserve_index_event_lag_seconds_count{{{tags}}} "
                     f"{lag['+Inf'] * share}.0")
    for le, n in lag.items():  # the router's copy (one process, no worker tags)
        lines.append(f'ray_prefixserve_router_follower_lag_seconds_bucket{{le="{le}"}} {n}.0')
    lines.append(f"ray_prefixserve_router_follower_lag_seconds_count {lag['+Inf']}.0")
    return "\n".join(lines) + "\n"


def test_index_truth_is_the_difference_of_two_scrapes_per_cause() -> None:
    before = truth_exposition(10, {"evicted": 1}, {"0.01": 10, "+Inf": 10})
    after = truth_exposition(210, {"evicted": 3, "never_stored": 1},
                             {"0.01": 110, "0.1": 210, "+Inf": 210})
    figures = index_truth(before, after)
    assert figures["index_judged"] == 200 and figures["index_off_share"] == 3 / 200
    assert (figures["index_off_evicted"], figures["index_off_never_stored"],
            figures["index_off_serve"]) == (2, 1, 0)
    assert figures["median_index_lag_ms"] == pytest.approx(10.0)
    assert 90.0 < figures["p99_index_lag_ms"] <= 100.0
    assert figures["median_follower_lag_ms"] == pytest.approx(10.0)
    assert index_truth(after, after) == {}  # nothing judged, no lag observed
    table = format_side_by_side({"prefix": figures})
    assert "Index off by > 1 block (share)" in table and "0.0150" in table
