"""Per-request timings and the run summary, with vLLM `bench serve`'s definitions and names.

- TTFT: request sent → first event carrying generated content.
- ITL: the gaps between consecutive content events (one per event, as vLLM counts them).
- TPOT: (E2E − TTFT) / (output tokens − 1), only for requests with more than one output token.
- E2E latency: request sent → last content event (vLLM's `latency`).
- Throughputs divide by the wall-clock duration of the measured phase (warm-up excluded).
- Goodput: completed requests meeting every SLO given (`ttft`, `tpot`, `e2el`, in ms) / duration.
- Peak concurrent requests (`max_concurrent_requests`): the most successful requests in flight
  at once, as vLLM measures it; the `--max-concurrency` limit is the separate `max_concurrency`.
Mean, median and std are written for every metric; pNN fields only for the percentiles and
metrics chosen (vLLM's `--metric-percentiles` and `--percentile-metrics`, default p99 of TTFT,
TPOT and ITL). Percentiles are numpy's linear interpolation; std is the population std
(np.std), as in vLLM.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from prefixserve.bench.percentile import percentile

METRICS = ("ttft", "tpot", "itl", "e2el")
DEFAULT_PERCENTILES = (99.0,)
DEFAULT_PERCENTILE_METRICS = ("ttft", "tpot", "itl")


@dataclass
class RequestResult:
    """What one request did, in seconds relative to its own send time."""

    request_id: str = ""
    success: bool = False
    error: str = ""
    prompt_len: int = 0                 # from usage.prompt_tokens, else the prompt we sent
    output_tokens: int = 0              # from usage.completion_tokens, else content events
    cached_tokens: int | None = None    # usage.prompt_tokens_details.cached_tokens (None: unknown)
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0             # seconds since the measured phase began
    worker: str | None = None           # x-prefixserve-worker header ("a,b" when several served)
    group: str = ""                     # workload tag (prefix group, user, document, trace row)

    @property
    def tpot(self) -> float | None:
        if not self.success or self.output_tokens <= 1:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    def row(self) -> dict[str, Any]:
        out = asdict(self)
        out["tpot"] = self.tpot
        return out


def from_timeline(send: float, content_times: Sequence[float], output_tokens: int,
                  **fields: Any) -> RequestResult:
    """Build a result from a send time and the arrival times of content events."""
    if not content_times:
        return RequestResult(success=False, error=fields.pop("error", "") or "no content",
                             output_tokens=output_tokens, **fields)
    rel = [t - send for t in content_times]
    return RequestResult(
        success=True, ttft=rel[0], itl=[b - a for a, b in itertools.pairwise(rel)],
        latency=rel[-1], output_tokens=output_tokens or len(rel), **fields)


def parse_goodput(specs: Sequence[str] | None) -> dict[str, float]:
    """`["ttft:200", "tpot:50"]` → {"ttft": 200.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for spec in specs or []:
        name, sep, value = spec.partition(":")
        if not sep or name not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"bad goodput SLO {spec!r}: use ttft:MS, tpot:MS or e2el:MS")
        slos[name] = float(value)
        if slos[name] <= 0:
            raise ValueError(f"goodput SLO must be positive: {spec!r}")
    return slos


def meets_slos(r: RequestResult, slos: dict[str, float]) -> bool:
    values = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2el": r.latency}
    return all(values[name] * 1000 <= limit for name, limit in slos.items())


def percentile_key(p: float, metric: str) -> str:
    """vLLM's field name: `p99_ttft_ms`, `p99.9_ttft_ms` (whole percentiles lose the `.0`)."""
    word = str(int(p)) if int(p) == p else str(p)
    return f"p{word}_{metric}_ms"


def _stats(name: str, values_s: Sequence[float],
           percentiles: Sequence[float]) -> dict[str, float]:
    ms = np.asarray(values_s, dtype=float) * 1000 if len(values_s) else np.zeros(1)
    out = {
        f"mean_{name}_ms": float(np.mean(ms)),
        f"median_{name}_ms": percentile(ms, 50),
        f"std_{name}_ms": float(np.std(ms)),
    }
    for p in percentiles:
        out[percentile_key(p, name)] = percentile(ms, p)
    return out


def summarize(results: Sequence[RequestResult], duration: float,
              slos: dict[str, float] | None = None,
              percentiles: Sequence[float] = DEFAULT_PERCENTILES,
              percentile_metrics: Sequence[str] = DEFAULT_PERCENTILE_METRICS) -> dict[str, Any]:
    """The run's figures under vLLM's JSON names, plus prefix-hit rate and per-worker counts;
    pNN fields for `percentiles` of `percentile_metrics` only."""
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    known = [r for r in ok if r.cached_tokens is not None]
    known_prompt = sum(r.prompt_len for r in known)
    duration = max(duration, 1e-9)
    summary: dict[str, Any] = {
        "num_prompts": len(results),
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "request_goodput": (sum(meets_slos(r, slos) for r in ok) / duration) if slos else None,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "max_concurrent_requests": peak_concurrency(ok),
        "prefix_hit_rate": (sum(r.cached_tokens or 0 for r in known) / known_prompt
                            if known_prompt else None),
        "total_cached_tokens": sum(r.cached_tokens or 0 for r in known),
        "per_worker_requests": dict(sorted(Counter(
            w for r in ok if r.worker for w in r.worker.split(",")).items())),
    }
    series = {
        "ttft": [r.ttft for r in ok],
        "tpot": [t for r in ok if (t := r.tpot) is not None],
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.latency for r in ok],
    }
    for name in METRICS:
        summary.update(_stats(name, series[name],
                              percentiles if name in percentile_metrics else ()))
    summary["error_counts"] = dict(Counter(r.error[:120] for r in results if not r.success))
    return summary


def peak_concurrency(results: Sequence[RequestResult]) -> int:
    """Most requests in flight at once: a sweep over [start, end) intervals, an end before a
    start at the same instant, as vLLM counts them (pass the successful requests)."""
    edges = sorted([(r.start_time, 1) for r in results]
                   + [(r.start_time + r.latency, -1) for r in results])
    peak = live = 0
    for _, step in edges:
        live += step
        peak = max(peak, live)
    return peak
