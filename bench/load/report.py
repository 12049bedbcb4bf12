"""Terminal tables, JSON files and PNG plots of benchmark runs.

JSON keys follow vLLM's `bench serve` so results line up with vLLM, SGLang and AIPerf runs.
Plots use matplotlib's Agg backend (no display needed).
"""

from __future__ import annotations

import json
import math
import re
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from prefixserve.bench.load.metrics import METRICS, RequestResult

_LABELS = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2E latency"}

# (key, label, format) rows of the summary table; the percentile rows are added per metric.
_HEAD = [
    ("completed", "Successful requests", "{:d}"),
    ("failed", "Failed requests", "{:d}"),
    ("max_concurrency", "Maximum request concurrency", "{:d}"),
    ("request_rate", "Request rate configured (RPS)", "{:.2f}"),
    ("duration", "Benchmark duration (s)", "{:.2f}"),
    ("total_input_tokens", "Total input tokens", "{:d}"),
    ("total_output_tokens", "Total generated tokens", "{:d}"),
    ("request_throughput", "Request throughput (req/s)", "{:.2f}"),
    ("request_goodput", "Request goodput (req/s)", "{:.2f}"),
    ("output_throughput", "Output token throughput (tok/s)", "{:.2f}"),
    ("total_token_throughput", "Total token throughput (tok/s)", "{:.2f}"),
    ("max_concurrent_requests", "Peak concurrent requests", "{:d}"),
    ("prefix_hit_rate", "Prefix hit rate", "{:.3f}"),
    ("router_latency_samples", "Routing latency samples", "{:d}"),
    ("mean_router_latency_ms", "Mean routing latency (ms)", "{:.3f}"),
    ("median_router_latency_ms", "Median routing latency (ms)", "{:.3f}"),
    ("p99_router_latency_ms", "P99 routing latency (ms)", "{:.3f}"),
    ("index_judged", "Requests judged against the index", "{:d}"),
    ("index_off_share", "Index off by > 1 block (share)", "{:.4f}"),
    ("index_off_failopen", "  of which: failed open", "{:d}"),
    ("index_off_partial", "  of which: its shard was down", "{:d}"),
    ("index_off_serve", "  of which: Serve's other choice", "{:d}"),
    ("index_off_evicted", "  of which: evicted in between", "{:d}"),
    ("index_off_never_stored", "  of which: never stored", "{:d}"),
    ("index_off_not_indexed", "  of which: not indexed yet", "{:d}"),
    ("median_index_lag_ms", "Median KV event lag to index (ms)", "{:.2f}"),
    ("p99_index_lag_ms", "P99 KV event lag to index (ms)", "{:.2f}"),
    ("median_follower_lag_ms", "Median router copy lag (ms)", "{:.2f}"),
    ("p99_follower_lag_ms", "P99 router copy lag (ms)", "{:.2f}"),
    ("own_cpu_cores", "CPU of this benchmark (cores)", "{:.2f}"),
    ("other_cpu_cores", "CPU of other processes (cores)", "{:.2f}"),
    ("stolen_cpu_cores", "CPU stolen by other VMs (cores)", "{:.2f}"),
    ("own_rss_mib", "RSS of this benchmark (MiB)", "{:.0f}"),
]


def table_rows(summary: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(key, label) pairs for every figure present in the summary, in display order."""
    rows = [(k, label) for k, label, _ in _HEAD if summary.get(k) is not None]
    for m in METRICS:
        for stat in ("mean", "median", "std"):
            rows.append((f"{stat}_{m}_ms", f"{stat.capitalize()} {_LABELS[m]} (ms)"))
        rows += [(k, f"{k.split('_')[0].upper()} {_LABELS[m]} (ms)") for k in summary
                 if k.startswith("p") and k.endswith(f"_{m}_ms")]
    return rows


def tail_key(summary: Mapping[str, Any], metric: str = "ttft") -> str:
    """The highest percentile of `metric` the run wrote (`--metric-percentiles`), else its
    median: the tail that plots and ratio lines show."""
    keys = [k for k in summary if re.fullmatch(rf"p[\d.]+_{metric}_ms", k)]
    return max(keys, key=lambda k: float(k[1:].split("_")[0]), default=f"median_{metric}_ms")


def _fmt(key: str, value: Any) -> str:
    if value is None:
        return "-"
    for k, _, fmt in _HEAD:
        if k == key:
            return fmt.format(int(value)) if fmt == "{:d}" else fmt.format(value)
    return f"{value:.2f}"


def format_summary(summary: Mapping[str, Any], title: str = "Serving Benchmark Result") -> str:
    width = 52
    lines = [f" {title} ".center(width, "=")]
    lines += [f"{label:<38}{_fmt(k, summary[k]):>14}" for k, label in table_rows(summary)]
    workers = summary.get("per_worker_requests") or {}
    if workers:
        lines.append(" Requests per worker ".center(width, "-"))
        lines += [f"{w[-36:]:<38}{n:>14d}" for w, n in workers.items()]
    errors = summary.get("error_counts") or {}
    if errors:
        lines.append(" Errors ".center(width, "-"))
        lines += [f"{n:>5} x {msg}" for msg, n in errors.items()]
    lines.append("=" * width)
    return "\n".join(lines)


def format_side_by_side(runs: Mapping[str, Mapping[str, Any]], baseline: str | None = None,
                        ratios: bool = True) -> str:
    """One column per run and a ratio column per non-baseline run (run / baseline)."""
    names = list(runs)
    base = baseline or names[0]
    others = [n for n in names if n != base] if ratios else []
    first = runs[names[0]]
    header = f"{'metric':<34}" + "".join(f"{n[:14]:>15}" for n in names)
    header += "".join(f"{(n[:7] + '/' + base[:6]):>15}" for n in others)
    lines = [header, "-" * len(header)]
    present: dict[str, Any] = {}      # a row for every figure any run has
    for summary in runs.values():
        present.update({k: v for k, v in summary.items() if v is not None and k not in present})
    for key, label in table_rows({**first, **present}):
        cells = "".join(f"{_fmt(key, runs[n].get(key)):>15}" for n in names)
        cells += "".join(f"{ratio(runs[n].get(key), runs[base].get(key)):>15}" for n in others)
        lines.append(f"{label[:33]:<34}{cells}")
    return "\n".join(lines)


def ratio(a: Any, b: Any) -> str:
    """`a / b` as `1.23x`; `-` when either is missing, `b` is zero or either is infinite."""
    if a is None or b is None or not b or not math.isfinite(a / b):
        return "-"
    return f"{a / b:.2f}x"


def median_summary(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """Per figure, the median over launches; what is not a number is the first launch's."""
    out = dict(summaries[0])
    for key in summaries[0]:
        values = [s.get(key) for s in summaries]
        if all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
            out[key] = statistics.median(values)  # inf too (a burst's rate): no interpolation
    return out


def save_json(path: Path, summary: Mapping[str, Any], config: Mapping[str, Any],
              results: Sequence[RequestResult] | None = None) -> None:
    """Write config + summary; with results also vLLM's per-request lists (`input_lens`,
    `output_lens` (0 for a failure), `ttfts`, `itls`, `latencies`, `start_times`, `errors`, in
    seconds) and our fuller `requests` rows."""
    doc = {**config, **summary}
    if results is not None:
        doc["input_lens"] = [r.prompt_len for r in results]
        doc["output_lens"] = [r.output_tokens if r.success else 0 for r in results]
        doc["ttfts"] = [r.ttft for r in results]
        doc["itls"] = [r.itl for r in results]
        doc["latencies"] = [r.latency for r in results]
        doc["start_times"] = [r.start_time for r in results]
        doc["errors"] = [r.error for r in results]
        doc["requests"] = [r.row() for r in results]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_clean(doc), indent=2, default=str))


def _clean(value: Any) -> Any:
    """JSON has no infinity: write it as "inf", as vLLM does for request_rate."""
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def pooled_label(label: str) -> str:
    """`prefix#2@16` -> `prefix@16`: the launches of one policy and rate share a plot line."""
    return re.sub(r"#\d+(?=@|$)", "", label)


def plot_ttft_cdf(runs: Mapping[str, Sequence[RequestResult]], path: Path) -> Path:
    """TTFT CDF, one line per run label (`name@rate`): a colour per name, a dash per rate."""
    import numpy as np

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    names = list(dict.fromkeys(label.split("@")[0] for label in runs))
    rates = list(dict.fromkeys(label.partition("@")[2] for label in runs))
    dashes = ["-", "--", ":", "-."]
    for label, results in runs.items():
        name, _, rate = label.partition("@")
        ttfts = np.sort([r.ttft * 1000 for r in results if r.success])
        if len(ttfts):
            ax.step(ttfts, np.arange(1, len(ttfts) + 1) / len(ttfts), where="post", label=label,
                    color=f"C{names.index(name) % 10}",
                    linestyle=dashes[rates.index(rate) % len(dashes)])
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small", loc="lower right")
    return _save(fig, plt, path)


def plot_rate_curves(curves: Mapping[str, Sequence[tuple[float, Mapping[str, Any]]]],
                     path: Path) -> Path:
    """Output throughput and the TTFT tail (`tail_key`) against request rate, one line per
    run label."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    key = tail_key(next(iter(curves.values()))[0][1])
    for name, points in curves.items():
        pts = sorted(points, key=lambda p: p[0])
        rates = [r for r, _ in pts]
        left.plot(rates, [s["output_throughput"] for _, s in pts], marker="o", label=name)
        right.plot(rates, [s.get(key, math.nan) for _, s in pts], marker="o", label=name)
    left.set_xlabel("request rate (req/s)")
    left.set_ylabel("output throughput (tok/s)")
    right.set_xlabel("request rate (req/s)")
    right.set_ylabel(f"TTFT {key.split('_')[0]} (ms)")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend()
    return _save(fig, plt, path)


def plot_worker_load(runs: Mapping[str, Mapping[str, Any]], path: Path) -> Path:
    """Requests served per worker, busiest first, grouped bars per run (replica ids differ
    between launches, so bars line up by rank, not by id)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    names = list(runs)
    width = 0.8 / max(1, len(names))
    most = 0
    for i, name in enumerate(names):
        counts = sorted((runs[name].get("per_worker_requests") or {}).values(), reverse=True)
        ax.bar([w + i * width for w in range(len(counts))], counts, width, label=name)
        most = max(most, len(counts))
    ax.set_xticks([w + 0.4 - width / 2 for w in range(most)], [f"#{w + 1}" for w in range(most)])
    ax.set_xlabel("worker (busiest first)")
    ax.set_ylabel("requests")
    ax.set_title("Requests per worker")
    ax.legend()
    return _save(fig, plt, path)


def _save(fig: Any, plt: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
