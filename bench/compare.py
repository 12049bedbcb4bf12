"""`bench compare`: the same workload against the local cluster under each routing policy.

The cluster is launched afresh per policy (same model, workers and engine settings), so every
policy starts with empty prefix caches and an empty index; the workload and arrival times are
identical (same seeds). The first policy is the baseline of the ratio columns.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
from typing import Any

from bench.cli import make_spec, make_workload, parse_rates, write_outputs
from bench.launch import ensure_ray, local_cluster, shutdown
from bench.report import format_side_by_side
from bench.router_metrics import REPORT_INTERVAL_MS, measurer
from bench.runner import RunResult, run_sweep
from cluster.local_redis import free_port

POLICIES = ("prefix", "pow2", "round_robin")


def parse_options(pairs: list[str]) -> dict[str, Any]:
    """`["max_num_seqs=32", "dtype=\"float32\""]` → ClusterConfig keyword arguments."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"bad --cluster-option {pair!r}: use KEY=VALUE")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    return out


def run_policies(args: argparse.Namespace, policies: list[str]) -> dict[str, list[RunResult]]:
    options = parse_options(args.cluster_option)
    rates = parse_rates(args)
    workload = make_workload(args)
    measure = None
    if getattr(args, "router_metrics", False):
        port = free_port()
        ensure_ray(metrics_export_port=port, metrics_report_interval_ms=REPORT_INTERVAL_MS)
        measure = measurer(port)
    runs: dict[str, list[RunResult]] = {}
    for policy in policies:
        print(f"--- launching the cluster with policy={policy} ({args.num_workers} workers)")
        with local_cluster(port=args.port, model=args.model_path, num_workers=args.num_workers,
                           policy=policy, **options) as cluster:
            spec = make_spec(args, cluster.base_url, args.model or cluster.model)
            runs[policy] = asyncio.run(run_sweep(spec, workload, rates, label=policy,
                                                 measure=measure))
    return runs


def compare(args: argparse.Namespace) -> int:
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown or not policies:
        raise SystemExit(f"unknown policies {unknown}; choose from {', '.join(POLICIES)}")
    try:
        runs = run_policies(args, policies)
    finally:
        shutdown()
    print(side_by_side(runs, args.speedup if args.workload == "trace" else None))
    for f in write_outputs(args, runs):
        print(f"wrote {f}")
    return 0 if all(r.summary["completed"] for p in runs.values() for r in p) else 1


def side_by_side(runs: dict[str, list[RunResult]], trace_speedup: float | None = None) -> str:
    """One table per request rate, a column per policy, ratios against the first policy."""
    blocks = []
    n_points = min(len(p) for p in runs.values())
    for i in range(n_points):
        rate = next(iter(runs.values()))[i].request_rate
        title = f"request rate {'inf' if math.isinf(rate) else f'{rate:g}'}/s"
        if trace_speedup is not None:
            title = f"trace arrivals, {trace_speedup:g}x speed"
        table = format_side_by_side({name: points[i].summary for name, points in runs.items()})
        blocks.append(f"=== {title} ===\n{table}")
    return "\n\n".join(blocks)
