r"""`prefixserve-bench run|compare` (also `python -m prefixserve.bench run|compare`).

`run` drives any OpenAI-compatible endpoint; `compare` launches the local cluster once per
routing policy and runs the same workload against each. Examples::

    # 8 groups x 16 prompts sharing 2,048-token system prompts, Poisson at 4 req/s
    prefixserve-bench run --base-url http://127.0.0.1:8000 --workload shared-prefix \
        --request-rate 4 --ignore-eos --goodput ttft:500 tpot:50
    # a rate sweep (one JSON per rate, throughput and TTFT p99 against rate in a PNG)
    prefixserve-bench run --workload rag --request-rate 1,2,4,8 --max-concurrency 64
    # replay 500 rows of a Mooncake trace 10x faster, prompts cut to 3,000 tokens
    prefixserve-bench run --workload trace --limit 500 --speedup 10 --max-input 3000
    # vLLM / SGLang: give the model's vocab so token ids stay in range
    prefixserve-bench run --base-url http://gpu:8000 --model meta-llama/Llama-3.1-8B \
        --vocab-size 128000 --workload multi-turn --max-concurrency 16
    # prefix-aware vs power-of-two vs round-robin on the local cluster, side by side
    prefixserve-bench compare --num-workers 2 --workload shared-prefix --max-concurrency 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from prefixserve.bench.load.options import (
    DEFAULT_TRACE,
    WORKLOADS,
    make_spec,
    make_workload,
    parse_rates,
)
from prefixserve.bench.load.outputs import write_outputs
from prefixserve.bench.load.report import format_side_by_side, format_summary
from prefixserve.bench.load.runner import run_sweep
from prefixserve.router.routing_policies import POLICY_NAMES
from prefixserve.workers.checkpoints import BUILTIN_MODEL_NAME, DEFAULT_MODEL


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prefixserve-bench", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="benchmark a running OpenAI-compatible endpoint")
    run.add_argument("--base-url", default="http://127.0.0.1:8000")
    _common_args(run)
    run.set_defaults(func=cmd_run)
    cmp = sub.add_parser("compare", help="launch the local cluster per routing policy and compare")
    cmp.add_argument("--policies", default="prefix,pow2,round_robin",
                     help=f"comma-separated arms: {', '.join(POLICY_NAMES)} (first is the "
                          "baseline), each optionally +LABEL: its --arm-option settings")
    cmp.add_argument("--num-workers", type=int, default=2)
    cmp.add_argument("--model-path", default=DEFAULT_MODEL,
                     help="what the cluster serves: a known model name, a checkpoint dir or a "
                          f".gguf file (default: {DEFAULT_MODEL}; {BUILTIN_MODEL_NAME}: the tiny "
                          "random-weight model)")
    cmp.add_argument("--port", type=int, default=0, help="HTTP port (0: a free one)")
    cmp.add_argument("--cluster-option", action="append", default=[], metavar="KEY=JSON",
                     help="extra ClusterConfig field, e.g. max_num_seqs=32 (repeatable)")
    cmp.add_argument("--arm-option", action="append", default=[], metavar="LABEL:KEY=JSON",
                     help="a ClusterConfig field for the arms named POLICY+LABEL only, e.g. "
                          "tiers:kv_offloading_size=0.5 (repeatable)")
    cmp.add_argument("--repeats", type=int, default=1,
                     help="launch every policy N times, interleaved (A B A B ...): tables "
                          "show medians and each launch's ratios (noisy, shared machines)")
    cmp.add_argument("--router-metrics", action="store_true",
                     help="routing latency p50/p99 of the prefix-aware router, read from "
                          "Ray's Prometheus metrics endpoint (bench/load/router_metrics.py)")
    _common_args(cmp)
    cmp.set_defaults(func=cmd_compare)
    return parser


def _common_args(p: argparse.ArgumentParser) -> None:
    c = p.add_argument_group("client")
    c.add_argument("--endpoint", default="/v1/completions")
    c.add_argument("--model", default="", help="model name sent in requests")
    c.add_argument("--api-key", default=None)
    c.add_argument("--ignore-eos", action="store_true", help="exact output lengths")
    c.add_argument("--temperature", type=float, default=0.0)
    c.add_argument("--extra-body", type=json.loads, default={}, help="JSON merged into each body")
    c.add_argument("--tokenizer", default=None,
                   help="tokenizer.json (or its dir) to send text, needed for chat endpoints")
    w = p.add_argument_group("workload")
    w.add_argument("--workload", choices=WORKLOADS, default="shared-prefix")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--vocab-size", type=int, default=None,
                   help="token ids drawn below this (default: --model-path's vocab, else 256)")
    w.add_argument("--min-token-id", type=int, default=0)
    w.add_argument("--num-prompts", type=int, default=None, help="requests (random, zipf groups)")
    w.add_argument("--input-len", type=int, default=1024, help="random: prompt tokens")
    w.add_argument("--output-len", type=int, default=None, help="output tokens per request")
    w.add_argument("--num-groups", type=int, default=8)
    w.add_argument("--prompts-per-group", type=int, default=16)
    w.add_argument("--system-len", type=int, default=None, help="shared system prompt tokens")
    w.add_argument("--question-len", type=int, default=None)
    w.add_argument("--popularity", choices=("uniform", "zipf"), default="uniform")
    w.add_argument("--zipf-s", type=float, default=1.1)
    w.add_argument("--num-users", type=int, default=8)
    w.add_argument("--turns", type=int, default=4)
    w.add_argument("--user-len", type=int, default=128)
    w.add_argument("--think-time", type=float, default=0.0, help="seconds between turns")
    w.add_argument("--num-docs", type=int, default=4)
    w.add_argument("--doc-len", type=int, default=4096)
    w.add_argument("--questions-per-doc", type=int, default=8)
    w.add_argument("--trace", default=DEFAULT_TRACE)
    w.add_argument("--speedup", type=float, default=1.0, help="trace: arrivals at t / speedup")
    w.add_argument("--max-input", type=int, default=None, help="trace: cut prompts to N tokens")
    w.add_argument("--max-output", type=int, default=None, help="trace: cap output tokens")
    w.add_argument("--limit", type=int, default=None, help="trace: rows to replay")
    w.add_argument("--offset", type=int, default=0, help="trace: first row")
    ld = p.add_argument_group("load")
    ld.add_argument("--request-rate", default="inf",
                    help="req/s; 'inf' sends all at once; a comma list runs a sweep")
    ld.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    ld.add_argument("--max-concurrency", type=int, default=None)
    ld.add_argument("--duration", type=float, default=None, help="stop issuing after N seconds")
    ld.add_argument("--warmup", type=int, default=0, help="warm-up requests, not measured")
    o = p.add_argument_group("results")
    o.add_argument("--goodput", nargs="+", default=None, metavar="SLO",
                   help="ttft:MS tpot:MS e2el:MS")
    o.add_argument("--metric-percentiles", default="99",
                   help="comma-separated percentiles written as pNN fields, e.g. 50,90,99")
    o.add_argument("--percentile-metrics", default="ttft,tpot,itl",
                   help="comma-separated metrics given pNN fields: ttft, tpot, itl, e2el")
    o.add_argument("--result-dir", default="bench/results", help="(git-ignored)")
    o.add_argument("--label", default=None, help="run name (files and table)")
    o.add_argument("--save-detailed", action="store_true", help="per-request rows in the JSON")
    o.add_argument("--no-plots", action="store_true")
    o.add_argument("--no-progress", action="store_true")


def cmd_run(args: argparse.Namespace) -> int:
    label = args.label or args.workload
    spec = make_spec(args, args.base_url, args.model)
    points = asyncio.run(run_sweep(spec, make_workload(args), parse_rates(args), label=label))
    for r in points:
        print(format_summary(r.summary, title=r.label))
    if len(points) > 1:
        print(format_side_by_side({r.label: r.summary for r in points}, ratios=False))
    for f in write_outputs(args, {label: points}):
        print(f"wrote {f}")
    return 0 if all(r.summary["completed"] for r in points) else 1


def cmd_compare(args: argparse.Namespace) -> int:
    from prefixserve.bench.load.compare import (
        compare,  # the cluster launcher: `run` does without it
    )

    return compare(args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
