"""Routing latency of the prefix-aware router, read from Ray's Prometheus metrics endpoint.

The router observes `prefixserve_router_latency_seconds` (a `ray.util.metrics.Histogram`) in
the process that routes (the ingress replica); Ray's metrics agent on the node exports it as
`ray_prefixserve_router_latency_seconds_{bucket,count,sum}` at `http://127.0.0.1:PORT/metrics`,
PORT
being `ray.init(_metrics_export_port=...)` (the agent runs with `include_dashboard=False` too).
The histogram is cumulative, so one run's figures are the difference of a scrape before and
one after it, and its percentiles are interpolated inside buckets as Prometheus'
`histogram_quantile` does: only as fine as the router's bucket bounds. Serve's default
power-of-two router does not observe this histogram, so pow2 runs get no routing figures.
The figures are reported in milliseconds.

The same scrapes give how true the index was (workers/index_truth.py, exported by the workers):
the requests judged, the share off by more than one block and the count per cause, the KV
event lag to the index (p50, p99), and (the router's) from the index's event log to its copy.
"""

from __future__ import annotations

import asyncio
import math
import re
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from prefixserve.workers.index_truth import CAUSES

METRIC = "ray_prefixserve_router_latency_seconds"
INDEX_ERROR = "ray_prefixserve_index_error_blocks"
INDEX_OFF = "ray_prefixserve_index_mispredicted_total"
INDEX_LAG = "ray_prefixserve_index_event_lag_seconds"
FOLLOWER_LAG = "ray_prefixserve_router_follower_lag_seconds"
_CAUSE = re.compile(r'cause="([^"]+)"')
REPORT_INTERVAL_MS = 2000      # Ray's metrics_report_interval_ms while measuring (default 10 s)
_LE = re.compile(r'le="([^"]+)"')


@dataclass
class Histogram:
    buckets: dict[float, float] = field(default_factory=dict)  # upper bound -> cumulative count
    count: float = 0.0
    total: float = 0.0

    def minus(self, earlier: Histogram) -> Histogram:
        return Histogram({le: n - earlier.buckets.get(le, 0.0) for le, n in self.buckets.items()},
                         self.count - earlier.count, self.total - earlier.total)

    def quantile(self, q: float) -> float | None:
        """Prometheus' histogram_quantile: linear inside the bucket holding rank q * count."""
        bounds = sorted(self.buckets)
        if not bounds or self.buckets[bounds[-1]] <= 0:
            return None
        rank = q * self.buckets[bounds[-1]]
        lower, below = 0.0, 0.0
        for le in bounds:
            n = self.buckets[le]
            if n >= rank:
                if math.isinf(le):
                    return lower            # past the last finite bound: that bound
                return lower + (le - lower) * (rank - below) / max(n - below, 1e-12)
            lower, below = le, n
        return bounds[-1]


def parse(text: str, name: str = METRIC) -> Histogram:
    """The histogram `name` in Prometheus text format, summed over its tag sets."""
    hist = Histogram()
    for line in text.splitlines():
        if not line.startswith(name + "_"):
            continue
        series, _, value = line.rpartition(" ")
        if series.startswith(name + "_bucket"):
            match = _LE.search(series)
            if match:
                le = float(match.group(1))
                hist.buckets[le] = hist.buckets.get(le, 0.0) + float(value)
        elif series.startswith(name + "_count"):
            hist.count += float(value)
        elif series.startswith(name + "_sum"):
            hist.total += float(value)
    return hist


def causes(text: str) -> dict[str, float]:
    """The mispredicted-request counter per cause, summed over the workers."""
    out = dict.fromkeys(CAUSES, 0.0)
    for line in text.splitlines():
        if line.startswith(INDEX_OFF) and (match := _CAUSE.search(line)):
            out[match.group(1)] = out.get(match.group(1), 0.0) + float(line.rpartition(" ")[2])
    return out


def scrape(port: int, timeout_s: float = 5.0) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout_s) as resp:
        return resp.read().decode()


def index_truth(before: str, after: str) -> dict[str, Any]:
    """How true the index was between two scrapes; {} when no request was judged (a router
    that sends no expectation, or no index)."""
    judged = parse(after, INDEX_ERROR).minus(parse(before, INDEX_ERROR)).count
    out: dict[str, Any] = {}
    for name, series in (("index", INDEX_LAG), ("follower", FOLLOWER_LAG)):
        lag = parse(after, series).minus(parse(before, series))
        if lag.count > 0:
            for key, q in ((f"median_{name}_lag_ms", 0.5), (f"p99_{name}_lag_ms", 0.99)):
                value = lag.quantile(q)
                out[key] = None if value is None else 1000 * value
    if judged <= 0:
        return out
    was, now = causes(before), causes(after)
    off = {c: int(now[c] - was.get(c, 0.0)) for c in now}
    out.update({"index_judged": int(judged), "index_off_share": sum(off.values()) / judged},
               **{f"index_off_{c}": n for c, n in off.items()})
    return out


def summarize(before: Histogram, after: Histogram) -> dict[str, Any]:
    """Routing-latency figures of the samples between two scrapes; {} when there are none."""
    run = after.minus(before)
    if run.count <= 0:
        return {}
    median, p99 = run.quantile(0.5), run.quantile(0.99)
    return {
        "router_latency_samples": int(run.count),
        "mean_router_latency_ms": 1000 * run.total / run.count,
        "median_router_latency_ms": None if median is None else 1000 * median,
        "p99_router_latency_ms": None if p99 is None else 1000 * p99,
    }


def measurer(port: int) -> Callable[[], Awaitable[Callable[[], Awaitable[dict[str, Any]]]]]:
    """For `run_sweep(measure=...)`: scrape before a point; the returned coroutine waits for
    the last observations to be exported, scrapes again and gives the point's figures."""
    settle_s = 2.5 * REPORT_INTERVAL_MS / 1000

    async def start() -> Callable[[], Awaitable[dict[str, Any]]]:
        await asyncio.sleep(settle_s)   # warm-up and start-up lookups of the last point
        before = await asyncio.to_thread(scrape, port)

        async def finish() -> dict[str, Any]:
            await asyncio.sleep(settle_s)
            after = await asyncio.to_thread(scrape, port)
            return {**summarize(parse(before), parse(after)), **index_truth(before, after)}

        return finish

    return start
