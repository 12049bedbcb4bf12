"""Load shapes: open loop at a request rate (Poisson or gamma bursts), closed loop at a fixed
concurrency, or both (a rate with a concurrency cap, as vLLM's `bench serve` does).

Arrival gaps are gamma-distributed with shape = burstiness and mean 1 / rate: burstiness 1 is a
Poisson process, below 1 burstier, above 1 more regular (vLLM's definition). Sessions start at
those arrivals (or at their own trace timestamps); a multi-turn session sends its next turn only
after the previous reply and its think time. The clock starts after the warm-up.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import numpy as np
from tqdm.auto import tqdm

from prefixserve.bench.load.client import Prompt
from prefixserve.bench.load.metrics import RequestResult
from prefixserve.bench.load.workloads import Session

SendFn = Callable[[Prompt, str, float], Awaitable[RequestResult]]


@dataclass
class LoadShape:
    request_rate: float = math.inf          # sessions per second; inf: all at once
    burstiness: float = 1.0
    max_concurrency: int | None = None      # requests in flight at most (closed loop)
    duration_s: float | None = None         # issue nothing new after this
    seed: int = 0

    def describe(self) -> str:
        rate = "inf" if math.isinf(self.request_rate) else f"{self.request_rate:g}"
        conc = self.max_concurrency or "unbounded"
        return f"rate={rate}/s burstiness={self.burstiness:g} concurrency={conc}"


def arrival_offsets(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Start offsets (s) of n arrivals; the first arrives at 0."""
    if n <= 0:
        return []
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0 or burstiness <= 0:
        raise ValueError("request rate and burstiness must be positive")
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


@dataclass
class RunOutcome:
    results: list[RequestResult]
    duration: float


async def run_load(sessions: Sequence[Session], send: SendFn, shape: LoadShape,
                   progress: bool = True, desc: str = "bench") -> RunOutcome:
    """Drive the sessions through `send` under the load shape; returns the measured results."""
    offsets = arrival_offsets(len(sessions), shape.request_rate, shape.burstiness, shape.seed)
    starts = [s.arrival_s if s.arrival_s is not None else off
              for s, off in zip(sessions, offsets, strict=True)]
    if shape.duration_s is not None:
        keep = [i for i, t in enumerate(starts) if t < shape.duration_s]
        sessions, starts = [sessions[i] for i in keep], [starts[i] for i in keep]
    sem = asyncio.Semaphore(shape.max_concurrency) if shape.max_concurrency else None
    bar = tqdm(total=sum(len(s.turns) for s in sessions), desc=desc, disable=not progress,
               unit="req", leave=False)
    results: list[RequestResult] = []
    t0 = time.perf_counter()
    deadline = t0 + shape.duration_s if shape.duration_s is not None else math.inf

    async def one(idx: int, session: Session, start: float) -> None:
        await asyncio.sleep(max(0.0, t0 + start - time.perf_counter()))
        for turn, prompt in enumerate(session.turns):
            async with sem if sem is not None else contextlib.nullcontext():
                if time.perf_counter() >= deadline:
                    return
                sent_at = time.perf_counter() - t0
                result = await send(prompt, f"{idx}-{turn}", sent_at)
            results.append(result)
            bar.update(1)
            if session.think_time_s and turn + 1 < len(session.turns):
                await asyncio.sleep(session.think_time_s)

    try:
        pairs = enumerate(zip(sessions, starts, strict=True))
        await asyncio.gather(*(one(i, s, t) for i, (s, t) in pairs))
    finally:
        bar.close()
    return RunOutcome(results, time.perf_counter() - t0)


async def warm_up(sessions: Sequence[Session], send: SendFn,
                  concurrency: int = 4) -> list[RequestResult]:
    """Send warm-up requests (not measured); returns the failed ones."""
    outcome = await run_load(sessions, send, LoadShape(max_concurrency=concurrency),
                             progress=False)
    return [r for r in outcome.results if not r.success]
