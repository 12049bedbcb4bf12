"""One benchmark run (warm-up, measured load, summary) and a rate sweep of such runs."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from prefixserve.bench.load.client import ClientConfig, Prompt, make_http_client, send
from prefixserve.bench.load.load import LoadShape, RunOutcome, run_load, warm_up
from prefixserve.bench.load.metrics import (
    DEFAULT_PERCENTILE_METRICS,
    DEFAULT_PERCENTILES,
    RequestResult,
    summarize,
)
from prefixserve.bench.load.workloads import Session, Tokens, warmup_sessions

WorkloadFn = Callable[[Tokens], list[Session]]


@dataclass
class RunSpec:
    client: ClientConfig
    shape: LoadShape
    tokens: Tokens
    warmup: int = 0
    slos: dict[str, float] = field(default_factory=dict)
    percentiles: Sequence[float] = DEFAULT_PERCENTILES
    percentile_metrics: Sequence[str] = DEFAULT_PERCENTILE_METRICS
    progress: bool = True


@dataclass
class RunResult:
    label: str
    summary: dict[str, Any]
    results: list[RequestResult]
    request_rate: float


async def run_once(spec: RunSpec, workload: WorkloadFn, label: str = "run") -> RunResult:
    """Warm up with cache-neutral prompts, then drive the workload and summarise it."""
    sessions = workload(spec.tokens)
    limit = sum(len(s.turns) for s in sessions) + spec.warmup
    async with make_http_client(spec.client, max_connections=max(16, min(limit, 1000))) as http:
        async def send_one(prompt: Prompt, rid: str, at: float) -> RequestResult:
            return await send(http, spec.client, prompt, rid, at)

        if spec.warmup:
            failed = await warm_up(warmup_sessions(sessions, spec.warmup, spec.tokens),
                                   send_one, concurrency=spec.shape.max_concurrency or 4)
            if len(failed) == spec.warmup:
                raise RuntimeError(f"all {spec.warmup} warm-up requests failed; the first: "
                                   f"{failed[0].error}")
        outcome: RunOutcome = await run_load(sessions, send_one, spec.shape,
                                             progress=spec.progress, desc=label)
    summary = {**setup(spec), **summarize(outcome.results, outcome.duration, spec.slos or None,
                                          spec.percentiles, spec.percentile_metrics)}
    return RunResult(label, summary, outcome.results, spec.shape.request_rate)


def setup(spec: RunSpec) -> dict[str, Any]:
    """vLLM's setup fields of a result: what was asked of which server, so that a result file
    reads the same as `vllm bench serve`'s (`backend` as its name for the endpoint type)."""
    return {
        "backend": "openai-chat" if spec.client.chat else "openai",
        "model_id": spec.client.model or None,
        "request_rate": spec.shape.request_rate,
        "burstiness": spec.shape.burstiness,
        "max_concurrency": spec.shape.max_concurrency,
    }


# Called before each point; the coroutine it returns is awaited after the point and gives
# figures merged into its summary (bench/load/router_metrics.py: routing latency from Ray).
Measure = Callable[[], Awaitable[Callable[[], Awaitable[dict[str, Any]]]]]


async def run_sweep(spec: RunSpec, workload: WorkloadFn, rates: Sequence[float],
                    label: str = "run", measures: Sequence[Measure] = ()) -> list[RunResult]:
    """One run per request rate. Each point draws fresh tokens (seed + i) with the same
    structure, so an earlier point's cached prefixes cannot flatter a later one. Measures
    start in order and finish in reverse, so the last one brackets the run most tightly."""
    out = []
    for i, rate in enumerate(rates):
        shape = replace(spec.shape, request_rate=rate, seed=spec.shape.seed + i)
        point = replace(spec, shape=shape, tokens=replace(spec.tokens, seed=spec.tokens.seed + i))
        name = f"{label}@{'inf' if math.isinf(rate) else f'{rate:g}'}"
        finishers = [await start() for start in measures]
        result = await run_once(point, workload, label=name)
        for finish in reversed(finishers):
            result.summary.update(await finish())
        out.append(result)
    return out
