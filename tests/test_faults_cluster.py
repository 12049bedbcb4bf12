"""Faults and leaks on a real cluster: real Ray Serve, real Redis, real HTTP, the built-in model.

One module-scoped cluster (ingress + 2 CPU workers with fractional CPUs, a small KV cache so
the scheduler preempts, a 3 s lease) serves every test, each under a steady request stream from
a background thread (:class:`bench.load.soak.LoadStream`). Every request must end within its timeout
(``hung == 0``). Order matters: the destructive tests (Redis outage, killed replica) come last.
Each test prints its figures (sent / ok / cancelled / clean errors / failed / hung, recovery).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest
import ray
from ray import serve
from servekit import serve_app, wait_for

from prefixserve.bench.load.soak import (
    CANCELLED,
    CLEAN_ERROR,
    FAILED,
    HUNG,
    OK,
    LoadStream,
    check_leaks,
    index_view,
    run_soak,
    summarize,
    wait_idle,
    worker_ids,
    worker_stats,
)
from prefixserve.cluster.config import ClusterConfig
from prefixserve.cluster.local_redis import LocalRedis
from prefixserve.router.blocks import hash_chain, namespace
from prefixserve.router.call_routing import NoSuchReplica
from prefixserve.router.index import INDEX_KEY_BYTES, PrefixIndex
from prefixserve.router.index_stores import open_index
from prefixserve.workers.checkpoints import BUILTIN_MODEL_NAME

APP = "prefixserve-faults"
MODEL = "prefixserve-tiny"
LEASE_TTL_S = 3.0
BLOCK = 16
pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def cluster(redis_server: LocalRedis) -> Iterator[str]:
    config = ClusterConfig(
        model=BUILTIN_MODEL_NAME,
        redis_url=redis_server.url, num_workers=2, cpus_per_worker=0.5, cpus_per_ingress=0.25,
        num_blocks=48, max_model_len=512, max_num_seqs=16, lease_ttl_s=LEASE_TTL_S,
        lookup_deadline_s=0.05,
    )
    with serve_app(config, APP) as url:
        assert wait_for(lambda: len(worker_ids(APP)) == 2, 60)
        yield url


def report(name: str, outcomes, **extra) -> dict:
    figures = {**summarize(outcomes), **extra}
    print(f"\nFAULT {name}: {json.dumps(figures, default=str)}")
    return figures


async def index_call(url: str, fn):
    index = open_index(url, MODEL, deadline_s=1.0)
    try:
        return await fn(index)
    finally:
        await index.close()


def depths(url: str, chain: list[bytes]) -> dict[str, int]:
    async def go(index: PrefixIndex) -> dict[str, int]:
        return {k: m.confirmed_depth for k, m in (await index.lookup(chain)).matches.items()}
    return asyncio.run(index_call(url, go))


def live(url: str) -> dict[str, tuple[int, int]]:
    """replica id -> (worker id, epoch) of the workers with a live lease."""
    async def go(index: PrefixIndex) -> dict[str, tuple[int, int]]:
        return {w.replica_id: (w.worker_id, w.epoch) for w in await index.live_workers()}
    return asyncio.run(index_call(url, go))


def complete(url: str, prompt: list[int], max_tokens: int = 2, **kw) -> httpx.Response:
    r = httpx.post(f"{url}/v1/completions", timeout=60, json={
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **kw})
    assert r.status_code == 200, r.text
    return r


def prompt_of(seed: int, blocks: int = 6) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(250) for _ in range(blocks * BLOCK)]


def assert_no_hangs(figures: dict) -> None:
    assert figures[HUNG] == 0, figures


# -- 3. client disconnects ---------------------------------------------------------------------


def test_client_disconnects_at_random_points_return_every_block(cluster: str) -> None:
    with LoadStream(cluster, concurrency=2, max_requests=60, seed=3) as background:
        outcomes = asyncio.run(run_soak(cluster, 150, concurrency=12, seed=3, cancel_frac=1.0,
                                        max_tokens=48))
    idle, stats, idle_s = wait_idle(APP, 30)
    figures = report("client-disconnects", outcomes, background=summarize(background.outcomes),
                     idle_after_s=round(idle_s, 2),
                     blocks={w: (s["num_free_blocks"], s["num_total_blocks"])
                             for w, s in stats.items()})
    assert figures[CANCELLED] >= 80, figures  # most streams were cut off mid-way
    assert figures[FAILED] == 0 and figures[CLEAN_ERROR] == 0, figures
    assert_no_hangs(figures)
    assert background.outcomes and all(o.kind == OK for o in background.outcomes), \
        summarize(background.outcomes)
    assert idle, stats  # free + used == total, nothing running: every block came back


# -- 4. soak (short) ---------------------------------------------------------------------------


def test_short_soak_leaks_no_blocks_index_entries_or_memory(
    cluster: str, redis_server: LocalRedis
) -> None:
    rss = {w: s["rss_bytes"] for w, s in worker_stats(APP).items()}
    start = time.monotonic()
    outcomes = asyncio.run(run_soak(cluster, 150, concurrency=16, seed=4, cancel_frac=0.2))
    elapsed = time.monotonic() - start
    leaks = check_leaks(APP, redis_server.url, MODEL, rss, rss_growth_bound=256 << 20)
    figures = report("soak-short", outcomes, elapsed_s=round(elapsed, 1), **leaks)
    assert figures[FAILED] == 0 and figures[CLEAN_ERROR] == 0, figures
    assert_no_hangs(figures)
    assert figures[OK] + figures[CANCELLED] == 150
    assert sum(w["preemptions"] for w in leaks["workers"].values()) > 0, leaks  # small KV cache
    assert leaks["problems"] == [], leaks["problems"]


# -- 1. Redis killed mid-stream ----------------------------------------------------------------


def test_redis_killed_mid_stream_fails_open_and_workers_resync(
    cluster: str, redis_server: LocalRedis
) -> None:
    with LoadStream(cluster, concurrency=3, max_requests=300, seed=5) as background:
        time.sleep(1.0)
        killed_at = time.monotonic()
        redis_server.stop()
        time.sleep(4.0)  # longer than the lease: Redis restarts empty, every worker re-registers
        during = background.since(killed_at)
        redis_server.start()
        restarted = time.monotonic()

        def resynced() -> bool:
            stats = worker_stats(APP)
            return (len(live(redis_server.url)) == len(stats) == 2
                    and all(s["index_synced"] for s in stats.values()))

        assert wait_for(resynced, 30, 0.1), worker_stats(APP)
        resync_s = time.monotonic() - restarted
        time.sleep(1.0)
    # Once idle, the index holds exactly each worker's cached blocks again, nothing else.
    leaks = check_leaks(APP, redis_server.url, MODEL, timeout_s=20)
    assert leaks["problems"] == [], leaks
    # Prefix routing works again: a fresh prefix lands somewhere, the index learns it, and the
    # next request with that prefix is routed there through the index.
    q = prompt_of(2)
    first = complete(cluster, [*q, 4]).headers["x-prefixserve-worker"]
    fp = worker_stats(APP)[first]["fingerprint"]
    chain_q = hash_chain(q, BLOCK, namespace(fp))
    assert wait_for(lambda: depths(redis_server.url, chain_q).get(first, 0) >= 6, 30)
    routed_s = time.monotonic() - restarted
    time.sleep(2.5)  # past every predicted entry and the router's own memory
    again = complete(cluster, [*q, 5])
    figures = report("redis-killed", background.outcomes, during_outage=len(during),
                     during_max_s=round(max((o.ended - o.started for o in during), default=0), 3),
                     resync_s=round(resync_s, 2), prefix_routing_back_s=round(routed_s, 2),
                     index_entries=leaks["index"]["entries"])
    assert len(during) > 0
    assert figures[OK] == figures["sent"], figures  # zero failed requests
    assert_no_hangs(figures)
    assert again.headers["x-prefixserve-worker"] == first
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 6 * BLOCK


# -- 5. hostile index contents under load ------------------------------------------------------


def test_junk_in_the_index_under_load_never_fails_a_request(
    cluster: str, redis_server: LocalRedis
) -> None:
    import redis as redis_lib

    from prefixserve.router.redis_records import key_tag

    stats = worker_stats(APP)
    (_, sa), (_, sb) = sorted(stats.items())
    fp = sa["fingerprint"]
    hot = prompt_of(3)
    chain = hash_chain(hot, BLOCK, namespace(fp))
    p = "{" + key_tag(MODEL) + "}"
    raw = redis_lib.Redis.from_url(redis_server.url)
    far = 2**45
    with LoadStream(cluster, concurrency=3, max_requests=200, seed=8) as background:
        time.sleep(0.5)
        for h in chain:  # predicted entries that do not parse (they expire, like real ones)
            raw.set((p + "q").encode() + h, b"\x00\x01not-a-number!", px=3000)
        raw.zadd(p + "live", {b"\x07": far, b"\x00\x01\x02": far, b"\x01\x2c": far})
        raw.sadd(p + "reg", "junk", "70000")
        raw.hset(p + "ids", "ghost-replica", "not-an-id")
        raw.hset(p + "load", mapping={sa["worker_id"].to_bytes(2, "big"): b"\x85\xa4ty"})
        raw.hset(p + "w:" + str(sb["worker_id"]), "epoch", "garbage")  # B's record corrupt
        raw.incr(p + "lv")
        raw.incr(p + "rv")
        mid = complete(cluster, [*hot, 1])  # served while the junk is there
        time.sleep(4.0)
    raw.close()
    figures = report("index-junk", background.outcomes)
    assert figures[OK] == figures["sent"] > 0, figures
    assert mid.status_code == 200
    # The workers heal the index (B re-registers and resyncs, GC drops the junk members) ...
    leaks = check_leaks(APP, redis_server.url, MODEL, timeout_s=20)
    assert leaks["problems"] == [], leaks
    assert sorted(live(redis_server.url)) == sorted(stats)
    # ... and prefix routing works: the hot prefix's holder is found through the index.
    holder = complete(cluster, [*hot, 2]).headers["x-prefixserve-worker"]
    assert wait_for(lambda: depths(redis_server.url, chain).get(holder, 0) >= 6, 10)
    time.sleep(2.5)
    again = complete(cluster, [*hot, 3])
    assert again.headers["x-prefixserve-worker"] == holder
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 6 * BLOCK


# -- 2. a worker replica killed mid-stream -----------------------------------------------------


def _replica_actor(replica: str):
    for a in ray.util.list_named_actors(all_namespaces=True):
        if a["name"].endswith(f"#LLMWorker#{replica}"):
            return ray.get_actor(a["name"], namespace=a["namespace"])
    raise LookupError(replica)


@dataclass
class LongStream:
    """One long SSE stream seen by the client."""

    status: int = 0
    worker: str = ""  # x-prefixserve-worker: the replica that produced its first output
    first_at: float | None = None  # time.monotonic() of the first content event
    events: list[str] = field(default_factory=list)

    @property
    def clean_end(self) -> bool:
        return (self.status == 200 and self.events[-1:] == ["[DONE]"]
                and "error" not in json.loads(self.events[-2]))

    @property
    def error_end(self) -> bool:
        return self.events[-1:] == ["[DONE]"] and "error" in json.loads(self.events[-2])


async def _long_stream(url: str, prompt: list[int], out: LongStream,
                       timeout_s: float = 90.0) -> None:
    body = {"prompt": prompt, "max_tokens": 300, "ignore_eos": True, "stream": True}

    async def go() -> None:
        async with (httpx.AsyncClient(timeout=timeout_s) as client,
                    client.stream("POST", f"{url}/v1/completions", json=body) as r):
            out.status = r.status_code
            out.worker = r.headers.get("x-prefixserve-worker", "")
            async for line in r.aiter_lines():
                if line:
                    out.events.append(line.removeprefix("data: "))
                    out.first_at = out.first_at or time.monotonic()

    try:
        await asyncio.wait_for(go(), timeout_s)
    except asyncio.TimeoutError:
        out.events.append("<HUNG>")


def _watch_index(url: str, victim: str, old_id: int, kill_at: float,
                 timeout_s: float = 30.0) -> dict:
    """Seconds from the kill until the victim's lease lapsed, and until its entries were gone."""
    out: dict = {"hidden_s": None, "collected_s": None}
    while time.monotonic() - kill_at < timeout_s and out["collected_s"] is None:
        now = time.monotonic() - kill_at
        alive = live(url)
        if out["hidden_s"] is None and victim not in alive:
            out["hidden_s"] = round(now, 2)
        view = index_view(url, MODEL)
        reused = any(wid == old_id for rid, (wid, _) in alive.items() if rid != victim)
        if out["hidden_s"] is not None and (reused or (old_id not in view["registered"]
                                                       and old_id not in view["blocks"])):
            out["collected_s"] = round(now, 2)
        time.sleep(0.1)
    return out


def _stats_of(worker: str, timeout_s: float = 60.0) -> dict:
    """A replica's stats once this process's handle routes to it (a new one shows up late)."""
    handle = serve.get_deployment_handle("LLMWorker", APP)
    found: dict = {}

    def ask() -> bool:
        try:
            found.update(handle.stats.remote(target_worker=worker).result(timeout_s=20))
        except NoSuchReplica:
            return False
        return True

    assert wait_for(ask, timeout_s, 0.5), f"no stats from {worker}"
    return found


def test_killed_worker_replica_waiting_requests_retry_streams_end_cleanly_it_comes_back(
    cluster: str, redis_server: LocalRedis
) -> None:
    before = worker_stats(APP)
    old_ids = set(before)
    fp = next(iter(before.values()))["fingerprint"]
    # Six long streams: a 48-block pool runs about two of them, so each worker also has some
    # waiting with no output yet. Those must be retried elsewhere when their worker dies.
    prompts = [prompt_of(100 + i, 2) for i in range(6)]
    longs = [LongStream() for _ in prompts]
    picked: dict = {}

    async def scenario() -> tuple[float, dict]:
        tasks = [asyncio.create_task(_long_stream(cluster, p, out))
                 for p, out in zip(prompts, longs, strict=True)]

        def busy_worker() -> bool:
            """A worker streaming one of the long streams with requests waiting behind it."""
            streaming = {s.worker for s in longs if s.first_at is not None and s.worker}
            for w, st in worker_stats(APP).items():
                if w in streaming and st["num_waiting"] >= 1:
                    picked.update(victim=w, waiting=st["num_waiting"])
                    return True
            return False

        assert await asyncio.to_thread(wait_for, busy_worker, 60, 0.05), worker_stats(APP)
        kill_at = time.monotonic()
        ray.kill(_replica_actor(picked["victim"]), no_restart=True)
        watch = asyncio.to_thread(_watch_index, redis_server.url, picked["victim"],
                                  before[picked["victim"]]["worker_id"], kill_at)
        watched = (await asyncio.gather(watch, *tasks))[0]
        return kill_at, watched

    with LoadStream(cluster, concurrency=3, max_requests=100_000, seed=6,
                    stream_frac=0.5) as bg:
        time.sleep(0.5)
        killed_at, watched = asyncio.run(scenario())
        victim = picked["victim"]
        # Serve replaces the replica; the new one registers in the index.
        assert wait_for(lambda: len(set(worker_ids(APP)) - old_ids) == 1
                        and victim not in worker_ids(APP), 90, 0.5), worker_ids(APP)
        (new,) = set(worker_ids(APP)) - old_ids
        assert wait_for(lambda: new in live(redis_server.url), 60, 0.2)
        back_s = time.monotonic() - killed_at
        # a sample of requests sent once the new replica is up (the stream runs until stopped)
        back_at = time.monotonic()
        assert wait_for(lambda: len(bg.since(back_at)) >= 6, 90, 0.2), len(bg.outcomes)
    old_worker_id, old_epoch = before[victim]["worker_id"], before[victim]["epoch"]
    chain = hash_chain(prompts[0], BLOCK, namespace(fp))
    # The dead replica's lease lapsed (hidden from lookups), then its entries were collected.
    assert watched["hidden_s"] is not None and watched["hidden_s"] <= LEASE_TTL_S + 2, watched
    assert watched["collected_s"] is not None, watched
    new_id, new_epoch = live(redis_server.url)[new]

    # The new incarnation: its own registration with a newer epoch, and no blocks of the old
    # one: the prefix the victim held is matched by nobody until someone caches it again.
    assert new_epoch > old_epoch
    assert victim not in depths(redis_server.url, chain)
    new_stats = _stats_of(new)
    assert new_stats["worker_id"] == new_id and new_stats["epoch"] == new_epoch
    # ... and what it caches shows up under its id: a prefix it serves is matched to it.
    served = None
    for i in range(20):  # distinct prefixes spread over both workers; one lands on it
        fresh = prompt_of(500 + i, 3)
        if complete(cluster, [*fresh, 1]).headers["x-prefixserve-worker"] == new:
            served = hash_chain(fresh, BLOCK, namespace(fp))
            break
    assert served is not None, "the new replica never got a request"
    assert wait_for(lambda: depths(redis_server.url, served).get(new, 0) == 3, 10)
    handle = serve.get_deployment_handle("LLMWorker", APP)

    def indexed_equals_cached() -> bool:
        cached = handle.cached_block_hashes.remote(target_worker=new).result(timeout_s=15)
        indexed = index_view(redis_server.url, MODEL)["blocks"].get(new_id, set())
        return {h[:INDEX_KEY_BYTES] for h in cached} == indexed

    assert wait_for(indexed_equals_cached, 15)

    # Streams whose output came from the victim: the one(s) under way at the kill end with an
    # error event, then [DONE]; every other stream completes, including those that had no
    # output yet at the kill (waiting on either worker): retried where their worker died.
    on_victim = [s for s in longs if s.worker == victim]
    others = [s for s in longs if s.worker != victim]
    waited = [s for s in others if s.first_at is None or s.first_at > killed_at]
    after = [o for o in bg.outcomes if o.started >= killed_at + 0.5]
    figures = report(
        "worker-killed", bg.outcomes, long_streams_cut=sum(s.error_end for s in on_victim),
        long_streams_waiting_at_kill=len(waited), victim_waiting_at_kill=picked["waiting"],
        replica_back_s=round(back_s, 2), lease_hidden_s=watched["hidden_s"],
        entries_collected_s=watched["collected_s"], old_id_reused=new_id == old_worker_id,
        sent_after_kill=len(after), failed_after_kill=sum(o.kind != OK for o in after),
        failures=[(round(o.started - killed_at, 2), o.kind, o.detail[:80])
                  for o in bg.outcomes if o.kind != OK],
    )
    assert_no_hangs(figures)
    assert all("<HUNG>" not in s.events for s in longs), [s.events[-2:] for s in longs]
    assert any(s.error_end for s in on_victim), [s.events[-3:] for s in on_victim]
    assert all(s.error_end or s.clean_end for s in on_victim), [s.events[-3:] for s in on_victim]
    assert all(s.clean_end for s in others), [(s.status, s.events[-2:]) for s in others]
    # Requests sent after the kill can never have output on the victim: all succeed (those
    # Serve still sent to it are retried).
    assert after and all(o.kind == OK for o in after), figures
    assert figures[FAILED] == 0, figures  # anything that did fail, failed with a clean error
