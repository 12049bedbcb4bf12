"""What the benchmark flags mean: the workload, the client and load settings, the rates.

Shared by `bench run` and `bench compare` (bench/load/compare.py), which turn the same flags into
the same requests.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from prefixserve.bench.load.client import ClientConfig
from prefixserve.bench.load.load import LoadShape
from prefixserve.bench.load.metrics import METRICS, parse_goodput
from prefixserve.bench.load.runner import RunSpec, WorkloadFn
from prefixserve.bench.load.workloads import (
    MultiTurn,
    Rag,
    RandomPrompts,
    SharedPrefix,
    Tokens,
    Trace,
)
from prefixserve.workers.checkpoints import BUILTIN_MODEL_NAME, resolve_checkpoint
from prefixserve.workers.sim.profiles import is_sim_model

WORKLOADS = ("shared-prefix", "multi-turn", "rag", "trace", "random")
DEFAULT_TRACE = "bench/traces/mooncake_conversation_1000.jsonl"


def make_workload(args: argparse.Namespace) -> WorkloadFn:
    """The `--workload`'s sessions; every policy of a comparison replays the same ones."""
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
    unknown one, and a simulated one, which serves its tokenizer) its 256 byte tokens (its
    special tokens would make chat-template markers appear in prompts)."""
    if model is None or model == BUILTIN_MODEL_NAME or is_sim_model(model):
        return 256
    path = resolve_checkpoint(model)
    return int(json.loads((path / "config.json").read_text())["vocab_size"])


def make_spec(args: argparse.Namespace, base_url: str, model: str) -> RunSpec:
    """How to send the requests to `base_url` (client, load shape, token ids, SLOs)."""
    vocab = args.vocab_size or default_vocab_size(getattr(args, "model_path", None))
    client = ClientConfig(base_url=base_url, model=model, endpoint=args.endpoint,
                          api_key=args.api_key, ignore_eos=args.ignore_eos,
                          temperature=args.temperature, extra_body=args.extra_body)
    shape = LoadShape(burstiness=args.burstiness, max_concurrency=args.max_concurrency,
                      duration_s=args.duration, seed=args.seed)
    return RunSpec(client, shape, Tokens(vocab, args.seed, args.min_token_id), args.warmup,
                   parse_goodput(args.goodput), parse_percentiles(args.metric_percentiles),
                   parse_percentile_metrics(args.percentile_metrics),
                   progress=not args.no_progress)


def parse_percentiles(text: str) -> list[float]:
    """`--metric-percentiles "90,99"` → `[90.0, 99.0]`; a bad list stops before any load."""
    try:
        out = [float(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or any(not 0 <= p <= 100 for p in out):
        raise SystemExit(f"bad --metric-percentiles {text!r}: use numbers in [0, 100]")
    return out


def parse_percentile_metrics(text: str) -> list[str]:
    """`--percentile-metrics "ttft,e2el"` → `["ttft", "e2el"]` (a subset of ttft,tpot,itl,e2el)."""
    out = [x.strip() for x in str(text).split(",") if x.strip()]
    if not out or any(m not in METRICS for m in out):
        raise SystemExit(f"bad --percentile-metrics {text!r}: choose from {','.join(METRICS)}")
    return out


def parse_rates(args: argparse.Namespace) -> list[float]:
    """`--request-rate`: one rate, or a comma list for a sweep; `inf` sends all at once."""
    rates = [math.inf if x.strip() == "inf" else float(x)
             for x in str(args.request_rate).split(",") if x.strip()]
    if not rates or any(r <= 0 for r in rates):
        raise SystemExit(f"bad --request-rate {args.request_rate!r}")
    return rates
