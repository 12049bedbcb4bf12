"""`bench compare`'s tables over several interleaved launches: medians and per-launch ratios."""

from __future__ import annotations

import math

from bench.compare import median_summary, side_by_side
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


def test_one_launch_keeps_the_plain_table() -> None:
    runs = {"prefix": [[point("prefix@inf", 12.0, 100.0)]],
            "pow2": [[point("pow2@inf", 6.0, 400.0)]]}
    text = side_by_side(runs)
    assert "median" not in text and "per launch" not in text
    assert "0.50x" in text
