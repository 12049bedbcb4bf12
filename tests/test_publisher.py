"""EventPublisher against a real redis-server: engine-thread publishing, outages, resync."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid

import pytest
import redis

from prefixserve.cluster.local_redis import LocalRedis
from prefixserve.router.blocks import hash_chain, namespace
from prefixserve.router.events import BlockRemoved, BlockStored, KVEvent, WorkerLoad
from prefixserve.router.index import IndexSettings
from prefixserve.router.index_stores import open_index
from prefixserve.router.publisher import MAX_BATCH_BLOCKS, EventPublisher, batch_length

pytestmark = pytest.mark.cluster

NS = namespace("pub-model")


def chain_of(seed: int, n: int) -> list[bytes]:
    return hash_chain([seed * 1000 + i for i in range(n * 4)], block_size=4, ns=NS)


class FakeEngine:
    """Stands in for the engine thread: owns a block set and emits KV events per step."""

    def __init__(self, publish) -> None:
        self.cached: dict[bytes, None] = {}
        self.publish = publish
        self.lock = threading.Lock()

    def step(self, stored: list[bytes] = (), removed: list[bytes] = ()) -> None:
        events: list[KVEvent] = []
        with self.lock:
            if stored:
                self.cached.update(dict.fromkeys(stored))
                events.append(BlockStored(tuple(stored)))
            if removed:
                for h in removed:
                    self.cached.pop(h, None)
                events.append(BlockRemoved(tuple(removed)))
            self.publish(events)

    def snapshot(self) -> list[bytes]:
        with self.lock:
            return list(self.cached)

    def run_in_thread(self, fn) -> None:
        t = threading.Thread(target=fn)
        t.start()
        t.join()


def depth(result, rid: str) -> int | None:
    m = result.matches.get(rid)
    return None if m is None else m.confirmed_depth


async def make(url: str, model: str, rid: str, engine_holder: list, **kw) -> EventPublisher:
    index = open_index(url, model, deadline_s=1.0,
                       settings=IndexSettings(lease_ttl_s=kw.pop("lease_ttl_s", 5.0)))
    pub = EventPublisher(index, replica_id=rid, epoch=kw.pop("epoch", 1), block_size=4,
                         fingerprint="fp", snapshot=kw.pop("snapshot", None)
                         or (lambda: engine_holder[0].snapshot()), **kw)
    engine_holder.append(FakeEngine(pub.publish))
    return pub


@pytest.fixture
def model() -> str:
    return "p" + uuid.uuid4().hex[:7]


async def test_events_from_the_engine_thread_reach_the_index(
    redis_server: LocalRedis, model: str
) -> None:
    holder: list[FakeEngine] = []
    lags: list[float] = []
    pub = await make(redis_server.url, model, "W1", holder,
                     load=lambda: WorkerLoad(num_running=3, kv_usage=0.5),
                     heartbeat_interval_s=0.05, on_lag=lags.append)
    engine = holder[0]
    reader = open_index(redis_server.url, model, deadline_s=1.0)
    pub.start()
    try:
        assert await pub.wait_synced(5)
        ch = chain_of(1, 20)
        engine.run_in_thread(lambda: [engine.step(stored=ch[i : i + 4]) for i in range(0, 20, 4)])
        engine.run_in_thread(lambda: engine.step(removed=[ch[15]]))
        assert await pub.wait_synced(5)
        await asyncio.sleep(0.15)  # a heartbeat carries the load
        result = await reader.lookup(ch)
        assert depth(result, "W1") == 15
        assert result.matches["W1"].load.num_running == 3
        assert result.matches["W1"].load.timestamp > 0
        assert pub.stats.events == 6 and pub.stats.resyncs == 1
        # each applied batch's lag, from its oldest event's step to the index having it
        assert len(lags) == pub.stats.batches >= 1 and all(0 < lag < 5 for lag in lags)
    finally:
        await pub.close()
        await reader.close()
    assert (await _lookup(redis_server.url, model, chain_of(1, 2))).matches == {}
    assert redis.Redis.from_url(redis_server.url).hlen("{" + model + "}B") == 0


async def _lookup(url: str, model: str, chain):
    idx = open_index(url, model, deadline_s=1.0)
    try:
        return await idx.lookup(chain)
    finally:
        await idx.close()


async def test_publish_never_blocks_and_resyncs_after_redis_restart(
    redis_server: LocalRedis, model: str
) -> None:
    holder: list[FakeEngine] = []
    snapshots = []

    async def async_snapshot() -> list[bytes]:  # the replica asks its engine thread like this
        snapshots.append(time.monotonic())
        return await asyncio.to_thread(holder[0].snapshot)

    pub = await make(redis_server.url, model, "W1", holder, snapshot=async_snapshot,
                     heartbeat_interval_s=0.05)
    engine = holder[0]
    pub.start()
    try:
        first, second = chain_of(2, 8), chain_of(3, 8)
        engine.step(stored=first)
        assert await pub.wait_synced(5)
        assert depth(await _lookup(redis_server.url, model, first), "W1") == 8

        redis_server.stop()
        try:
            # The engine keeps stepping while Redis is away; publish returns at once.
            start = time.monotonic()
            engine.run_in_thread(lambda: [engine.step(stored=second),
                                          engine.step(removed=first[4:])])
            assert time.monotonic() - start < 1.0  # never waits on Redis' deadline/backoff
            for _ in range(250):
                if pub.dirty:
                    break
                await asyncio.sleep(0.02)
            assert pub.dirty
        finally:
            redis_server.start()  # back, and empty
        assert await pub.wait_synced(10)
        assert pub.stats.resyncs >= 2 and pub.stats.registrations >= 2
        assert depth(await _lookup(redis_server.url, model, first), "W1") == 4
        assert depth(await _lookup(redis_server.url, model, second), "W1") == 8
        engine.step(stored=chain_of(4, 3))
        assert await pub.wait_synced(5)
        assert depth(await _lookup(redis_server.url, model, chain_of(4, 3)), "W1") == 3
    finally:
        await pub.close()


def test_a_batch_takes_whole_events_up_to_the_block_bound() -> None:
    """The cut the publisher and the simulator both make: whole events, at most
    MAX_BATCH_BLOCKS digests, at least one event."""
    ch = chain_of(11, MAX_BATCH_BLOCKS + 10)
    small, big = BlockStored(tuple(ch[:10])), BlockStored(tuple(ch[10:]))  # 10 and 2,048
    assert batch_length([small, big]) == 1  # 2,058 > 2,048: the big one waits
    assert batch_length([big, small]) == 1
    assert batch_length([small, big], start=1) == 1
    assert batch_length([BlockStored(tuple(ch)), small]) == 1  # too big alone: alone
    removed = BlockRemoved(tuple(ch[:5]))
    assert batch_length([small, removed, small, removed]) == 4
    assert batch_length([small, removed], start=2) == 0


async def test_large_steps_are_split_into_bounded_batches(
    redis_server: LocalRedis, model: str
) -> None:
    holder: list[FakeEngine] = []
    pub = await make(redis_server.url, model, "W1", holder)
    engine = holder[0]
    pub.start()
    try:
        assert await pub.wait_synced(5)
        ch = chain_of(10, 5000)
        engine.run_in_thread(lambda: [engine.step(stored=ch[i : i + 1000])
                                      for i in range(0, 5000, 1000)])
        assert await pub.wait_synced(10)
        assert pub.stats.batches >= 3 and pub.stats.events == 5
        assert depth(await _lookup(redis_server.url, model, ch), "W1") == 5000
    finally:
        await pub.close()


async def test_sequence_gap_triggers_resync_from_snapshot(
    redis_server: LocalRedis, model: str
) -> None:
    holder: list[FakeEngine] = []
    pub = await make(redis_server.url, model, "W1", holder)
    engine = holder[0]
    pub.start()
    try:
        ch = chain_of(5, 6)
        engine.step(stored=ch[:2])
        assert await pub.wait_synced(5)
        engine.step(stored=ch[2:3])
        assert await pub.wait_synced(5)
        assert pub.stats.batches >= 1
        # Lose the last batch on the way: the index is one seq behind, so the next one gaps.
        raw = redis.Redis.from_url(redis_server.url)
        raw.hincrby(f"{{{pub.index.tag}}}w:{pub.worker_id}", "seq", -1)
        with engine.lock:  # a block the index never heard about (its event was "lost")
            engine.cached[ch[3]] = None
        resyncs = pub.stats.resyncs
        engine.step(stored=ch[4:])
        assert await pub.wait_synced(5)
        assert pub.stats.resyncs == resyncs + 1
        assert depth(await _lookup(redis_server.url, model, ch), "W1") == 6
    finally:
        await pub.close()


async def test_lease_kept_alive_and_vanished_registration_is_restored(
    redis_server: LocalRedis, model: str
) -> None:
    holder: list[FakeEngine] = []
    pub = await make(redis_server.url, model, "W1", holder, lease_ttl_s=0.3,
                     heartbeat_interval_s=0.05)
    engine = holder[0]
    pub.start()
    try:
        ch = chain_of(6, 4)
        engine.step(stored=ch)
        assert await pub.wait_synced(5)
        await asyncio.sleep(0.6)  # two lease lengths: heartbeats keep it alive
        assert depth(await _lookup(redis_server.url, model, ch), "W1") == 4
        # Someone flushes Redis: the next heartbeat notices and the worker comes back whole.
        redis.Redis.from_url(redis_server.url).flushall()
        for _ in range(200):
            if depth(await _lookup(redis_server.url, model, ch), "W1") == 4:
                break
            await asyncio.sleep(0.02)
        assert depth(await _lookup(redis_server.url, model, ch), "W1") == 4
    finally:
        await pub.close()


async def test_newer_incarnation_fences_the_old_publisher(
    redis_server: LocalRedis, model: str
) -> None:
    old_holder: list[FakeEngine] = []
    new_holder: list[FakeEngine] = []
    old = await make(redis_server.url, model, "W1", old_holder, epoch=1,
                     heartbeat_interval_s=0.05)
    new = await make(redis_server.url, model, "W1", new_holder, epoch=2,
                     heartbeat_interval_s=0.05)
    old.start()
    try:
        old_holder[0].step(stored=chain_of(7, 4))
        assert await old.wait_synced(5)
        old_id = old.worker_id
        new.start()
        new_holder[0].step(stored=chain_of(8, 2))
        assert await new.wait_synced(5)
        for _ in range(100):
            if old.fenced:
                break
            await asyncio.sleep(0.02)
        assert old.fenced and new.worker_id == old_id
        old_holder[0].step(stored=chain_of(9, 2))  # a zombie's events go nowhere
        assert not old._pending
        result = await _lookup(redis_server.url, model, chain_of(8, 2))
        assert depth(result, "W1") == 2
        # not matched (lookups return only the workers holding a chain's first block)
        assert depth(await _lookup(redis_server.url, model, chain_of(7, 4)), "W1") is None
        assert depth(await _lookup(redis_server.url, model, chain_of(9, 2)), "W1") is None
    finally:
        await old.close(deregister=False)
        await new.close()


async def test_a_wrong_password_is_one_warning_with_the_reason(model: str, caplog) -> None:
    server = LocalRedis(password="right").start()
    holder: list[FakeEngine] = []
    pub = await make(f"redis://:wrong@127.0.0.1:{server.port}/0", model, "W9", holder)
    try:
        with caplog.at_level(logging.WARNING, logger="prefixserve.router.publisher"):
            pub.start()
            await asyncio.sleep(1.5)  # several retries (backoff from 50 ms)
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert pub.stats.failures >= 3 and not pub.registered
        assert len(warnings) == 1, warnings  # not one per retry
        assert "invalid username-password" in warnings[0] and "wrong" not in warnings[0]
    finally:
        await pub.close()
        server.close()
