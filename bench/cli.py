"""`prefixserve bench run|compare` (also `python -m bench run|compare`).

`run` drives any OpenAI-compatible endpoint; `compare` launches the local cluster once per
routing policy and runs the same workload against each. Examples::

    # 8 groups x 16 prompts sharing 2,048-token system prompts, Poisson at 4 req/s
    prefixserve bench run --base-url http://127.0.0.1:8000 --workload shared-prefix \
        --request-rate 4 --ignore-eos --goodput ttft:500 tpot:50
    # a rate sweep (one JSON per rate, throughput and TTFT p90 against rate in a PNG)
    prefixserve bench run --workload rag --request-rate 1,2,4,8 --max-concurrency 64
    # replay 500 rows of a Mooncake trace 10x faster, prompts cut to 3,000 tokens
    prefixserve bench run --workload trace --limit 500 --speedup 10 --max-input 3000
    # vLLM / SGLang: give the model's vocab so token ids stay in range
    prefixserve bench run --base-url http://gpu:8000 --model meta-llama/Llama-3.1-8B \
        --vocab-size 128000 --workload multi-turn --max-concurrency 16
    # prefix-aware vs power-of-two vs round-robin on the local cluster, side by side
    prefixserve bench compare --num-workers 2 --workload shared-prefix --max-concurrency 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from bench.client import ClientConfig
from bench.load import LoadShape
from bench.metrics import parse_goodput
from bench.report import (
    format_side_by_side,
    format_summary,
    median_summary,
    plot_rate_curves,
    plot_ttft_cdf,
    plot_worker_load,
    pooled_label,
    save_json,
)
from bench.runner import RunResult, RunSpec, WorkloadFn, run_sweep
from bench.workloads import MultiTurn, Rag, RandomPrompts, SharedPrefix, Tokens, Trace
from workers.checkpoints import BUILTIN_MODEL_NAME, DEFAULT_MODEL, resolve_checkpoint

WORKLOADS = ("shared-prefix", "multi-turn", "rag", "trace", "random")
DEFAULT_TRACE = "bench/traces/mooncake_conversation_1000.jsonl"


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Mount `bench run|compare` on a parent CLI's subparsers."""
    bench = subparsers.add_parser("bench", help="load-test an endpoint or compare routing policies")
    build_parser(bench)
    return bench


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="prefixserve bench")
    sub = parser.add_subparsers(dest="bench_command", required=True)
    run = sub.add_parser("run", help="benchmark a running OpenAI-compatible endpoint")
    run.add_argument("--base-url", default="http://127.0.0.1:8000")
    _common_args(run)
    run.set_defaults(bench_func=cmd_run)
    cmp = sub.add_parser("compare", help="launch the local cluster per routing policy and compare")
    cmp.add_argument("--policies", default="prefix,pow2,round_robin",
                     help="comma-separated: prefix, pow2, round_robin (first is the baseline)")
    cmp.add_argument("--num-workers", type=int, default=2)
    cmp.add_argument("--model-path", default=DEFAULT_MODEL,
                     help="what the cluster serves: a known model name, a checkpoint dir or a "
                          f".gguf file (default: {DEFAULT_MODEL}; {BUILTIN_MODEL_NAME}: the tiny "
                          "random-weight model)")
    cmp.add_argument("--port", type=int, default=0, help="HTTP port (0: a free one)")
    cmp.add_argument("--cluster-option", action="append", default=[], metavar="KEY=JSON",
                     help="extra ClusterConfig field, e.g. max_num_seqs=32 (repeatable)")
    cmp.add_argument("--repeats", type=int, default=1,
                     help="launch every policy N times, interleaved (A B A B ...): tables "
                          "show medians and each launch's ratios (noisy, shared machines)")
    cmp.add_argument("--router-metrics", action="store_true",
                     help="routing latency p50/p99 of the prefix-aware router, read from "
                          "Ray's Prometheus metrics endpoint (bench/router_metrics.py)")
    _common_args(cmp)
    cmp.set_defaults(bench_func=cmd_compare)
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
    o.add_argument("--percentiles", default="90,99")
    o.add_argument("--result-dir", default="bench/results", help="(git-ignored)")
    o.add_argument("--label", default=None, help="run name (files and table)")
    o.add_argument("--save-detailed", action="store_true", help="per-request rows in the JSON")
    o.add_argument("--no-plots", action="store_true")
    o.add_argument("--no-progress", action="store_true")


def make_workload(args: argparse.Namespace) -> WorkloadFn:
    out = args.output_len
    kind = args.workload
    if kind == "shared-prefix":
        w: Any = SharedPrefix(args.num_groups, args.prompts_per_group, args.system_len or 2048,
                              args.question_len or 128, out or 256, args.popularity, args.zipf_s,
                              args.num_prompts)
    elif kind == "multi-turn":
        w = MultiTurn(args.num_users, args.turns, args.system_len or 256, args.user_len,
                      out or 128, args.think_time)
    elif kind == "rag":
        w = Rag(args.num_docs, args.doc_len, args.questions_per_doc, args.question_len or 64,
                out or 128)
    elif kind == "trace":
        w = Trace(args.trace, args.speedup, args.max_input, args.max_output or out, args.limit,
                  args.offset)
    else:
        w = RandomPrompts(args.num_prompts or 64, args.input_len, out or 128)
    fn = w.sessions
    if args.endpoint.rstrip("/").endswith("chat/completions"):
        return _as_chat(fn, args.tokenizer)
    return fn


def _as_chat(fn: WorkloadFn, tokenizer: str | None) -> WorkloadFn:
    """Chat endpoints take text: decode each token prompt into one user message."""
    if not tokenizer:
        raise SystemExit("--tokenizer is needed to send token workloads to a chat endpoint")
    from tokenizers import Tokenizer

    path = Path(tokenizer)
    tok = Tokenizer.from_file(str(path / "tokenizer.json" if path.is_dir() else path))

    def sessions(tokens: Tokens) -> list:
        out = fn(tokens)
        for s in out:
            for p in s.turns:
                p.messages = [{"role": "user", "content": tok.decode(p.tokens or [])}]
        return out

    return sessions


def default_vocab_size(model: str | None) -> int:
    """The vocab of the served model; for the built-in tiny model (and a remote endpoint's
    unknown one) its 256 byte tokens (its special tokens would make chat-template markers
    appear in prompts)."""
    if model is None or model == BUILTIN_MODEL_NAME:
        return 256
    path = resolve_checkpoint(model)
    return int(json.loads((path / "config.json").read_text())["vocab_size"])


def make_spec(args: argparse.Namespace, base_url: str, model: str) -> RunSpec:
    vocab = args.vocab_size or default_vocab_size(getattr(args, "model_path", None))
    client = ClientConfig(base_url=base_url, model=model, endpoint=args.endpoint,
                          api_key=args.api_key, ignore_eos=args.ignore_eos,
                          temperature=args.temperature, extra_body=args.extra_body)
    shape = LoadShape(burstiness=args.burstiness, max_concurrency=args.max_concurrency,
                      duration_s=args.duration, seed=args.seed)
    return RunSpec(client, shape, Tokens(vocab, args.seed, args.min_token_id), args.warmup,
                   parse_goodput(args.goodput), parse_floats(args.percentiles),
                   progress=not args.no_progress)


def parse_floats(text: str) -> list[float]:
    return [float(x) for x in str(text).split(",") if x.strip()]


def run_config(args: argparse.Namespace) -> dict[str, Any]:
    """The knobs that produced a result, saved beside it."""
    skip = {"bench_func", "bench_command", "func", "command"}
    cfg = {k: v for k, v in vars(args).items() if k not in skip and not callable(v)}
    cfg["date"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    return cfg


def write_outputs(args: argparse.Namespace, runs: dict[str, list[RunResult]]) -> list[Path]:
    """JSON per run point, then the plots; returns every file written."""
    out_dir = Path(args.result_dir)
    files = []
    for points in runs.values():
        for r in points:
            path = out_dir / f"{_slug(r.label)}.json"
            save_json(path, r.summary, {**run_config(args), "label": r.label,
                                        "request_rate": r.request_rate},
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
    from bench.compare import compare

    return compare(args)


def parse_rates(args: argparse.Namespace) -> list[float]:
    rates = [math.inf if x.strip() == "inf" else float(x)
             for x in str(args.request_rate).split(",") if x.strip()]
    if not rates or any(r <= 0 for r in rates):
        raise SystemExit(f"bad --request-rate {args.request_rate!r}")
    return rates


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.bench_func(args)


if __name__ == "__main__":
    sys.exit(main())
