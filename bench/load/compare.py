"""`bench compare`: the same workload against the local cluster under each routing policy.

The cluster is launched afresh per arm (same model, workers and engine settings), so every arm
starts with empty prefix caches and an empty index; the workload and arrival times are identical
(same seeds). The first arm is the baseline of the ratio columns. An arm is a policy, or
``policy+label``: that policy with the settings ``--arm-option label:KEY=JSON`` adds (KV tiers
on for some arms and not others, say).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
from typing import Any

from prefixserve.bench.load.launch import ensure_ray, local_cluster, shutdown
from prefixserve.bench.load.machine import cpu_measure
from prefixserve.bench.load.options import make_spec, make_workload, parse_rates
from prefixserve.bench.load.outputs import write_outputs
from prefixserve.bench.load.report import format_side_by_side, median_summary, ratio, tail_key
from prefixserve.bench.load.router_metrics import REPORT_INTERVAL_MS, measurer
from prefixserve.bench.load.runner import RunResult, run_sweep
from prefixserve.cluster.local_redis import free_port
from prefixserve.router.routing_policies import POLICY_NAMES


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


def arm_options(arm: str, pairs: list[str]) -> dict[str, Any]:
    """The settings `--arm-option label:KEY=JSON` gives the arm `policy+label[+label...]`."""
    labels = set(arm.split("+")[1:])
    mine = []
    for pair in pairs:
        label, sep, setting = pair.partition(":")
        if not sep:
            raise SystemExit(f"bad --arm-option {pair!r}: use LABEL:KEY=JSON")
        if label in labels:
            mine.append(setting)
    return parse_options(mine)


def run_policies(args: argparse.Namespace, policies: list[str]) -> dict[str, list[list[RunResult]]]:
    """arm -> one sweep per launch. Launches interleave the arms (A B A B ...), so a slow
    spell of a shared machine hits every arm rather than one of them."""
    options = parse_options(args.cluster_option)
    rates = parse_rates(args)
    workload = make_workload(args)
    repeats = getattr(args, "repeats", 1)
    if repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    measures = []
    if getattr(args, "router_metrics", False):
        port = free_port()
        ensure_ray(metrics_export_port=port, metrics_report_interval_ms=REPORT_INTERVAL_MS)
        measures.append(measurer(port))
    measures.append(cpu_measure())  # the cluster runs in this process tree: see bench/machine
    runs: dict[str, list[list[RunResult]]] = {p: [] for p in policies}
    for rep in range(repeats):
        for policy in policies:
            label = policy if repeats == 1 else f"{policy}#{rep + 1}"
            print(f"--- launching the cluster with policy={policy} ({args.num_workers} workers)"
                  + (f", launch {rep + 1} of {repeats}" if repeats > 1 else ""))
            arm = {**options, **arm_options(policy, getattr(args, "arm_option", []))}
            with local_cluster(port=args.port, model=args.model_path, num_workers=args.num_workers,
                               policy=policy.split("+")[0], **arm) as cluster:
                spec = make_spec(args, cluster.base_url, args.model or cluster.model)
                runs[policy].append(asyncio.run(run_sweep(spec, workload, rates, label=label,
                                                          measures=measures)))
    return runs


def compare(args: argparse.Namespace) -> int:
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p.split("+")[0] not in POLICY_NAMES]
    if unknown or not policies:
        raise SystemExit(f"unknown policies {unknown}; choose from {', '.join(POLICY_NAMES)}")
    try:
        runs = run_policies(args, policies)
    finally:
        shutdown()
    print(side_by_side(runs, args.speedup if args.workload == "trace" else None))
    flat = {points[0].label.rpartition("@")[0]: points
            for launches in runs.values() for points in launches}
    for f in write_outputs(args, flat):
        print(f"wrote {f}")
    return 0 if all(r.summary["completed"] for p in flat.values() for r in p) else 1


def ratio_keys(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """(key, label) of the per-launch ratio lines: the TTFT tail is the highest percentile
    the run wrote (`--metric-percentiles`), left out when TTFT got none."""
    tail = tail_key(summary)
    tails = [(tail, f"TTFT {tail.split('_')[0]}")] if tail != "median_ttft_ms" else []
    return [("request_throughput", "throughput"), ("median_ttft_ms", "TTFT p50"), *tails,
            ("prefix_hit_rate", "hit rate")]


def side_by_side(runs: dict[str, list[list[RunResult]]],
                 trace_speedup: float | None = None) -> str:
    """One table per request rate, a column per policy, ratios against the first policy.

    With several launches per policy the table holds medians, followed by each launch's ratios
    (launch k of a policy against launch k of the baseline, which ran just before it)."""
    blocks = []
    names = list(runs)
    base = names[0]
    launches = min(len(reps) for reps in runs.values())
    n_points = min(len(points) for reps in runs.values() for points in reps)
    for i in range(n_points):
        rate = runs[base][0][i].request_rate
        title = f"request rate {'inf' if math.isinf(rate) else f'{rate:g}'}/s"
        if trace_speedup is not None:
            title = f"trace arrivals, {trace_speedup:g}x speed"
        summaries = {name: median_summary([reps[k][i].summary for k in range(launches)])
                     for name, reps in runs.items()}
        if launches > 1:
            title += f", median of {launches} launches per policy"
        lines = [f"=== {title} ===", format_side_by_side(summaries)]
        for name in names[1:] if launches > 1 else []:
            for key, label in ratio_keys(summaries[base]):
                ratios = [ratio(runs[name][k][i].summary.get(key),
                                runs[base][k][i].summary.get(key)) for k in range(launches)]
                lines.append(f"{name}/{base} {label} per launch: " + " ".join(ratios))
        for name in names if launches > 1 else []:
            other = [runs[name][k][i].summary.get("other_cpu_cores") for k in range(launches)]
            if None not in other:
                lines.append(f"{name} CPU of other processes per launch (cores): "
                             + " ".join(f"{c:.2f}" for c in other))
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)
