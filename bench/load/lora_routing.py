"""Adapter- and prefix-aware routing against power-of-two choices, on a local cluster of two
workers that serve eight LoRA adapters with two batch slots each (`max_loras` 2).

    python -m prefixserve.bench.load.lora_routing            # the default real model
    python -m prefixserve.bench.load.lora_routing --quick    # fewer requests

Each adapter has its own system prompt; a request is its adapter's system prompt and a fresh
question, the adapter drawn by a Zipf law (a few adapters hot, the rest cold). The same
requests run through both policies in turn (a fresh cluster each, the same session), with a
fixed number in flight. Printed per policy: TTFT p50 and p90, slot loads per minute (an
adapter put into a worker's batch slot), evictions, and the prefix-cache hit rate.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from prefixserve.bench.load.client import ClientConfig, Prompt, make_http_client, send
from prefixserve.bench.load.launch import APP_NAME, ensure_ray, local_cluster, shutdown
from prefixserve.bench.load.machine import cpu_name
from prefixserve.bench.load.metrics import RequestResult
from prefixserve.bench.micro.lora_bench import write_adapter
from prefixserve.bench.percentile import percentile
from prefixserve.workers.checkpoints import DEFAULT_MODEL, resolve_checkpoint
from prefixserve.workers.models.config import load_model_config

POLICIES = ("prefix", "pow2")


@dataclass
class Outcome:
    results: list[RequestResult]
    seconds: float
    loads: int
    evictions: int


def workload(n: int, adapters: int, system_tokens: int, question_tokens: int,
             vocab: int, seed: int = 0) -> list[tuple[str, list[int]]]:
    """(adapter name, prompt) per request."""
    rng = random.Random(seed)
    systems = [[rng.randrange(100, vocab - 100) for _ in range(system_tokens)]
               for _ in range(adapters)]
    weights = [1 / (k + 1) for k in range(adapters)]
    out = []
    for _ in range(n):
        k = rng.choices(range(adapters), weights)[0]
        question = [rng.randrange(100, vocab - 100) for _ in range(question_tokens)]
        out.append((f"a{k}", systems[k] + question))
    return out


def slot_counts(workers: int) -> tuple[int, int]:
    """Slot loads and evictions summed over the workers (stats calls reach any replica)."""
    from ray import serve

    handle = serve.get_deployment_handle("LLMWorker", APP_NAME)
    seen: dict[str, dict] = {}
    for _ in range(100):
        stats = handle.stats.remote().result(timeout_s=60)
        seen[stats["worker"]] = stats["lora"]
        if len(seen) == workers:
            break
    return sum(s["loads"] for s in seen.values()), sum(s["evictions"] for s in seen.values())


async def drive(base_url: str, requests: list[tuple[str, list[int]]], output_len: int,
                concurrency: int) -> list[RequestResult]:
    """Every request, ``concurrency`` in flight, in order."""
    queue = list(enumerate(requests))
    results: list[RequestResult | None] = [None] * len(requests)
    cfgs = {name: ClientConfig(base_url=base_url, model=name, ignore_eos=True)
            for name in {a for a, _ in requests}}
    async with make_http_client(next(iter(cfgs.values()))) as http:
        async def worker() -> None:
            while queue:
                i, (adapter, tokens) = queue.pop(0)
                results[i] = await send(http, cfgs[adapter], Prompt(tokens, output_len=output_len),
                                        request_id=str(i))
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return [r for r in results if r is not None]


def run_policy(policy: str, args: argparse.Namespace, loras: dict[str, str],
               requests: list[tuple[str, list[int]]]) -> Outcome:
    with local_cluster(model=args.model, policy=policy, num_workers=2, max_loras=2,
                       lora_modules=loras, block_size=16, max_num_seqs=16) as launched:
        # warm-up: one base request per worker's first step, out of the figures
        asyncio.run(drive(launched.base_url, [(launched.model, [5] * 32)] * 2, 2, 2))
        start = time.perf_counter()
        results = asyncio.run(drive(launched.base_url, requests, args.max_tokens,
                                    args.concurrency))
        seconds = time.perf_counter() - start
        loads, evictions = slot_counts(2)
    return Outcome(results, seconds, loads, evictions)


def report(policy: str, out: Outcome) -> str:
    ok = [r for r in out.results if r.success]
    ttft = [r.ttft for r in ok]
    prompt = sum(r.prompt_len for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    return (f"{policy:>7} | {len(ok):>3}/{len(out.results):<3} | "
            f"{percentile(ttft, 50) * 1000:>8.0f} | {percentile(ttft, 90) * 1000:>8.0f} | "
            f"{out.loads / (out.seconds / 60):>9.1f} | {out.evictions:>9} | "
            f"{cached / max(prompt, 1):>8.1%} | {out.seconds:>6.1f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--requests", type=int, default=160)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=192)
    parser.add_argument("--question-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests = 48
    config = load_model_config(resolve_checkpoint(args.model))
    requests = workload(args.requests, args.adapters, args.system_tokens,
                        args.question_tokens, config.vocab_size)
    print(f"model {args.model} on {platform.machine()} {cpu_name()}; 2 workers, max_loras 2, "
          f"{args.adapters} adapters of rank {args.rank} (Zipf), {args.requests} requests of "
          f"{args.system_tokens}+{args.question_tokens} prompt tokens, {args.max_tokens} "
          f"generated, {args.concurrency} in flight")
    outcomes = {}
    with tempfile.TemporaryDirectory() as tmp:
        loras = {f"a{k}": str(write_adapter(Path(tmp) / f"a{k}", config, args.rank, seed=k))
                 for k in range(args.adapters)}
        ensure_ray()
        try:
            for policy in POLICIES:
                outcomes[policy] = run_policy(policy, args, loras, requests)
        finally:
            shutdown()
    print(" policy |  ok     | TTFT p50 | TTFT p90 | loads/min | evictions | hit rate |      s")
    print("        |         |     (ms) |     (ms) |           |           |          |")
    for policy, out in outcomes.items():
        print(report(policy, out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
