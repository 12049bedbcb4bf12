"""Benchmark of the Redis prefix index against a private local redis-server.

Fills the index with ``--blocks`` blocks (chains of ``--chain-len`` blocks, each chain held by
1-3 of ``--workers`` workers) through the real apply path, then measures lookup latency of
existing 128- and 512-block chains (the walk goes all the way down), event-apply throughput,
and Redis memory per (block, worker) entry. Prints a table with the targets.

    python -m prefixserve.bench.micro.index_bench                  # full size: 1,000,000 blocks
    python -m prefixserve.bench.micro.index_bench --blocks 100000  # scaled down
    python -m prefixserve.bench.micro.index_bench --only-predict   # predicted entries' memory only

It also measures the Redis memory that routing-time predicted entries take under a long-prompt
load (``--predict-prompts`` routed prompts of ``--predict-tokens`` tokens, none cached yet).

Latencies are end to end through redis-py's asyncio client over loopback, with the client and
the server on the same machine. On a small shared host (the dev box has 2 cores shared by
several people) wall-clock numbers mostly measure the scheduler, so the table also reports
redis-server CPU time per operation, which says what one Redis core sustains.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import time

import redis

from prefixserve.bench.percentile import percentile
from prefixserve.cluster.local_redis import LocalRedis
from prefixserve.router.events import BlockRemoved, BlockStored, EventBatch
from prefixserve.router.index import IndexSettings, PrefixIndex, ResultCode
from prefixserve.router.index_stores import open_index

BLOCK_SIZE = 16

TARGETS = {
    "lookup_p99_128_ms": 1.0,
    "lookup_p99_512_ms": 3.0,
    "apply_events_per_s": 200_000,
    "bytes_per_entry": 120,
}


def server_cpu_s(raw: redis.Redis) -> float:
    """CPU seconds the redis-server has used: far less inflated by a busy host than wall time."""
    info = raw.info("cpu")
    return info["used_cpu_user"] + info["used_cpu_sys"]


def random_chains(num_blocks: int, chain_len: int) -> list[list[bytes]]:
    raw = os.urandom(16 * num_blocks)
    digests = [raw[i : i + 16] for i in range(0, len(raw), 16)]
    return [digests[i : i + chain_len] for i in range(0, num_blocks, chain_len)]


async def fill(index: PrefixIndex, ids: list[int], chains, rng: random.Random,
               concurrency: int) -> tuple[int, float, dict[int, int]]:
    """Apply every chain to 1-3 workers as BlockStored batches; returns entries, seconds, seqs."""
    per_worker: dict[int, list[list[bytes]]] = {w: [] for w in ids}
    entries = 0
    for chain in chains:
        for w in rng.sample(ids, rng.randint(1, 3)):
            per_worker[w].append(chain)
            entries += len(chain)
    seqs = dict.fromkeys(ids, 0)
    sem = asyncio.Semaphore(concurrency)

    async def feed(w: int) -> None:
        for chain in per_worker[w]:
            seqs[w] += 1
            async with sem:
                res = await index.apply(EventBatch(w, 1, seqs[w], (BlockStored(tuple(chain)),)))
            assert res is ResultCode.OK, res

    start = time.perf_counter()
    await asyncio.gather(*(feed(w) for w in ids))
    return entries, time.perf_counter() - start, seqs


async def lookup_latency(index: PrefixIndex, chains, depth: int, n: int,
                         rng: random.Random) -> tuple[float, float]:
    samples = []
    for _ in range(n):
        chain = rng.choice(chains)[:depth]
        start = time.perf_counter()
        result = await index.lookup(chain)
        samples.append((time.perf_counter() - start) * 1000)
        assert max(m.confirmed_depth for m in result.matches.values()) == len(chain)
    return percentile(samples, 50), percentile(samples, 99)


async def apply_throughput(index: PrefixIndex, ids: list[int], seqs: dict[int, int],
                           batch_blocks: int, seconds: float,
                           concurrency: int) -> tuple[float, int]:
    """Steady churn: each batch stores ``batch_blocks`` new blocks and evicts the previous ones."""
    events = 0
    stop = time.perf_counter() + seconds

    async def churn(w: int) -> None:
        nonlocal events
        prev: tuple[bytes, ...] = ()
        while time.perf_counter() < stop:
            new = os.urandom(16 * batch_blocks)
            blocks = tuple(new[i : i + 16] for i in range(0, len(new), 16))
            evs = (BlockStored(blocks), BlockRemoved(prev)) if prev else (BlockStored(blocks),)
            seqs[w] += 1
            res = await index.apply(EventBatch(w, 1, seqs[w], evs))
            assert res is ResultCode.OK, res
            events += len(blocks) + len(prev)
            prev = blocks

    start = time.perf_counter()
    await asyncio.gather(*(churn(w) for w in ids[:concurrency]))
    return events / (time.perf_counter() - start), events


async def predict_memory(index: PrefixIndex, raw: redis.Redis, ids: list[int], prompts: int,
                         tokens: int, rng: random.Random) -> tuple[int, float]:
    """Redis memory (bytes) that ``prompts`` predictions of distinct uncached ``tokens``-token
    prompts take, and the seconds they took to write."""
    blocks = tokens // BLOCK_SIZE
    raw.execute_command("MEMORY", "PURGE")
    before = raw.info("memory")["used_memory"]
    start = time.perf_counter()
    for chain in random_chains(prompts * blocks, blocks):
        await index.predict(chain, rng.choice(ids))
    elapsed = time.perf_counter() - start
    return raw.info("memory")["used_memory"] - before, elapsed


async def main(args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    with LocalRedis() as server:
        raw = redis.Redis.from_url(server.url)
        # Predictions live long enough to be measured however slowly they are written.
        settings = IndexSettings(lease_ttl_s=3600, admin_deadline_s=30.0, predict_ttl_s=600,
                                 predict_exact_blocks=args.predict_exact_blocks)
        index = open_index(server.url, "bench", deadline_s=5.0, settings=settings)
        ids = [await index.register(f"replica-{i}", epoch=1, block_size=BLOCK_SIZE,
                                    fingerprint="fp")
               for i in range(args.workers)]
        if args.predict_prompts:
            used, took = await predict_memory(index, raw, ids, args.predict_prompts,
                                              args.predict_tokens, rng)
            print(f"predicted {args.predict_prompts} uncached {args.predict_tokens:,}-token "
                  f"prompts ({args.predict_tokens // BLOCK_SIZE:,} blocks each) in {took:.2f} s: "
                  f"redis used_memory +{used:,} B ({used / args.predict_prompts:,.0f} B per "
                  f"prediction)")
        if args.only_predict:
            await index.close()
            return
        chains = random_chains(args.blocks, args.chain_len)
        mem_before = raw.info("memory")["used_memory"]
        entries, fill_s, seqs = await fill(index, ids, chains, rng, args.concurrency)
        mem_after = raw.info("memory")["used_memory"]
        per_entry = (mem_after - mem_before) / entries
        print(f"filled {args.blocks:,} blocks / {entries:,} (block, worker) entries "
              f"over {args.workers} workers in {fill_s:.1f} s "
              f"({entries / fill_s:,.0f} block events/s, {args.chain_len}-block batches)")

        rows = []
        for depth in (128, 512):
            if depth > args.chain_len:
                continue
            await lookup_latency(index, chains, depth, 50, rng)  # warm up
            cpu0, client0 = server_cpu_s(raw), time.process_time()
            p50, p99 = await lookup_latency(index, chains, depth, args.lookups, rng)
            cpu_ms = (server_cpu_s(raw) - cpu0) / args.lookups * 1000
            client_ms = (time.process_time() - client0) / args.lookups * 1000
            target = TARGETS[f"lookup_p99_{depth}_ms"]
            rows.append((f"lookup {depth}-block chain p50", f"{p50:.3f} ms", "", ""))
            rows.append((f"lookup {depth}-block chain p99", f"{p99:.3f} ms",
                         f"<= {target} ms", "ok" if p99 <= target else "MISS"))
            rows.append((f"  redis CPU per {depth}-block lookup", f"{cpu_ms:.3f} ms", "",
                         "server CPU time (less host-noise than wall time)"))
            rows.append((f"  client CPU per {depth}-block lookup", f"{client_ms:.3f} ms", "",
                         "redis-py + decoding, incl. syscalls"))
        for batch in (32, 512):
            cpu0 = server_cpu_s(raw)
            rate, events = await apply_throughput(index, ids, seqs, batch, args.apply_seconds,
                                                  args.concurrency)
            cpu_us = (server_cpu_s(raw) - cpu0) / events * 1e6
            target = TARGETS["apply_events_per_s"]
            rows.append((f"apply, {batch}-block batches x{args.concurrency} workers",
                         f"{rate:,.0f} ev/s", f">= {target:,}",
                         "ok" if rate >= target else "MISS"))
            rows.append(("  redis CPU per block event", f"{cpu_us:.2f} us", "",
                         f"= {1e6 / cpu_us:,.0f} ev/s per redis core"))
        rows.append(("fill via apply (bulk)", f"{entries / fill_s:,.0f} ev/s", "", ""))
        target = TARGETS["bytes_per_entry"]
        rows.append(("redis memory per (block, worker) entry", f"{per_entry:.1f} B",
                     f"<= {target} B", "ok" if per_entry <= target else "MISS"))
        await index.close()

    width = max(len(r[0]) for r in rows)
    print(f"\n{'metric':<{width}}  {'value':>16}  {'target':>12}  verdict")
    print("-" * (width + 36))
    for name, value, target, verdict in rows:
        print(f"{name:<{width}}  {value:>16}  {target:>12}  {verdict}")
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"\nredis-server: {server.binary}; {os.cpu_count()} cores, load average {load}")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=1_000_000, help="blocks to fill (scale down)")
    p.add_argument("--workers", type=int, default=64)
    p.add_argument("--chain-len", type=int, default=512)
    p.add_argument("--lookups", type=int, default=2000, help="lookups per chain length")
    p.add_argument("--apply-seconds", type=float, default=5.0)
    p.add_argument("--concurrency", type=int, default=8, help="concurrent appliers")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--predict-prompts", type=int, default=100,
                   help="routed long prompts whose predicted entries' memory is measured (0: skip)")
    p.add_argument("--predict-tokens", type=int, default=32768, help="tokens per such prompt")
    p.add_argument("--predict-exact-blocks", type=int,
                   default=IndexSettings.model_fields["predict_exact_blocks"].default,
                   help="IndexSettings.predict_exact_blocks (a huge value: one key per block)")
    p.add_argument("--only-predict", action="store_true",
                   help="measure the predicted entries' memory only (no fill, lookups, applies)")
    return p.parse_args()


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
