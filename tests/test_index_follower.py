"""A router's copy of the index, kept by following its event log: answers as the index does
while events, resyncs, predictions, trims and deaths go by. Real redis-server."""

from __future__ import annotations

import asyncio
import random
import time
import uuid

import pytest
import redis
from fleetkit import Fleet, digests

from prefixserve.cluster.local_redis import LocalRedis
from prefixserve.router.blocks import Chain
from prefixserve.router.events import BlockRemoved, BlockStored, EventBatch, WorkerLoad
from prefixserve.router.index import (
    IndexSettings,
    IndexUnavailable,
    LookupResult,
    PrefixIndex,
    ResultCode,
)
from prefixserve.router.index_follower import IndexFollower, event_logs, logged_at
from prefixserve.router.index_stores import open_index
from prefixserve.router.redis_records import key_tag

pytestmark = pytest.mark.cluster


def settings(**kw: object) -> IndexSettings:
    return IndexSettings(**{"lease_ttl_s": 600.0, **kw})


def depths(result: LookupResult) -> dict[str, tuple[int, int]]:
    return {name: (m.confirmed_depth, m.predicted_depth) for name, m in result.matches.items()}


def lower(result: LookupResult) -> dict[str, tuple[int, int]]:
    return {name: m.lower_blocks for name, m in result.matches.items() if any(m.lower_blocks)}


def follower_of(index: PrefixIndex, **kw: float) -> IndexFollower:
    logs = event_logs(index)
    assert logs is not None
    return IndexFollower(index, logs, log_entries=100_000, **kw)


class Publisher:
    """A fleet's workers registered in one index, publishing their events in order."""

    def __init__(self, index: PrefixIndex, fleet: Fleet) -> None:
        self.index, self.fleet = index, fleet
        self.ids: dict[int, int] = {}
        self.seq: dict[int, int] = {}

    async def register(self) -> None:
        for w in self.fleet.held:
            wid = await self.index.register(f"W{w}", epoch=1, block_size=16, fingerprint="fp")
            self.ids[w], self.seq[wid] = wid, 0

    async def step(self) -> None:
        worker, events = self.fleet.step()
        if events:
            wid = self.ids[worker]
            self.seq[wid] += 1
            batch = EventBatch(wid, 1, self.seq[wid], tuple(events))
            assert await self.index.apply(batch) is ResultCode.OK


async def same_answers(index: PrefixIndex, follower: IndexFollower, fleet: Fleet,
                       queries: int = 8) -> None:
    await follower.catch_up()
    assert follower.ready
    for _ in range(queries):
        query = fleet.query()
        want = await index.lookup(query)
        got = follower.lookup(Chain.of(query))
        assert depths(got) == depths(want)
        assert lower(got) == lower(want)
        fleet.lower_seen += bool(lower(want))
        assert got.worker_ids == want.worker_ids


@pytest.mark.parametrize(("shards", "tiers"), [(1, False), (2, False), (1, True), (2, True)])
async def test_a_follower_answers_as_the_index_does(redis_server: LocalRedis, shards: int,
                                                    tiers: bool) -> None:
    """With KV tiers too: each worker's blocks below its pool, by tier, come out the same from
    the index's holder codes and from the follower's per-tier copy."""
    rng = random.Random(5 + shards)
    # with tiers one chain: a tier move leaves a shared head alone, and three chains share most
    fleet = Fleet(rng, workers=6, chains=1 if tiers else 3, length=200, tiers=tiers)
    index = open_index(redis_server.url, f"fol-{uuid.uuid4().hex[:6]}", deadline_s=2.0,
                       settings=settings(shards=shards))
    early = follower_of(index)
    try:
        publisher = Publisher(index, fleet)
        await publisher.register()
        await early.catch_up()
        for step in range(400):
            await publisher.step()
            if step == 200:  # a router that starts with the fleet's caches full
                late = follower_of(index)
            if step % 20 == 19:
                await same_answers(index, early, fleet)
        await same_answers(index, late, fleet)
        assert sum(len(q) for q in fleet.held.values()) > 0
        assert (fleet.lower_seen > 0) == tiers
    finally:
        await index.close()


async def test_a_follower_starts_over_when_the_log_was_trimmed_past_it(
    redis_server: LocalRedis,
) -> None:
    rng = random.Random(21)
    fleet = Fleet(rng, workers=4, chains=2, length=120)
    model = f"trim-{uuid.uuid4().hex[:6]}"
    index = open_index(redis_server.url, model, deadline_s=2.0, settings=settings())
    raw = redis.Redis.from_url(redis_server.url)
    follower = follower_of(index)
    try:
        publisher = Publisher(index, fleet)
        await publisher.register()
        for _ in range(50):
            await publisher.step()
        await same_answers(index, follower, fleet)
        for _ in range(60):  # entries the follower never reads: trimmed away below
            await publisher.step()
        stream = "{" + key_tag(model) + "}E"
        assert raw.xtrim(stream, maxlen=0, approximate=False) > 30
        while not raw.xlen(stream):  # the next entry, numbered past the trimmed ones
            await publisher.step()
        await same_answers(index, follower, fleet, queries=30)
        assert sum(len(q) for q in fleet.held.values()) > 0
    finally:
        raw.close()
        await index.close()


async def test_the_index_keeps_a_log_only_once_a_router_follows_it(
    redis_server: LocalRedis,
) -> None:
    rng = random.Random(8)
    a, b = digests(rng, 12), digests(rng, 12)
    model = f"kl-{uuid.uuid4().hex[:6]}"
    index = open_index(redis_server.url, model, deadline_s=2.0, settings=settings())
    raw = redis.Redis.from_url(redis_server.url)
    stream = "{" + key_tag(model) + "}E"
    try:
        w1 = await index.register("one", epoch=1, block_size=16, fingerprint="fp")
        await index.resync(w1, 1, a, 0)
        await index.apply(EventBatch(w1, 1, 1, (BlockStored(tuple(b)),)))
        assert not raw.exists(stream)  # nobody follows: the workers' writes cost no log
        lags: list[float] = []
        follower = follower_of(index, on_lag=lags.append)
        await follower.catch_up()
        await index.apply(EventBatch(w1, 1, 2, (BlockRemoved(tuple(a[6:])),)))
        assert raw.xlen(stream) == 1
        await asyncio.sleep(0.3)  # the entry waits in the log before the router reads it
        await follower.catch_up()
        assert len(lags) == 1 and 0.3 <= lags[0] < 30
        assert depths(follower.lookup(Chain.of(a))) == {"one": (6, 6)}
        assert depths(follower.lookup(Chain.of(b))) == {"one": (12, 12)}
    finally:
        raw.close()
        await index.close()


async def test_resyncs_and_deaths_reach_the_follower(redis_server: LocalRedis) -> None:
    rng = random.Random(3)
    a, b = digests(rng, 30), digests(rng, 30)
    index = open_index(redis_server.url, f"rz-{uuid.uuid4().hex[:6]}", deadline_s=2.0,
                       settings=settings())
    follower = follower_of(index)
    try:
        w1 = await index.register("one", epoch=1, block_size=16, fingerprint="fp")
        w2 = await index.register("two", epoch=1, block_size=16, fingerprint="fp")
        await index.resync(w1, 1, a, 0)
        await index.resync(w2, 1, a[:10], 0)
        await follower.catch_up()
        assert depths(follower.lookup(Chain.of(a))) == {"one": (30, 30), "two": (10, 10)}
        await index.resync(w1, 1, b[:7], 0)  # the new set replaces the old one
        await follower.catch_up()
        assert depths(follower.lookup(Chain.of(a))) == {"two": (10, 10)}
        assert depths(follower.lookup(Chain.of(b))) == {"one": (7, 7)}
        await index.deregister(w2)
        await follower.catch_up()
        assert set(follower.held.workers()) == {w1}  # its blocks are gone, not just hidden
        assert depths(follower.lookup(Chain.of(a))) == {}
        assert follower.lookup(Chain.of(a)).worker_ids == {"one": w1}
    finally:
        await index.close()


async def test_other_routers_predictions_count_until_they_expire(redis_server: LocalRedis) -> None:
    rng = random.Random(4)
    chain = digests(rng, 40)
    index = open_index(redis_server.url, f"pr-{uuid.uuid4().hex[:6]}", deadline_s=2.0,
                       settings=settings(predict_ttl_s=0.5))
    follower = follower_of(index)
    try:
        w1 = await index.register("one", epoch=1, block_size=16, fingerprint="fp")
        w2 = await index.register("two", epoch=1, block_size=16, fingerprint="fp")
        await index.resync(w1, 1, chain[:12], 0)
        await index.resync(w2, 1, [], 0)
        await follower.catch_up()
        await index.predict(chain, w1, from_block=12)  # past what it holds
        await index.predict(chain[:20], w2)  # from nothing
        await follower.catch_up()
        want = {"one": (12, 40), "two": (0, 20)}
        assert depths(follower.lookup(Chain.of(chain))) == want
        assert depths(await index.lookup(chain)) == want
        # a chain that leaves the predicted one at block 15 keeps blocks 0-14
        fork = Chain.of([*chain[:15], *digests(rng, 5)])
        assert depths(follower.lookup(fork)) == {"one": (12, 15), "two": (0, 15)}
        await asyncio.sleep(0.6)
        assert depths(follower.lookup(Chain.of(chain))) == {"one": (12, 12)}
    finally:
        await index.close()


async def test_workers_whose_lease_lapsed_drop_out_and_loads_arrive(
    redis_server: LocalRedis,
) -> None:
    rng = random.Random(6)
    chain = digests(rng, 10)
    index = open_index(redis_server.url, f"ls-{uuid.uuid4().hex[:6]}", deadline_s=2.0,
                       settings=settings(lease_ttl_s=0.5))
    follower = follower_of(index, loads_every_s=0.02, live_every_s=0.1)
    task = asyncio.create_task(follower.run())
    try:
        w1 = await index.register("one", epoch=1, block_size=16, fingerprint="fp")
        w2 = await index.register("two", epoch=1, block_size=16, fingerprint="fp")
        for wid in (w1, w2):
            await index.resync(wid, 1, chain, 0)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            await index.heartbeat(w1, 1, WorkerLoad(num_running=3, timestamp=1.0))
            result = follower.lookup(Chain.of(chain))
            if follower.ready and set(result.matches) == {"one"} and result.loads:
                break
            await asyncio.sleep(0.05)
        assert follower.ready
        assert depths(result) == {"one": (10, 10)}  # "two" sent no heartbeat: lapsed
        assert result.matches["one"].load == WorkerLoad(num_running=3, timestamp=1.0)
        assert result.loads == {"one": WorkerLoad(num_running=3, timestamp=1.0)}
    finally:
        task.cancel()
        await index.close()


async def test_a_follower_whose_live_workers_went_unread_is_not_ready(
    redis_server: LocalRedis,
) -> None:
    index = open_index(redis_server.url, f"st-{uuid.uuid4().hex[:6]}", deadline_s=2.0,
                       settings=settings())
    follower = follower_of(index, live_every_s=0.05)
    try:
        assert not follower.ready  # nothing read yet
        await follower.catch_up()
        assert follower.ready
        await asyncio.sleep(0.2)  # no background reads: the live workers may have changed
        assert not follower.ready
    finally:
        await index.close()


async def test_a_follower_is_not_ready_while_redis_is_down_and_catches_up_after(
    redis_server: LocalRedis,
) -> None:
    rng = random.Random(7)
    a, b = digests(rng, 16), digests(rng, 16)
    index = open_index(redis_server.url, f"dn-{uuid.uuid4().hex[:6]}", deadline_s=0.5,
                       settings=settings(admin_deadline_s=0.5))
    follower = follower_of(index, loads_every_s=0.02, live_every_s=0.1, retry_s=0.1)
    task = asyncio.create_task(follower.run())

    async def until(check, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not check():
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)

    try:
        w1 = await index.register("one", epoch=1, block_size=16, fingerprint="fp")
        await index.resync(w1, 1, a, 0)
        await until(lambda: follower.ready and follower.lookup(Chain.of(a)).matches)
        redis_server.stop()
        await until(lambda: not follower.ready)
        redis_server.start()  # empty: the worker registers and resyncs again
        w1 = await index.register("one", epoch=2, block_size=16, fingerprint="fp")
        await index.resync(w1, 2, b, 0)
        await until(lambda: follower.ready and follower.lookup(Chain.of(b)).matches)
        assert depths(follower.lookup(Chain.of(b))) == {"one": (16, 16)}
        assert depths(follower.lookup(Chain.of(a))) == {}
    finally:
        task.cancel()
        await index.close()


class SwallowingStore:
    """An index and its log whose every call, when cancelled, raises the store's own error
    instead, as a client library may (redis-py's connection setup did, when a loop's shutdown
    cancelled the setup and its caller together)."""

    lease_ttl_s = 10.0

    async def _call(self) -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            raise IndexUnavailable("the client closed while connecting") from None

    async def keep_log(self, entries: int) -> None:
        await self._call()

    async def live_workers(self) -> list:
        await self._call()
        return []

    async def lookup(self, chain: Chain) -> LookupResult:
        await self._call()
        return LookupResult({})


async def test_a_cancelled_follower_stops_even_when_the_store_turns_the_cancel_into_an_error(
) -> None:
    store = SwallowingStore()
    follower = IndexFollower(store, [store], log_entries=10, retry_s=0.01)  # type: ignore[arg-type]
    task = asyncio.ensure_future(follower.run())
    await asyncio.sleep(0.05)  # both loops wait in a store call
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=2.0)
    assert task in done and task.cancelled(), "the follower kept running after its cancel"


def test_an_entry_is_dated_by_its_stream_id() -> None:
    assert logged_at(b"1733300000123-4") == pytest.approx(1733300000.123)
