"""The Redis prefix index at fleet scale: 1,000 workers x 30,000 blocks (issue "Scale by
simulation", item 5).

A fleet of Llama-3-8B workers on 80 GB GPUs holds ~30,000 16-token KV blocks per GPU, so 1,000
workers put ~30M (block, worker) entries in one model's index. This fills a private redis-server
(``--mode single``) or a 3-shard Redis Cluster (``--mode cluster``) through the real
:meth:`RedisPrefixIndex.apply` path, one EventBatch per conversation per worker, and measures:

* the fill rate (block events/s, and Redis CPU per event);
* Redis memory per (block, worker) entry (``used_memory`` delta / entries);
* lookup p50 / p99 of stored 128- and 512-block chains: alone, with event traffic applied at a
  steady rate by background tasks, and with the fleet's heartbeats (1,000 workers, three per
  lease) on top. Wall time through redis-py plus Redis' own execution time per lookup (SLOWLOG
  at threshold 0: the server-side time of each EVALSHA, no queueing, no client);
* apply throughput at saturation (store + evict churn, 32- and 512-block batches).

Fleet content (``--shared-lens``, ``--pool-chains``, ``--zipf``): every worker holds
``--convs`` conversations of ``--conv-blocks`` blocks. A conversation's first L blocks
(L drawn from ``--shared-lens``) are a prefix of one of ``--pool-chains`` shared chains (system
prompts, documents, few-shot preambles) picked with Zipf popularity; the rest is private. So a
shared block is held by many workers, a private one by one, and a worker that picks the same
shared chain twice holds its blocks once.

    python -m prefixserve.bench.micro.index_scale                     # 1,000 x 30,000, one Redis
    python -m prefixserve.bench.micro.index_scale --convs 6           # scaled down (3M entries)
    python -m prefixserve.bench.micro.index_scale --mode cluster --convs 6   # 3 shards, 3 models
    python -m prefixserve.bench.micro.index_scale --mode groups --convs 6    # 3 shards, 1 model,
                                                                             # 3 groups
    python -m prefixserve.bench.micro.index_scale --mode groups --nodes 6 --shards 6

In a Redis Cluster one model's keys share one hash tag, hence one slot, hence one shard: the
cluster mode fills ``--models`` models whose tags land on different shards, concurrently, and
reports per-shard fill rate and memory (one model's whole index is on one shard). The groups
mode splits one model over ``--shards`` worker groups (``IndexSettings.shards``) whose key
prefixes spread over the ``--nodes`` shards: fill, memory, fan-out lookups and apply saturation
per shard, with the event rate the shards could take with a core each (Redis' own CPU per event
on the busiest shard).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import redis
from redis.crc import key_slot

from prefixserve.bench.micro.redis_time import script_sha, slowlog_ms, slowlog_on
from prefixserve.bench.percentile import percentile
from prefixserve.cluster.local_redis import LocalRedis, LocalRedisCluster
from prefixserve.router.events import BlockRemoved, BlockStored, EventBatch, WorkerLoad
from prefixserve.router.index import IndexSettings, IndexSize, PrefixIndex, ResultCode
from prefixserve.router.index_stores import open_index
from prefixserve.router.redis_index import RedisPrefixIndex
from prefixserve.router.redis_records import key_tag
from prefixserve.router.sharded_index import GROUP_SPAN, ShardedPrefixIndex, group_name

DIGEST = 16
BLOCK_SIZE = 16


def server_cpu_s(raw: redis.Redis) -> float:
    """CPU seconds the redis-server has used (user + sys)."""
    info = raw.info("cpu")
    return info["used_cpu_user"] + info["used_cpu_sys"]




def split(blob: bytes) -> tuple[bytes, ...]:
    """A packed digest blob as the tuple of digests an event carries."""
    return tuple(blob[i : i + DIGEST] for i in range(0, len(blob), DIGEST))


@dataclass
class Fleet:
    """The content every worker of one model holds, generated reproducibly per worker."""

    workers: int
    convs: int
    conv_blocks: int
    pool_chains: int
    shared_lens: list[int]
    zipf: float
    seed: int
    pool: list[bytes] = field(default_factory=list)
    cum: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        rng = random.Random(self.seed)
        self.pool = [rng.randbytes(DIGEST * self.conv_blocks) for _ in range(self.pool_chains)]
        weights = [1.0 / (rank + 1) ** self.zipf for rank in range(self.pool_chains)]
        self.cum = list(itertools.accumulate(weights))

    def conversations(self, worker: int) -> Iterator[bytes]:
        """Worker ``worker``'s conversations as packed digest blobs."""
        rng = random.Random(self.seed * 1_000_003 + worker)
        for _ in range(self.convs):
            shared = rng.choice(self.shared_lens)
            (chain,) = rng.choices(range(self.pool_chains), cum_weights=self.cum)
            head = self.pool[chain][: DIGEST * shared]
            yield head + rng.randbytes(DIGEST * (self.conv_blocks - shared))


@dataclass
class Model:
    """One model's index in the store, its workers and the chains kept for lookups."""

    name: str
    index: PrefixIndex
    # per worker group (one unless --shards): its store and a plain client of the shard
    # holding the group's slot
    parts: list[tuple[RedisPrefixIndex, redis.Redis]]
    ids: list[int]
    seqs: dict[int, int]
    samples: list[bytes] = field(default_factory=list)
    # as the store counts it, after the fill
    size: IndexSize = field(default_factory=lambda: IndexSize(0, 0, 0))

    @property
    def entries(self) -> int:
        return self.size.entries

    @property
    def blocks(self) -> int:
        return self.size.blocks


    @property
    def raw(self) -> redis.Redis:
        """The shard of an unsharded model."""
        (part,) = self.parts
        return part[1]

    def shards(self) -> list[redis.Redis]:
        """The distinct shards holding the model's groups."""
        return list({id(raw): raw for _, raw in self.parts}.values())

    def spread(self, n: int) -> list[int]:
        """``n`` workers, rounded up to a multiple of the groups, as many from each: publishers
        that load every group alike, as a fleet's whole set of workers does."""
        by_group: dict[int, list[int]] = {}
        for w in self.ids:
            by_group.setdefault(w // GROUP_SPAN, []).append(w)  # 0 for an unsharded model
        per = -(-n // len(self.parts))
        return [w for ws in by_group.values() for w in ws[:per]]

    def part(self, worker_id: int) -> tuple[RedisPrefixIndex, redis.Redis, int]:
        """A worker's group store, its shard and the worker's id there."""
        group, local = divmod(worker_id, GROUP_SPAN) if len(self.parts) > 1 else (0, worker_id)
        return *self.parts[group], local


async def open_model(url: str, name: str, raw_of: Callable[[str], redis.Redis], workers: int,
                     shards: int = 1, event_log: int = 0) -> Model:
    """Register ``workers`` replicas of ``name`` (leases long enough for the whole run);
    ``raw_of(tag)`` is the plain client of the shard holding a key prefix's slot;
    ``event_log``: keep the index's event log this long, as routers following it ask (0: no
    log, as a fleet this size runs)."""
    settings = IndexSettings(lease_ttl_s=7200, admin_deadline_s=60.0, shards=shards)
    index = open_index(url, name, deadline_s=30.0, settings=settings)
    stores = index.stores if isinstance(index, ShardedPrefixIndex) else [index]
    assert all(isinstance(s, RedisPrefixIndex) for s in stores)
    if event_log:
        for store in stores:
            await store.keep_log(event_log)
    parts = [(s, raw_of(s.tag)) for s in stores]
    ids = [await index.register(f"{name}-gpu-{i}", epoch=1, block_size=BLOCK_SIZE,
                                fingerprint="llama-3-8b", node=f"node-{i // 8}")
           for i in range(workers)]
    return Model(name, index, parts, ids, dict.fromkeys(ids, 0))


async def fill(model: Model, fleet: Fleet, concurrency: int, keep: int,
               rng: random.Random) -> float:
    """Apply every worker's conversations, one BlockStored batch each, round-robin over the
    workers as a fleet publishes; returns the seconds it took."""
    def batches() -> Iterator[tuple[int, bytes]]:
        gens = [(w, fleet.conversations(i)) for i, w in enumerate(model.ids)]
        for _ in range(fleet.convs):
            for w, gen in gens:
                yield w, next(gen)

    feed = batches()
    keep_p = keep / (fleet.workers * fleet.convs)

    async def publisher() -> None:
        for w, blob in feed:
            model.seqs[w] += 1
            res = await model.index.apply(EventBatch(w, 1, model.seqs[w],
                                                     (BlockStored(split(blob)),)))
            assert res is ResultCode.OK, res
            if rng.random() < keep_p:
                model.samples.append(blob)

    start = time.perf_counter()
    await asyncio.gather(*(publisher() for _ in range(concurrency)))
    took = time.perf_counter() - start
    model.size = await model.index.size()
    return took


class Churn:
    """Background KV events: ``workers`` workers each store ``batch`` new blocks and evict
    their previous batch, paced to ``rate`` block events/s in total (0: as fast as it goes)."""

    def __init__(self, model: Model, workers: list[int], batch: int, rate: float) -> None:
        self.model, self.workers, self.batch, self.rate = model, workers, batch, rate
        self.events = 0
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    async def _run(self, w: int) -> None:
        prev: tuple[bytes, ...] = ()
        interval = len(self.workers) * 2 * self.batch / self.rate if self.rate else 0.0
        nxt = time.perf_counter()
        while not self._stop.is_set():
            blocks = split(os.urandom(DIGEST * self.batch))
            evs = (BlockStored(blocks), BlockRemoved(prev)) if prev else (BlockStored(blocks),)
            self.model.seqs[w] += 1
            res = await self.model.index.apply(EventBatch(w, 1, self.model.seqs[w], evs))
            assert res is ResultCode.OK, res
            self.events += len(blocks) + len(prev)
            prev = blocks
            if interval:
                nxt += interval
                await asyncio.sleep(max(0.0, nxt - time.perf_counter()))

    def start(self) -> Churn:
        self._t0 = time.perf_counter()
        self._tasks = [asyncio.ensure_future(self._run(w)) for w in self.workers]
        return self

    async def stop(self) -> float:
        """Stops the churn; returns the event rate it achieved."""
        self._stop.set()
        await asyncio.gather(*self._tasks)
        return self.events / (time.perf_counter() - self._t0)


class Heartbeats:
    """The fleet's heartbeats: every worker three times per lease (10 s), with a fresh load."""

    def __init__(self, model: Model, per_s: float) -> None:
        self.model, self.per_s = model, per_s
        self._stop = asyncio.Event()

    async def _run(self) -> None:
        i, nxt = 0, time.perf_counter()
        while not self._stop.is_set():
            w = self.model.ids[i % len(self.model.ids)]
            load = WorkerLoad(num_running=i % 40, num_waiting=i % 7, kv_usage=0.9,
                              timestamp=time.time())
            await self.model.index.heartbeat(w, 1, load)
            i += 1
            nxt += 1.0 / self.per_s
            await asyncio.sleep(max(0.0, nxt - time.perf_counter()))

    def start(self) -> Heartbeats:
        self._task = asyncio.ensure_future(self._run())
        return self

    async def stop(self) -> None:
        self._stop.set()
        await self._task


async def lookups(model: Model, depth: int, n: int, rng: random.Random) -> list[float]:
    """Wall times (ms) of ``n`` lookups of stored chains cut to ``depth`` blocks."""
    samples = []
    for _ in range(n):
        chain = split(rng.choice(model.samples)[: DIGEST * depth])
        start = time.perf_counter()
        result = await model.index.lookup(chain)
        samples.append((time.perf_counter() - start) * 1000)
        assert max(m.confirmed_depth for m in result.matches.values()) == depth
    return samples


async def lookup_phase(model: Model, label: str, n: int, rng: random.Random,
                       churn: tuple[int, int, float] | None, heartbeats: float) -> list[dict]:
    """Lookups of 128- and 512-block chains under the given background traffic. A sharded
    model's lookup is one script call per group: Redis times are per call, CPU is summed."""
    raws, sha = model.shards(), script_sha("lookup")
    rows = []
    for depth in (128, 512):
        await lookups(model, depth, 50, rng)  # warm (and refresh the worker list)
        bg = Churn(model, model.ids[-churn[0]:], churn[1], churn[2]).start() if churn else None
        hb = Heartbeats(model, heartbeats).start() if heartbeats else None
        await asyncio.sleep(0.2)
        for raw in raws:
            raw.slowlog_reset()
        cpu0, t0 = sum(map(server_cpu_s, raws)), time.perf_counter()
        wall = await lookups(model, depth, n, rng)
        elapsed = time.perf_counter() - t0
        cpu = sum(map(server_cpu_s, raws)) - cpu0
        server = [ms for raw in raws for ms in slowlog_ms(raw, sha)]
        rate = await bg.stop() if bg else 0.0
        if hb:
            await hb.stop()
        rows.append({
            "phase": label, "depth": depth, "n": n,
            "wall_p50_ms": percentile(wall, 50), "wall_p99_ms": percentile(wall, 99),
            "redis_p50_ms": percentile(server, 50) if server else None,
            "redis_p99_ms": percentile(server, 99) if server else None,
            "redis_cpu_busy": cpu / elapsed,
            "redis_cpu_per_lookup_ms": cpu / n * 1000 if not churn and not heartbeats else None,
            "events_per_s": rate, "heartbeats_per_s": heartbeats,
            "loadavg": os.getloadavg()[0],
        })
        print(json.dumps(rows[-1]), flush=True)
    return rows


async def saturation(model: Model, batch: int, workers: int, seconds: float) -> dict:
    """Apply throughput with ``workers`` concurrent publishers churning as fast as they can
    (a sharded model's: as many in each group, ``workers`` rounded up to a multiple of the
    groups; CPU per shard)."""
    raws, sha = model.shards(), script_sha("apply")
    for raw in raws:
        raw.slowlog_reset()
    cpu0 = [server_cpu_s(raw) for raw in raws]
    publishers = model.spread(workers)
    bg = Churn(model, publishers, batch, 0.0).start()
    await asyncio.sleep(seconds)
    rate = await bg.stop()
    cpu = [server_cpu_s(raw) - c for raw, c in zip(raws, cpu0, strict=True)]
    server = [ms for raw in raws for ms in slowlog_ms(raw, sha)]
    row = {"phase": f"saturation {batch}-block batches x{len(publishers)}", "events_per_s": rate,
           "events": bg.events, "redis_cpu_us_per_event": sum(cpu) / bg.events * 1e6,
           "redis_cpu_s_per_shard": cpu,
           # the event rate at which the busiest shard would use a whole core: what the shards
           # can take when each has a core of its own (a 2-vCPU machine's clients saturate
           # first, so the wall-clock rate above cannot show it)
           "capacity_events_per_s": bg.events / max(cpu),
           "apply_p50_ms": percentile(server, 50) if server else None,
           "apply_p99_ms": percentile(server, 99) if server else None,
           "apply_max_ms": max(server) if server else None,
           "loadavg": os.getloadavg()[0]}
    print(json.dumps(row), flush=True)
    return row


def memory(raw: redis.Redis) -> int:
    raw.execute_command("MEMORY", "PURGE")
    return int(raw.info("memory")["used_memory"])


async def run_single(args: argparse.Namespace, fleet: Fleet) -> dict:
    rng = random.Random(args.seed)
    with LocalRedis() as server:
        raw = redis.Redis.from_url(server.url)
        raw.config_set("slowlog-log-slower-than", -1)
        model = await open_model(server.url, "llama3-8b", lambda _: raw, args.workers,
                                 event_log=args.event_log)
        before = memory(raw)
        cpu0 = server_cpu_s(raw)
        took = await fill(model, fleet, args.concurrency, args.keep, rng)
        fill_cpu = server_cpu_s(raw) - cpu0
        after = memory(raw)
        mem = raw.info("memory")
        out: dict = {
            "mode": "single", "workers": args.workers, "entries": model.entries,
            "distinct_blocks": model.blocks, "holders_per_block": model.entries / model.blocks,
            "fill_s": took, "fill_events_per_s": model.entries / took,
            "fill_redis_cpu_us_per_event": fill_cpu / model.entries * 1e6,
            "used_memory_delta": after - before,
            "bytes_per_entry": (after - before) / model.entries,
            "reverse_index_bytes": model.size.reverse_index_bytes,
            "used_memory_rss": mem["used_memory_rss"],
            "fill_loadavg": os.getloadavg()[0],
        }
        print(json.dumps(out), flush=True)
        slowlog_on(raw)
        rows = await lookup_phase(model, "alone", args.lookups, rng, None, 0)
        if args.only_lookups:
            out["rows"] = rows
            await model.index.close()
            return out
        churn = (args.churn_workers, args.churn_batch, args.event_rate)
        rows += await lookup_phase(model, "with events", args.lookups, rng, churn, 0)
        rows += await lookup_phase(model, "with events + heartbeats", args.lookups, rng, churn,
                                   args.workers * 3 / 10)
        for batch in (32, 512):
            rows.append(await saturation(model, batch, args.concurrency, args.apply_seconds))
        out["rows"] = rows
        out["redis"] = server.binary
        await model.index.close()
        return out


def node_of(tag: str, slots_per_node: list[tuple[int, int]]) -> int:
    """The shard whose slot range holds key prefix ``{tag}``."""
    slot = key_slot(("{" + tag + "}").encode())
    return next(i for i, (lo, hi) in enumerate(slots_per_node) if lo <= slot <= hi)


def pick_grouped(groups: int, slots_per_node: list[tuple[int, int]]) -> str:
    """A model name whose worker groups' key prefixes spread evenly over the shards."""
    shards = len(slots_per_node)
    for k in itertools.count():
        name = f"llama{k}"
        nodes = [node_of(key_tag(group_name(name, g)), slots_per_node) for g in range(groups)]
        if all(abs(nodes.count(i) - groups / shards) < 1 for i in range(shards)):
            return name
    raise AssertionError


def pick_models(n: int, slots_per_node: list[tuple[int, int]]) -> list[str]:
    """Model names whose hash tags land on ``n`` different shards."""
    names: list[str] = []
    taken: set[int] = set()
    for k in itertools.count():
        name = f"llama{k}"
        node = node_of(key_tag(name), slots_per_node)
        if node not in taken:
            taken.add(node)
            names.append(name)
        if len(names) == n:
            return names
    raise AssertionError


def cluster_nodes(cluster: LocalRedisCluster) -> tuple[list[redis.Redis], list[tuple[int, int]]]:
    """A plain client of each shard and the slot range it serves."""
    return [redis.Redis(port=s.port) for s in cluster.servers], cluster.slot_ranges


async def run_groups(args: argparse.Namespace, fleet: Fleet) -> dict:
    """One model split over ``--shards`` worker groups spread over a ``--nodes``-shard
    cluster."""
    rng = random.Random(args.seed)
    cluster = LocalRedisCluster(args.nodes).start()
    try:
        raws, ranges = cluster_nodes(cluster)
        name = pick_grouped(args.shards, ranges)
        url = cluster.url
        model = await open_model(url, name, lambda tag: raws[node_of(tag, ranges)],
                                 args.workers, args.shards)
        for r in raws:
            r.config_set("slowlog-log-slower-than", -1)
        before = [memory(r) for r in raws]
        cpu0 = [server_cpu_s(r) for r in raws]
        took = await fill(model, fleet, args.concurrency, args.keep, rng)
        cpu = [server_cpu_s(r) - c for r, c in zip(raws, cpu0, strict=True)]
        grown = [memory(r) - b for r, b in zip(raws, before, strict=True)]
        out: dict = {
            "mode": "groups", "workers": args.workers, "groups": args.shards,
            "groups_per_shard": [sum(raw is r for _, raw in model.parts) for r in raws],
            "entries": model.entries, "group_blocks": model.blocks,
            "fill_s": took, "fill_events_per_s": model.entries / took,
            "fill_redis_cpu_us_per_event": sum(cpu) / model.entries * 1e6,
            "fill_redis_cpu_share_per_shard": [c / sum(cpu) for c in cpu],
            "used_memory_delta_per_shard": grown,
            "bytes_per_entry": sum(grown) / model.entries,
            "fill_loadavg": os.getloadavg()[0],
        }
        print(json.dumps(out), flush=True)
        for r in raws:
            slowlog_on(r)
        rows = await lookup_phase(model, "groups, alone", args.lookups, rng, None, 0)
        churn = (args.churn_workers, args.churn_batch, args.event_rate)
        rows += await lookup_phase(model, "groups, with events", args.lookups, rng, churn, 0)
        for batch in (32, 512):
            rows.append(await saturation(model, batch, args.concurrency, args.apply_seconds))
        out["rows"] = rows
        await model.index.close()
        return out
    finally:
        cluster.close()


async def run_cluster(args: argparse.Namespace, fleet: Fleet) -> dict:
    rng = random.Random(args.seed)
    cluster = LocalRedisCluster(args.models).start()
    try:
        raws, ranges = cluster_nodes(cluster)
        names = pick_models(args.models, ranges)
        url = cluster.url
        models = []
        for name in names:
            node = node_of(key_tag(name), ranges)
            models.append(await open_model(url, name, lambda _, r=raws[node]: r, args.workers))
        for r in raws:
            r.config_set("slowlog-log-slower-than", -1)
        before = [memory(r) for r in raws]
        cpu0 = [server_cpu_s(r) for r in raws]
        t0 = time.perf_counter()
        took = await asyncio.gather(*(fill(m, fleet, args.concurrency, args.keep, rng)
                                      for m in models))
        wall = time.perf_counter() - t0
        cpu = [server_cpu_s(r) - c for r, c in zip(raws, cpu0, strict=True)]
        after = [memory(r) for r in raws]
        shards = []
        for i, r in enumerate(raws):
            held = [m for m in models if m.raw is r]
            entries = sum(m.entries for m in held)
            shards.append({
                "shard": i, "slots": ranges[i], "models": [m.name for m in held],
                "entries": entries, "distinct_blocks": sum(m.blocks for m in held),
                "used_memory_delta": after[i] - before[i],
                "bytes_per_entry": (after[i] - before[i]) / entries if entries else None,
                "fill_events_per_s": entries / max(took[models.index(m)] for m in held)
                if held else 0,
                "redis_cpu_s": cpu[i],
                "redis_cpu_us_per_event": cpu[i] / entries * 1e6 if entries else None,
            })
            print(json.dumps(shards[-1]), flush=True)
        out: dict = {"mode": "cluster", "workers_per_model": args.workers, "shards": shards,
                     "fill_wall_s": wall,
                     "fill_events_per_s_total": sum(m.entries for m in models) / wall,
                     "fill_loadavg": os.getloadavg()[0]}
        print(json.dumps({k: v for k, v in out.items() if k != "shards"}), flush=True)
        for r in raws:
            slowlog_on(r)
        first, others = models[0], models[1:]
        churn = (args.churn_workers, args.churn_batch, args.event_rate)
        rows = await lookup_phase(first, "cluster, alone", args.lookups, rng, None, 0)
        # events flowing on the SAME model (its shard) ...
        rows += await lookup_phase(first, "cluster, events on its shard", args.lookups, rng,
                                   churn, 0)
        # ... and on the other models only (other shards): what spreading models buys
        bgs = [Churn(m, m.ids[-args.churn_workers:], args.churn_batch, args.event_rate).start()
               for m in others]
        rows += await lookup_phase(first, "cluster, events on the other shards", args.lookups,
                                   rng, None, 0)
        out["other_shards_events_per_s"] = [await bg.stop() for bg in bgs]
        out["rows"] = rows
        for m in models:
            await m.index.close()
        return out
    finally:
        cluster.close()


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("single", "cluster", "groups"), default="single",
                   help="one Redis; 3 shards, one model each; 3 shards, one model over "
                   "--shards worker groups")
    p.add_argument("--shards", type=int, default=3, help="groups mode: worker groups")
    p.add_argument("--nodes", type=int, default=3, help="groups mode: the cluster's shards")
    p.add_argument("--workers", type=int, default=1000, help="workers per model")
    p.add_argument("--convs", type=int, default=59,
                   help="conversations per worker (59 x 512 blocks ~ 30,000 blocks)")
    p.add_argument("--conv-blocks", type=int, default=512)
    p.add_argument("--pool-chains", type=int, default=4096, help="shared prefix chains")
    p.add_argument("--shared-lens", default="0,32,128,256,512",
                   help="a conversation's shared prefix length, drawn uniformly from these")
    p.add_argument("--zipf", type=float, default=1.0, help="popularity skew of shared chains")
    p.add_argument("--models", type=int, default=3, help="cluster mode: models (one a shard)")
    p.add_argument("--concurrency", type=int, default=16, help="concurrent publishers")
    p.add_argument("--keep", type=int, default=4000, help="conversations kept for lookups")
    p.add_argument("--lookups", type=int, default=2000, help="lookups per chain length")
    p.add_argument("--event-rate", type=float, default=50_000,
                   help="background block events/s during lookups")
    p.add_argument("--churn-workers", type=int, default=32)
    p.add_argument("--churn-batch", type=int, default=32, help="blocks stored per batch")
    p.add_argument("--apply-seconds", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--event-log", type=int, default=0,
                   help="single mode: keep the index's event log this long, as routers that "
                   "follow it ask (IndexSettings.event_log); 0 keeps none, as a fleet of 1,000 "
                   "workers runs (its routers ask the index)")
    p.add_argument("--only-lookups", action="store_true",
                   help="single mode: fill, memory and lookups without background traffic")
    p.add_argument("--json", type=Path, help="write the results here too")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    fleet = Fleet(args.workers, args.convs, args.conv_blocks, args.pool_chains,
                  [int(x) for x in args.shared_lens.split(",")], args.zipf, args.seed)
    run = {"single": run_single, "cluster": run_cluster, "groups": run_groups}[args.mode]
    out = asyncio.run(run(args, fleet))
    out["args"] = vars(args) | {"json": str(args.json)}
    out["cores"], out["loadavg_end"] = os.cpu_count(), os.getloadavg()
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
