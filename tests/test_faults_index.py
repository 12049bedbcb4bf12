"""Hostile or corrupt Redis contents and KV-event payloads, against a real redis-server.

Somebody (a bug, an operator, another tenant of the Redis) wrote garbage into the index's keys:
wrong types, truncated msgpack load records, worker ids that do not exist, junk in the registry.
Lookups, applies, heartbeats, registration and GC must ignore the bad entry (the good workers'
depths stay exact) or, when a key the whole index needs is unusable, raise ``IndexUnavailable``
(the router's fail-open signal) and never anything else into the request path.
Malformed event *batches* on the wire are covered by tests/test_blocks_events.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import uuid

import msgpack
import pytest
import redis

from prefixserve.cluster.local_redis import LocalRedis
from prefixserve.router.blocks import hash_chain, namespace
from prefixserve.router.events import (
    BlockStored,
    EventBatch,
    EventDecodeError,
    WorkerLoad,
    decode_load,
)
from prefixserve.router.index import (
    INDEX_KEY_BYTES,
    IndexSettings,
    IndexUnavailable,
    ResultCode,
    UnknownWorker,
)
from prefixserve.router.publisher import EventPublisher
from prefixserve.router.redis_index import RedisPrefixIndex

pytestmark = pytest.mark.cluster

NS = namespace("test-model")


def chain_of(seed: int, n: int) -> list[bytes]:
    return hash_chain([seed * 1000 + i for i in range(n * 4)], block_size=4, ns=NS)


@pytest.fixture
async def index(redis_server: LocalRedis):
    idx = RedisPrefixIndex(redis_server.url, "h" + uuid.uuid4().hex[:7], deadline_s=1.0,
                      settings=IndexSettings(lease_ttl_s=5.0))
    yield idx
    await idx.close()


@pytest.fixture
def raw(redis_server: LocalRedis):
    r = redis.Redis.from_url(redis_server.url)
    yield r
    r.close()


async def two_workers(idx: RedisPrefixIndex, ch: list[bytes]) -> tuple[int, int]:
    a = await idx.register("A", epoch=1, block_size=4, fingerprint="fp")
    b = await idx.register("B", epoch=1, block_size=4, fingerprint="fp")
    await idx.apply(EventBatch(a, 1, 1, (BlockStored(tuple(ch)),)))
    await idx.apply(EventBatch(b, 1, 1, (BlockStored(tuple(ch[:2])),)))
    await idx.heartbeat(a, 1, WorkerLoad(num_running=1))
    await idx.heartbeat(b, 1, WorkerLoad(num_running=2))
    return a, b


def key(idx: RedisPrefixIndex, suffix: str | bytes) -> bytes:
    s = suffix.encode() if isinstance(suffix, str) else suffix
    return b"{" + idx.tag.encode() + b"}" + s


async def depths(idx: RedisPrefixIndex, ch: list[bytes]) -> dict[str, int]:
    return {k: m.confirmed_depth for k, m in (await idx.lookup(ch)).matches.items()}


async def test_garbage_predicted_entries_are_ignored(index: RedisPrefixIndex, raw) -> None:
    ch = chain_of(1, 4)
    _a, b = await two_workers(index, ch)
    # Predicted-entry keys hold "2-byte id + 13-digit expiry" records; these are not.
    raw.set(key(index, b"q" + ch[2]), b"\x00\x02not-a-number!")
    raw.set(key(index, b"q" + ch[3]), b"xyz")
    assert await depths(index, ch) == {"A": 4, "B": 2}
    await index.predict(ch, b, from_block=2)  # writing over the junk works too
    result = await index.lookup(ch)
    assert result.matches["B"].predicted_depth == 4


async def test_garbage_tails_are_ignored(index: RedisPrefixIndex, raw) -> None:
    ch = chain_of(10, 100)
    _a, b = await two_workers(index, ch)
    code = b.to_bytes(2, "big")
    # Tails are "13-digit expiry | u32 from | u16 n | n x (u32 position | digest)"; these are
    # truncated, claim more samples than they hold, or carry no number.
    far = b"9999999999999"
    raw.hset(key(index, "T"), mapping={
        code: far + b"\x00\x00\x00\x00\xff\xff" + b"x" * 7,
        b"\x00\x63": b"junk",
        b"\x07": far[:5],
    })
    result = await index.lookup(ch)
    assert {k: (m.confirmed_depth, m.predicted_depth) for k, m in result.matches.items()} == \
        {"A": (100, 100), "B": (2, 2)}
    raw.hset(key(index, "T"), code, b"not-a-number!" + b"\x00" * 6 + far + b"\x00" * 20)
    assert await depths(index, ch) == {"A": 100, "B": 2}
    await index.predict(ch, b, from_block=2)  # writing over the junk works too
    assert (await index.lookup(ch)).matches["B"].predicted_depth == 100


async def test_junk_in_the_live_set_is_skipped(index: RedisPrefixIndex, raw) -> None:
    ch = chain_of(2, 3)
    a, b = await two_workers(index, ch)
    far = 2**40
    raw.zadd(key(index, "live"), {b"\x07": far, b"\x00\x01\x02": far, b"\x01\x2c": far})
    assert await depths(index, ch) == {"A": 3, "B": 2}  # junk and unknown id 300 ignored
    assert sorted(w.replica_id for w in await index.live_workers()) == ["A", "B"]
    await index.gc()  # and GC drops members that are no worker's lease
    assert sorted(raw.zrange(key(index, "live"), 0, -1)) == sorted(
        [a.to_bytes(2, "big"), b.to_bytes(2, "big")])
    assert await depths(index, ch) == {"A": 3, "B": 2}


async def test_corrupt_worker_record_skips_that_worker_and_it_recovers(
    index: RedisPrefixIndex, raw, caplog
) -> None:
    ch = chain_of(3, 3)
    a, _b = await two_workers(index, ch)
    raw.hset(key(index, f"w:{a}"), mapping={"epoch": "garbage", "bs": "x"})
    with caplog.at_level(logging.WARNING, logger="prefixserve.router.index"):
        assert await depths(index, ch) == {"B": 2}  # A is skipped, B still routed
    assert "corrupt" in caplog.text
    # A's publisher: its batch asks for a resync, the resync finds it unregistered, it
    # registers again (same id, fresh record) and resyncs; everything is exact again.
    assert await index.apply(EventBatch(a, 1, 2, (BlockStored(tuple(ch)),))) \
        is ResultCode.RESYNC_NEEDED
    with pytest.raises(UnknownWorker):
        await index.resync(a, 1, ch, 2)
    assert not await index.heartbeat(a, 1, WorkerLoad())
    assert await index.register("A", epoch=1, block_size=4, fingerprint="fp") == a
    await index.resync(a, 1, ch, 2)
    assert await index.apply(EventBatch(a, 1, 3, ())) is ResultCode.OK
    assert await index.heartbeat(a, 1, WorkerLoad())
    assert await depths(index, ch) == {"A": 3, "B": 2}


async def test_worker_record_of_the_wrong_type(index: RedisPrefixIndex, raw) -> None:
    ch = chain_of(4, 3)
    a, _b = await two_workers(index, ch)
    raw.delete(key(index, f"w:{a}"))
    raw.set(key(index, f"w:{a}"), b"not a hash")
    assert await depths(index, ch) == {"B": 2}
    assert await index.apply(EventBatch(a, 1, 2, ())) is ResultCode.RESYNC_NEEDED
    with pytest.raises(UnknownWorker):
        await index.resync(a, 1, ch, 2)
    assert not await index.heartbeat(a, 1, WorkerLoad())
    assert await index.register("A", epoch=1, block_size=4, fingerprint="fp") == a
    await index.resync(a, 1, ch[:1], 2)  # the record is rebuilt, the resync fixes the entries
    assert await depths(index, ch) == {"A": 1, "B": 2}
    assert await index.heartbeat(a, 1, WorkerLoad())


async def test_garbage_in_the_registry(index: RedisPrefixIndex, raw) -> None:
    ch = chain_of(5, 3)
    a, b = await two_workers(index, ch)
    raw.hset(key(index, "ids"), mapping={"C": "not-an-id", "D": "777"})  # 777: no such worker
    raw.sadd(key(index, "reg"), "junk", "-5", "70000")
    c = await index.register("C", epoch=1, block_size=4, fingerprint="fp")
    d = await index.register("D", epoch=1, block_size=4, fingerprint="fp")
    assert len({a, b, c, d}) == 4 and all(1 <= x <= 16383 for x in (c, d))
    await index.apply(EventBatch(c, 1, 1, (BlockStored(tuple(ch[:1])),)))
    assert await depths(index, ch) == {"A": 3, "B": 2, "C": 1}
    assert await index.gc() == 0  # junk ids are skipped, nobody live is collected
    # A worker whose lease lapsed is still collected despite the junk.
    raw.zadd(key(index, "live"), {b.to_bytes(2, "big"): 1})
    assert await index.gc() == 2
    assert await depths(index, ch) == {"A": 3, "C": 1}


async def test_truncated_or_hostile_load_records(index: RedisPrefixIndex, raw) -> None:
    ch = chain_of(6, 2)
    a, b = await two_workers(index, ch)
    good = msgpack.packb({"type": "load", "num_running": 3})
    raw.hset(key(index, "load"), mapping={
        a.to_bytes(2, "big"): good[:-2],  # truncated msgpack
        b.to_bytes(2, "big"): msgpack.packb({"type": "load", "kv_usage": math.nan}),
    })
    raw.incr(key(index, "lv"))
    result = await index.lookup(ch)
    assert {k: (m.confirmed_depth, m.load) for k, m in result.matches.items()} == {
        "A": (2, None), "B": (2, None)}
    for hostile in (math.inf, math.nan, 1e308 * 10):
        with pytest.raises(EventDecodeError):
            decode_load(msgpack.packb({"type": "load", "prefill_tokens_per_s": hostile}))


async def test_events_for_a_worker_that_does_not_exist(index: RedisPrefixIndex, raw) -> None:
    ch = chain_of(7, 3)
    _a, _b = await two_workers(index, ch)
    ghost = 4242
    assert await index.apply(EventBatch(ghost, 1, 1, (BlockStored(tuple(ch)),))) \
        is ResultCode.RESYNC_NEEDED
    with pytest.raises(UnknownWorker):
        await index.resync(ghost, 1, ch, 1)
    assert not await index.heartbeat(ghost, 1, WorkerLoad())
    await index.predict(ch, ghost)
    await index.deregister(ghost)
    assert await depths(index, ch) == {"A": 3, "B": 2}
    assert not raw.exists(key(index, f"w:{ghost}"), key(index, f"r:{ghost}"))


async def test_block_values_with_junk(index: RedisPrefixIndex, raw) -> None:
    ch = chain_of(8, 4)
    a, b = await two_workers(index, ch)
    k2, k3 = ch[2][:INDEX_KEY_BYTES], ch[3][:INDEX_KEY_BYTES]  # the block hash's keys
    raw.hset(key(index, "B"), mapping={k2: b"\x00" + raw.hget(key(index, "B"), k2),
                                       k3: b"\xff"})
    assert (await depths(index, ch))["B"] == 2
    await index.apply(EventBatch(b, 1, 2, (BlockStored(tuple(ch)),)))
    assert (await depths(index, ch))["B"] == 4  # the junk values were replaced, not extended
    await index.resync(a, 1, ch[:2], 2)
    assert (await depths(index, ch))["A"] == 2
    assert await index.apply(EventBatch(a, 1, 3, ())) is ResultCode.OK
    await index.deregister(a)
    assert "A" not in await depths(index, ch)


@pytest.mark.parametrize("victim", ["B", "live", "load", "rv", "lv", "reg", "ids", "T"])
async def test_a_shared_key_of_the_wrong_type_is_unavailable_never_another_error(
    index: RedisPrefixIndex, raw, victim: str
) -> None:
    ch = chain_of(9, 3)
    a, _b = await two_workers(index, ch)
    raw.delete(key(index, victim))
    raw.rpush(key(index, victim), b"junk")  # a list where a hash / zset / string belongs
    for call in (
        lambda: index.lookup(ch),
        lambda: index.live_workers(),
        lambda: index.gc(),
        lambda: index.apply(EventBatch(a, 1, 2, (BlockStored(tuple(ch)),))),
        lambda: index.heartbeat(a, 1, WorkerLoad()),
        lambda: index.register("Z", epoch=1, block_size=4, fingerprint="fp"),
        lambda: index.predict(ch, a),
        lambda: index.predict(chain_of(9, 80), a),  # past predict_exact_blocks: a tail
    ):
        with contextlib.suppress(IndexUnavailable):  # the router's fail-open signal
            await call()
    raw.delete(key(index, victim))  # an operator cleans up: the index works again
    assert (await index.lookup(ch)).matches is not None


async def test_redis_restarted_empty_and_ids_swapped_does_not_fence_a_live_worker(
    redis_server: LocalRedis, raw
) -> None:
    """Redis comes back empty; B re-registers first and gets A's old id (with B's newer
    epoch). A's next batch meets a newer epoch under "its" id: that is not a newer incarnation
    of A, so A must register again (a new id) and resync, not stop publishing forever."""
    model = "h" + uuid.uuid4().hex[:7]
    engines: dict[str, set[bytes]] = {"A": set(), "B": set()}

    def publisher(rid: str, epoch: int, heartbeat_s: float) -> EventPublisher:
        idx = RedisPrefixIndex(redis_server.url, model, deadline_s=1.0,
                               settings=IndexSettings(lease_ttl_s=30.0))
        return EventPublisher(idx, replica_id=rid, epoch=epoch, block_size=4, fingerprint="fp",
                              snapshot=lambda: list(engines[rid]),
                              heartbeat_interval_s=heartbeat_s)

    a, b = publisher("A", 1, 60.0), publisher("B", 2, 0.2)
    a.start()
    try:
        ca, cb = chain_of(20, 4), chain_of(21, 3)
        engines["A"].update(ca)
        assert await a.wait_synced(5)
        b.start()
        engines["B"].update(cb)
        assert await b.wait_synced(5)
        assert (a.worker_id, b.worker_id) == (1, 2)

        raw.delete(*raw.keys("{" + model + "}*"))  # Redis restarted empty
        for _ in range(100):  # B notices first (heartbeat), re-registers: it gets id 1
            if b.worker_id == 1 and await b.wait_synced(0.05):
                break
            await asyncio.sleep(0.05)
        assert b.worker_id == 1

        more = chain_of(22, 2)
        engines["A"].update(more)
        a.publish([BlockStored(tuple(more))])  # applied under id 1: B's record, newer epoch
        for _ in range(100):
            if a.worker_id not in (None, 1) and await a.wait_synced(0.05):
                break
            await asyncio.sleep(0.05)
        assert not a.fenced
        assert a.worker_id == 2
        async with contextlib.AsyncExitStack() as stack:
            idx = RedisPrefixIndex(redis_server.url, model, deadline_s=1.0)
            stack.push_async_callback(idx.close)
            assert await depths(idx, ca) == {"A": 4}
            assert await depths(idx, more) == {"A": 2}
            assert await depths(idx, cb) == {"B": 3}
    finally:
        await a.close()
        await b.close()
