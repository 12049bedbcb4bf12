"""`bench compare`'s tables over several interleaved launches: medians and per-launch ratios."""

from __future__ import annotations

import math

from bench.compare import side_by_side
from bench.outputs import busiest_first_sums
from bench.report import median_summary, pooled_label
from bench.runner import RunResult


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
