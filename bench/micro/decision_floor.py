"""What one routing decision costs the router with nothing else running: the floor under the
simulator's decision times (``bench.sim.simulate``), where 64 simulated engines and Redis share the
router's cores and caches.

One :class:`RouterState` routes to ``--workers`` workers registered in a real Redis. Each worker
holds some prompts of each length (their blocks stored through the index's event path), and each
decision asks for one of them with new turn appended, as a chat's next turn does. Per prompt
length it prints the router's CPU time per part (hashing, the lookups, ranking) and in all,
Redis' own time running the decision's lookups (its SLOWLOG, ``bench/micro/redis_time.py``), and
whether every decision found its worker (the chosen worker's confirmed depth is the whole held
prompt): the figures are for decisions that did the full work.

    python -m prefixserve.bench.micro.decision_floor --workers 64 --lengths 2000,8000,32000,80000
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from prefixserve.bench.micro.redis_time import lookup_clock
from prefixserve.bench.percentile import percentile
from prefixserve.cluster.local_redis import LocalRedis
from prefixserve.router.blocks import hash_chain, namespace, token_array
from prefixserve.router.decision import LookupSource, RoutingCore
from prefixserve.router.decision_types import Candidate
from prefixserve.router.events import BlockStored, EventBatch, WorkerLoad
from prefixserve.router.index import IndexSettings, PrefixIndex
from prefixserve.router.index_stores import open_index
from prefixserve.router.router_settings import RouterSettings
from prefixserve.router.router_state import RouterState

BLOCK_SIZE = 16
FINGERPRINT = "decision-floor"
TURN_TOKENS = 800  # appended to a held prompt: the next turn's new text
EVENT_BLOCKS = 512  # blocks per stored event, as a long prefill's steps report them


@dataclass(frozen=True)
class Floor:
    """One prompt length's decisions: ms at the p50 and p99 (the router's CPU per part and in
    all, then Redis' own time), and how many found their worker."""

    tokens: int
    decisions: int
    found: int
    p50: tuple[float, ...]  # CPU: hashing, lookups, ranking, all; Redis' own
    p99: tuple[float, ...]


async def _fill(index: PrefixIndex, names: Sequence[str],
                prompts: Sequence[tuple[list[int], str]]) -> None:
    """Register the workers and store each prompt on its worker."""
    ids: dict[str, int] = {}  # worker name -> index worker id
    for name in names:
        wid = await index.register(name, epoch=1, block_size=BLOCK_SIZE, fingerprint=FINGERPRINT)
        await index.resync(wid, 1, [], 0)
        await index.heartbeat(wid, 1, WorkerLoad(num_running=2, prefill_tokens_per_s=9000.0,
                                                  kv_total_blocks=30_000, kv_empty_blocks=500,
                                                  timestamp=time.time()))
        ids[name] = wid
    seq = dict.fromkeys(ids.values(), 0)
    ns = namespace(FINGERPRINT)
    for prompt, owner in prompts:
        wid = ids[owner]
        chain = hash_chain(prompt, BLOCK_SIZE, ns)
        for start in range(0, len(chain), EVENT_BLOCKS):
            seq[wid] += 1
            batch = (BlockStored(tuple(chain[start : start + EVENT_BLOCKS])),)
            await index.apply(EventBatch(wid, 1, seq[wid], batch))


async def measure(redis_url: str, lengths: Sequence[int], workers: int = 64,
                  prompts_per_length: int = 8, rounds: int = 4, seed: int = 0) -> list[Floor]:
    """Decisions for ``prompts_per_length`` held prompts of each length, ``rounds`` times each
    (the first round warms the router's memo and is not counted)."""
    rng = random.Random(seed)
    names = [f"floor-worker-{i}" for i in range(workers)]
    owners = itertools.cycle(names)
    held = {n: [([rng.randrange(50_000) for _ in range(n)], next(owners))
                for _ in range(prompts_per_length)] for n in lengths}
    model = f"floor-{time.time_ns()}"
    index = open_index(redis_url, model, deadline_s=1.0, settings=IndexSettings())
    try:
        await _fill(index, names, [p for n in lengths for p in held[n]])
        state = RouterState(RouterSettings(model=model, block_size=BLOCK_SIZE,
                                           fingerprint=FINGERPRINT))
        state.gate.check_workers(await index.live_workers(), [], time.time())
        # the router's decision, timed by this thread's CPU clock: its own work, no waits
        core = RoutingCore(state, LookupSource(state, index, None, deadline_s=1.0),
                           clock=time.thread_time)
        candidates = [Candidate(name, queue_len=2) for name in names]
        keys = itertools.count(1)
        with lookup_clock(redis_url) as redis_ms:
            return [await _decisions(core, n, held[n], candidates, rounds, rng, keys,
                                     redis_ms) for n in lengths]
    finally:
        await index.close()


async def _decisions(core: RoutingCore, n: int,
                     prompts: Sequence[tuple[list[int], str]], candidates: list[Candidate],
                     rounds: int, rng: random.Random, keys: Iterator[int],
                     redis_ms: Callable[[], float] | None) -> Floor:
    """``rounds`` decisions for each held prompt of ``n`` tokens and its worker (the first
    round uncounted)."""
    rows, found = [], 0
    for r in range(rounds):
        for prompt, owner in prompts:
            tokens = token_array(prompt + [rng.randrange(50_000) for _ in range(TURN_TOKENS)])
            row, depth = await _decide(core, next(keys), tokens, candidates, owner)
            redis_s = redis_ms() / 1000 if redis_ms is not None else float("nan")
            if r:
                rows.append((*row, redis_s))
                found += depth == n // BLOCK_SIZE
    columns = [[v * 1000 for v in column] for column in zip(*rows, strict=True)]
    return Floor(n, len(rows), found, tuple(percentile(c, 50) for c in columns),
                 tuple(percentile(c, 99) for c in columns))


async def _decide(core: RoutingCore, key: int, tokens: Sequence[int],
                  candidates: list[Candidate], owner: str
                  ) -> tuple[tuple[float, float, float, float], int]:
    """One decision's CPU seconds per part, and the confirmed depth it credited the owner."""
    now = time.time()
    decision = await core.decide(key, tokens, None, candidates, str(key), now)
    best = decision.best
    confirmed = core.state.contexts[key].confirmed  # (sent() retires the context)
    depth = confirmed.get(owner, 0) if best == owner else -1
    core.sent(key, best, str(key), now)
    core.completed(best, str(key))
    parts = (decision.hash_s, decision.match_s, decision.rank_s)
    return (*parts, sum(parts)), depth


def table(floors: Sequence[Floor]) -> str:
    parts = ("hashing", "lookups", "ranking", "all", "Redis")
    head = ["tokens", "decisions", "found",
            *(f"{part} p50" for part in parts), *(f"{part} p99" for part in parts)]
    rows = [head] + [[str(f.tokens), str(f.decisions), str(f.found),
                      *(f"{v:.3f}" for v in (*f.p50, *f.p99))] for f in floors]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True))
                     for row in rows)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--lengths", default="2000,8000,32000,80000",
                        help="comma-separated prompt lengths (tokens held by a worker)")
    parser.add_argument("--prompts", type=int, default=8, help="held prompts per length")
    parser.add_argument("--rounds", type=int, default=6, help="decisions per prompt (the "
                        "first, warming the memo, not counted)")
    parser.add_argument("--redis-url", default=None, help="default: a private redis-server")
    args = parser.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    redis = None if args.redis_url else LocalRedis().start()
    try:
        url = args.redis_url or redis.url
        floors = asyncio.run(measure(url, lengths, args.workers, args.prompts, args.rounds))
    finally:
        if redis is not None:
            redis.close()
    print(f"one router, {args.workers} workers, nothing else running; ms (the router's "
          "CPU per part and in all, Redis' own time running its lookups):", file=sys.stderr)
    print(table(floors))


if __name__ == "__main__":
    main()
