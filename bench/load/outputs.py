"""Where benchmark results go: a JSON file per run point, then the comparison plots."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from prefixserve.bench.load.report import (
    median_summary,
    plot_rate_curves,
    plot_ttft_cdf,
    plot_worker_load,
    pooled_label,
    save_json,
)
from prefixserve.bench.load.runner import RunResult


def run_config(args: argparse.Namespace) -> dict[str, Any]:
    """The knobs that produced a result, saved beside it, with vLLM's `date` (its format) and
    `tokenizer_id` (null: token-id prompts, no tokenizer used)."""
    skip = {"func", "command"}
    cfg = {k: v for k, v in vars(args).items() if k not in skip and not callable(v)}
    cfg["date"] = time.strftime("%Y%m%d-%H%M%S")
    cfg["tokenizer_id"] = args.tokenizer
    return cfg


def write_outputs(args: argparse.Namespace, runs: dict[str, list[RunResult]]) -> list[Path]:
    """JSON per run point, then the plots; returns every file written."""
    out_dir = Path(args.result_dir)
    files = []
    for points in runs.values():
        for r in points:
            path = out_dir / f"{_slug(r.label)}.json"
            save_json(path, r.summary, {**run_config(args), "label": r.label},
                      r.results if args.save_detailed else None)
            files.append(path)
    if args.no_plots:
        return files
    base = _slug(args.label or args.workload)
    # Repeated launches (`name#k`) are pooled: one CDF per policy and rate over all of their
    # requests, and the median of their summaries on the rate curves.
    pooled: dict[str, list[RunResult]] = {}
    for p in runs.values():
        for r in p:
            pooled.setdefault(pooled_label(r.label), []).append(r)
    files.append(plot_ttft_cdf({label: [x for r in rs for x in r.results]
                                for label, rs in pooled.items()},
                               out_dir / f"{base}-ttft-cdf.png"))
    curves: dict[str, list[tuple[float, dict[str, Any]]]] = {}
    for label, rs in pooled.items():
        curves.setdefault(label.split("@")[0], []).append(
            (rs[0].request_rate, median_summary([r.summary for r in rs])))
    if any(len(points) > 1 for points in curves.values()):
        files.append(plot_rate_curves(curves, out_dir / f"{base}-vs-rate.png"))
    loads = {label: {"per_worker_requests": busiest_first_sums(rs)} for label, rs in pooled.items()}
    if any(s["per_worker_requests"] for s in loads.values()):
        files.append(plot_worker_load(loads, out_dir / f"{base}-worker-load.png"))
    return files


def busiest_first_sums(runs: list[RunResult]) -> dict[str, int]:
    """Requests per worker rank (busiest first), summed over launches: replica ids differ
    between launches, ranks do not."""
    sums: dict[str, int] = {}
    for r in runs:
        counts = sorted((r.summary.get("per_worker_requests") or {}).values(), reverse=True)
        for rank, n in enumerate(counts):
            sums[f"#{rank + 1}"] = sums.get(f"#{rank + 1}", 0) + n
    return sums


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_.@" else "_" for c in text)
