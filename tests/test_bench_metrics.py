"""Metric maths on hand-made timelines: TTFT, ITL, TPOT, E2E, percentiles, goodput."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from prefixserve.bench.cli import build_parser
from prefixserve.bench.load.load import arrival_offsets
from prefixserve.bench.load.metrics import (
    RequestResult,
    from_timeline,
    parse_goodput,
    percentile_key,
    summarize,
)
from prefixserve.bench.load.options import parse_percentile_metrics, parse_percentiles


def _req(send: float, times: list[float], out: int, **kw) -> RequestResult:
    return from_timeline(send, times, out, **kw)


def test_timeline_to_ttft_itl_tpot_e2el() -> None:
    r = _req(10.0, [10.2, 10.3, 10.5, 10.6], out=4, prompt_len=100)
    assert r.success
    assert r.ttft == pytest.approx(0.2)
    assert r.itl == pytest.approx([0.1, 0.2, 0.1])
    assert r.latency == pytest.approx(0.6)
    assert r.tpot == pytest.approx((0.6 - 0.2) / 3)


def test_tpot_uses_token_count_not_event_count() -> None:
    # 2 events carried 9 tokens: TPOT divides by tokens - 1, ITL has one gap per event gap.
    r = _req(0.0, [0.5, 1.3], out=9)
    assert r.itl == pytest.approx([0.8])
    assert r.tpot == pytest.approx(0.8 / 8)


def test_single_token_has_no_tpot_and_no_content_fails() -> None:
    assert _req(0.0, [0.4], out=1).tpot is None
    failed = _req(0.0, [], out=0)
    assert not failed.success and failed.tpot is None


def test_summary_throughputs_percentiles_and_hit_rate() -> None:
    results = [
        _req(0.0, [0.1 * (i + 1), 0.1 * (i + 1) + 0.05], out=2, prompt_len=10,
             cached_tokens=5 if i % 2 else 0, worker=f"w{i % 2}", start_time=float(i))
        for i in range(10)
    ]
    results.append(RequestResult(success=False, error="HTTP 500", prompt_len=10))
    s = summarize(results, duration=5.0, percentiles=[50, 90, 99],
                  percentile_metrics=["ttft", "tpot", "itl", "e2el"])
    assert s["completed"] == 10 and s["failed"] == 1 and s["num_prompts"] == 11
    assert s["total_input_tokens"] == 100 and s["total_output_tokens"] == 20
    assert s["request_throughput"] == pytest.approx(2.0)
    assert s["output_throughput"] == pytest.approx(4.0)
    assert s["total_token_throughput"] == pytest.approx(24.0)
    ttfts_ms = np.array([100.0 * (i + 1) for i in range(10)])
    assert s["mean_ttft_ms"] == pytest.approx(550.0)
    assert s["median_ttft_ms"] == pytest.approx(550.0)
    assert s["std_ttft_ms"] == pytest.approx(float(np.std(ttfts_ms)))
    assert s["p90_ttft_ms"] == pytest.approx(910.0)           # linear interpolation
    assert s["p99_ttft_ms"] == pytest.approx(991.0)
    assert s["mean_itl_ms"] == pytest.approx(50.0)
    assert s["mean_tpot_ms"] == pytest.approx(50.0)
    assert s["mean_e2el_ms"] == pytest.approx(600.0)
    assert s["p50_e2el_ms"] == pytest.approx(600.0)
    assert s["p99_tpot_ms"] == pytest.approx(50.0) and s["p90_itl_ms"] == pytest.approx(50.0)
    assert s["prefix_hit_rate"] == pytest.approx(25 / 100)
    assert s["per_worker_requests"] == {"w0": 5, "w1": 5}
    assert s["request_goodput"] is None
    assert s["error_counts"] == {"HTTP 500": 1}


def test_goodput_counts_requests_meeting_every_slo() -> None:
    fast = _req(0.0, [0.1, 0.12, 0.14], out=3)      # ttft 100 ms, tpot 20 ms, e2el 140 ms
    slow_ttft = _req(0.0, [0.5, 0.52], out=2)        # ttft 500 ms
    slow_tpot = _req(0.0, [0.1, 0.4], out=2)         # tpot 300 ms
    results = [fast, slow_ttft, slow_tpot]
    slos = parse_goodput(["ttft:200", "tpot:50"])
    assert slos == {"ttft": 200.0, "tpot": 50.0}
    assert summarize(results, 2.0, slos)["request_goodput"] == pytest.approx(0.5)
    only_e2el = summarize(results, 1.0, parse_goodput(["e2el:450"]))
    assert only_e2el["request_goodput"] == pytest.approx(2.0)   # fast and slow_tpot
    with pytest.raises(ValueError):
        parse_goodput(["latency:5"])


def test_unknown_cached_tokens_give_no_hit_rate() -> None:
    s = summarize([_req(0.0, [0.1], out=1, prompt_len=8)], 1.0)
    assert s["prefix_hit_rate"] is None


def test_peak_concurrency_counts_successful_requests_and_ends_before_starts() -> None:
    rs = [_req(0.0, [1.0], out=1, start_time=t) for t in (0.0, 0.5, 0.9, 2.0)]
    assert summarize(rs, 3.0)["max_concurrent_requests"] == 3
    # one ends at 1.0 as the next starts: [start, end) intervals do not overlap (vLLM's sweep)
    touching = [_req(0.0, [1.0], out=1, start_time=t) for t in (0.0, 1.0, 2.0)]
    assert summarize(touching, 3.0)["max_concurrent_requests"] == 1
    failed = RequestResult(success=False, error="x", start_time=0.2, latency=5.0)
    assert summarize([*rs, failed], 3.0)["max_concurrent_requests"] == 3


# What `vllm bench serve` writes for one run (vllm/benchmarks/serve.py), less its setup fields
# (tests/test_bench_client.py pins those in a written file) and the per-request lists.
VLLM_FIELDS = {
    "num_prompts", "duration", "completed", "failed", "total_input_tokens",
    "total_output_tokens", "request_throughput", "request_goodput", "output_throughput",
    "total_token_throughput", "max_concurrent_requests",
    *(f"{stat}_{m}_ms" for stat in ("mean", "median", "std")
      for m in ("ttft", "tpot", "itl", "e2el")),
}


def test_summary_uses_vllm_names_and_its_default_percentiles() -> None:
    s = summarize([_req(0.0, [0.1, 0.2, 0.3], out=3, prompt_len=4)], 1.0)
    assert set(s) >= VLLM_FIELDS, VLLM_FIELDS - set(s)
    # by default (vLLM's --metric-percentiles 99 --percentile-metrics ttft,tpot,itl) p99 of
    # three metrics and no other percentile
    assert sorted(k for k in s if re.fullmatch(r"p[\d.]+_\w+_ms", k)) == [
        "p99_itl_ms", "p99_tpot_ms", "p99_ttft_ms"]
    ours = set(s) - VLLM_FIELDS - {"p99_itl_ms", "p99_tpot_ms", "p99_ttft_ms"}
    assert ours == {"prefix_hit_rate", "total_cached_tokens", "per_worker_requests",
                    "error_counts"}


def test_percentile_flags_choose_the_pnn_fields() -> None:
    rs = [_req(0.0, [0.1 * (i + 1), 0.1 * (i + 1) + 0.05], out=2) for i in range(10)]
    s = summarize(rs, 1.0, percentiles=[25, 99.9], percentile_metrics=["e2el"])
    assert sorted(k for k in s if re.fullmatch(r"p[\d.]+_\w+_ms", k)) == [
        "p25_e2el_ms", "p99.9_e2el_ms"]
    assert s["p25_e2el_ms"] == pytest.approx(float(np.percentile(
        [100.0 * (i + 1) + 50 for i in range(10)], 25)))
    assert "mean_ttft_ms" in s and "std_itl_ms" in s          # mean/median/std stay for all
    assert percentile_key(99.0, "ttft") == "p99_ttft_ms"
    assert percentile_key(99.9, "itl") == "p99.9_itl_ms"
    assert percentile_key(0.5, "tpot") == "p0.5_tpot_ms"


def test_percentile_flags_parse_as_vllm_reads_them() -> None:
    ns = build_parser().parse_args(["run"])
    assert ns.metric_percentiles == "99" and ns.percentile_metrics == "ttft,tpot,itl"
    assert parse_percentiles(ns.metric_percentiles) == [99.0]
    assert parse_percentiles("25, 50,99.9") == [25.0, 50.0, 99.9]
    assert parse_percentile_metrics(ns.percentile_metrics) == ["ttft", "tpot", "itl"]
    assert parse_percentile_metrics("e2el,ttft") == ["e2el", "ttft"]
    for bad in ("", "p99", "101", "-1"):
        with pytest.raises(SystemExit):
            parse_percentiles(bad)
    for bad in ("", "ttft,latency", "TTFT"):
        with pytest.raises(SystemExit):
            parse_percentile_metrics(bad)


def test_arrivals_poisson_mean_gap_and_seed() -> None:
    a = arrival_offsets(4001, rate=20.0, burstiness=1.0, seed=3)
    assert a[0] == 0.0
    gaps = np.diff(a)
    assert gaps.mean() == pytest.approx(1 / 20, rel=0.05)
    assert gaps.std() == pytest.approx(1 / 20, rel=0.08)      # exponential: std == mean
    assert a == arrival_offsets(4001, 20.0, 1.0, seed=3)
    assert a != arrival_offsets(4001, 20.0, 1.0, seed=4)


def test_arrivals_burstiness_changes_spread_not_mean() -> None:
    bursty = np.diff(arrival_offsets(4001, 10.0, burstiness=0.25, seed=1))
    regular = np.diff(arrival_offsets(4001, 10.0, burstiness=4.0, seed=1))
    assert bursty.mean() == pytest.approx(0.1, rel=0.1)
    assert regular.mean() == pytest.approx(0.1, rel=0.05)
    # gamma(k): coefficient of variation 1/sqrt(k)
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.15)
    assert regular.std() / regular.mean() == pytest.approx(0.5, rel=0.1)
    assert arrival_offsets(3, math.inf) == [0.0, 0.0, 0.0]
