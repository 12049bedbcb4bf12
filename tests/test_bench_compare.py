"""`bench compare`'s tables over several interleaved launches: medians and per-launch ratios."""

from __future__ import annotations

import math

from prefixserve.bench.load.compare import side_by_side
from prefixserve.bench.load.outputs import busiest_first_sums
from prefixserve.bench.load.report import (
    format_side_by_side,
    median_summary,
    pooled_label,
    ratio,
    tail_key,
)
from prefixserve.bench.load.runner import RunResult


def point(label: str, throughput: float, ttft: float, workers: dict | None = None) -> RunResult:
    summary = {"completed": 128, "request_throughput": throughput, "median_ttft_ms": ttft,
               "p90_ttft_ms": 2 * ttft, "prefix_hit_rate": 0.5, "per_worker_requests": workers}
    return RunResult(label, summary, [], math.inf)


def test_median_summary_takes_numbers_per_figure_and_keeps_the_rest() -> None:
    a = point("a", 10.0, 300.0, {"w1": 60})
    b = point("b", 12.0, 100.0, {"w1": 70})
    c = point("c", 8.0, 200.0, {"w1": 80})
    med = median_summary([a.summary, b.summary, c.summary])
    assert med["request_throughput"] == 10.0 and med["median_ttft_ms"] == 200.0
    assert med["completed"] == 128 and med["per_worker_requests"] == {"w1": 60}
    # a burst's rate is inf in every launch: its median too (an interpolation would give NaN)
    assert median_summary([{"request_rate": math.inf}] * 2) == {"request_rate": math.inf}


def test_side_by_side_over_launches_prints_medians_and_each_launch_ratio() -> None:
    runs = {
        "prefix": [[point("prefix#1@inf", 12.0, 100.0)], [point("prefix#2@inf", 10.0, 300.0)],
                   [point("prefix#3@inf", 11.0, 200.0)]],
        "pow2": [[point("pow2#1@inf", 6.0, 400.0)], [point("pow2#2@inf", 10.0, 300.0)],
                 [point("pow2#3@inf", 8.8, 100.0)]],
    }
    text = side_by_side(runs)
    assert "median of 3 launches per policy" in text
    throughput_row = next(line for line in text.splitlines()
                          if line.startswith("Request throughput"))
    assert throughput_row.split()[-3:] == ["11.00", "8.80", "0.80x"]  # medians, pow2/prefix
    assert "pow2/prefix throughput per launch: 0.50x 1.00x 0.80x" in text
    assert "pow2/prefix TTFT p50 per launch: 4.00x 1.00x 0.50x" in text
    assert "CPU of other processes" not in text  # launches without the CPU reading


def test_the_tail_ratio_follows_the_chosen_percentiles() -> None:
    runs = {name: [[point(f"{name}#{k}@inf", 10.0, 100.0 * k)] for k in (1, 2)]
            for name in ("prefix", "pow2")}
    for reps in runs.values():
        for (r,) in reps:
            r.summary["p99.9_ttft_ms"] = 3 * r.summary["median_ttft_ms"]
            r.summary["p99_e2el_ms"] = 1.0
    runs["pow2"][1][0].summary["p99.9_ttft_ms"] = 1200.0
    text = side_by_side(runs)
    assert "pow2/prefix TTFT p99.9 per launch: 1.00x 2.00x" in text
    assert "TTFT p90 per launch" not in text


def test_tail_key_is_the_highest_percentile_written_else_the_median() -> None:
    assert tail_key({"p50_ttft_ms": 1, "p99_ttft_ms": 2, "p99.9_itl_ms": 3}) == "p99_ttft_ms"
    assert tail_key({"p99_ttft_ms": 1, "p99.9_ttft_ms": 2}) == "p99.9_ttft_ms"
    assert tail_key({"p99_e2el_ms": 1, "median_ttft_ms": 2}) == "median_ttft_ms"
    assert tail_key({"p99_e2el_ms": 1}, "e2el") == "p99_e2el_ms"


def test_table_shows_the_concurrency_limit_and_no_ratio_of_infinities() -> None:
    a = {"completed": 4, "max_concurrency": 8, "request_rate": math.inf,
         "max_concurrent_requests": 8, "request_throughput": 2.0}
    b = {**a, "max_concurrent_requests": 6, "request_throughput": 1.0}
    lines = format_side_by_side({"prefix": a, "pow2": b}).splitlines()
    row = {line[:34].strip(): line[34:].split() for line in lines[2:]}
    assert row["Maximum request concurrency"] == ["8", "8", "1.00x"]
    assert row["Request rate configured (RPS)"] == ["inf", "inf", "-"]
    assert row["Peak concurrent requests"] == ["8", "6", "0.75x"]
    assert ratio(math.inf, 2.0) == "-" and ratio(3.0, 2.0) == "1.50x"
    unlimited = format_side_by_side({"x": {**a, "max_concurrency": None}}, ratios=False)
    assert "Maximum request concurrency" not in unlimited


def test_each_launch_shows_the_cpu_other_processes_took() -> None:
    runs = {name: [[point(f"{name}#{k}@inf", 10.0, 100.0)] for k in (1, 2)]
            for name in ("prefix", "pow2")}
    for k, cores in enumerate((0.05, 1.2)):
        runs["pow2"][k][0].summary["other_cpu_cores"] = cores
        runs["prefix"][k][0].summary["other_cpu_cores"] = 0.01
    text = side_by_side(runs)
    assert "pow2 CPU of other processes per launch (cores): 0.05 1.20" in text
    assert "prefix CPU of other processes per launch (cores): 0.01 0.01" in text


def test_one_launch_keeps_the_plain_table() -> None:
    runs = {"prefix": [[point("prefix@inf", 12.0, 100.0)]],
            "pow2": [[point("pow2@inf", 6.0, 400.0)]]}
    text = side_by_side(runs)
    assert "median" not in text and "per launch" not in text
    assert "0.50x" in text


def test_launches_pool_into_one_plot_line_per_policy_and_rate() -> None:
    assert pooled_label("prefix#2@16") == "prefix@16"
    assert pooled_label("round_robin#10@inf") == "round_robin@inf"
    assert pooled_label("prefix@16") == "prefix@16"
    assert pooled_label("run#1") == "run"


def test_worker_counts_add_up_by_rank_across_launches() -> None:
    runs = [point("p#1@inf", 1, 1, {"a": 60, "b": 68}), point("p#2@inf", 1, 1, {"c": 70, "d": 58})]
    assert busiest_first_sums(runs) == {"#1": 138, "#2": 118}
