"""The Redis prefix index against a real redis-server: depths, fencing, resync, leases, GC."""

from __future__ import annotations

import asyncio
import contextlib
import re
import struct
import time
import uuid
from importlib.resources import files

import msgpack
import pytest
import redis
from conftest import TlsRedis, reverse_index

from prefixserve.cluster.local_redis import LocalRedis, LocalRedisCluster
from prefixserve.router import redis_index
from prefixserve.router.blocks import hash_chain, namespace
from prefixserve.router.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    WorkerLoad,
)
from prefixserve.router.index import (
    INDEX_KEY_BYTES,
    IndexSettings,
    IndexSize,
    IndexUnavailable,
    ResultCode,
    StaleEpoch,
    UnknownWorker,
    expect,
    within,
)
from prefixserve.router.index_stores import INDEX_STORES, open_index
from prefixserve.router.redis_index import MAX_TAILS, REVERSE_SEGMENT_BYTES, RedisPrefixIndex
from prefixserve.router.redis_records import key_tag, match_depths, tail_record
from prefixserve.router.redis_scripts import SCRIPTS, source

NS = namespace("test-model")


def chain_of(seed: int, n: int) -> list[bytes]:
    return hash_chain([seed * 1000 + i for i in range(n * 4)], block_size=4, ns=NS)


def model_name() -> str:
    return "t" + uuid.uuid4().hex[:7]


@pytest.fixture
async def index(redis_server: LocalRedis):
    idx = RedisPrefixIndex(redis_server.url, model_name(), deadline_s=1.0,
                           settings=IndexSettings(lease_ttl_s=5.0))
    yield idx
    await idx.close()


async def register(idx: RedisPrefixIndex, rid: str, epoch: int = 1) -> int:
    return await idx.register(rid, epoch=epoch, block_size=4, fingerprint="fp", node="n0")


def stored(wid: int, seq: int, hashes, epoch: int = 1) -> EventBatch:
    return EventBatch(wid, epoch, seq, (BlockStored(tuple(hashes)),))


async def hold(idx: RedisPrefixIndex, chain: list[bytes], holds: dict[str, int]) -> None:
    """Register each named worker, holding the chain's first ``holds[name]`` blocks."""
    for rid, n in holds.items():
        wid = await register(idx, rid)
        assert await idx.apply(stored(wid, 1, chain[:n])) is ResultCode.OK


def depths(result) -> dict[str, tuple[int, int]]:
    return {rid: (m.confirmed_depth, m.predicted_depth) for rid, m in result.matches.items()}


def keys_of(url: str, tag: str) -> list[bytes]:
    return redis.Redis.from_url(url).keys("{" + tag + "}*")


def block_entries(url: str, tag: str) -> dict[bytes, bytes]:
    """The block hash: a digest's first 8 bytes -> 2-byte big-endian ids of its holders."""
    return redis.Redis.from_url(url).hgetall("{" + tag + "}B")


def block_keys(chain: list[bytes]) -> set[bytes]:
    """The block-hash keys of a chain's digests."""
    return {h[:INDEX_KEY_BYTES] for h in chain}


@pytest.mark.cluster
async def test_three_workers_exact_depths_and_early_stop(index: RedisPrefixIndex) -> None:
    shared = chain_of(1, 12)
    a, b, c = [await register(index, r) for r in ("A", "B", "C")]
    assert sorted((a, b, c)) == [1, 2, 3]
    other = chain_of(2, 6)
    assert await index.apply(stored(a, 1, shared[:10])) is ResultCode.OK
    assert await index.apply(stored(b, 1, shared[:4])) is ResultCode.OK
    # C holds blocks 0..1 and 3..5 of the chain: its consecutive depth is 2, not 5.
    assert await index.apply(stored(c, 1, shared[:2] + shared[3:6] + other)) is ResultCode.OK
    assert await index.heartbeat(b, 1, WorkerLoad(num_running=7, queued_prefill_tokens=99))

    result = await index.lookup(shared)
    assert depths(result) == {"A": (10, 10), "B": (4, 4), "C": (2, 2)}
    assert result.blocks_walked == 11  # block 11 matched nobody: the walk stopped there
    assert result.matches["B"].load.num_running == 7
    assert result.matches["B"].load.queued_prefill_tokens == 99
    assert result.matches["A"].load is None
    assert {m.worker_id for m in result.matches.values()} == {a, b, c}

    miss = await index.lookup(chain_of(3, 64))  # only workers holding block 0 are returned
    assert depths(miss) == {}
    assert miss.blocks_walked == 1
    assert depths(await index.lookup(other)) == {"C": (6, 6)}
    assert depths(await index.lookup([])) == {}


def ids(*wids: int) -> bytes:
    return b"".join(w.to_bytes(2, "big") for w in wids)


def test_match_depths_from_the_changes_of_holders() -> None:
    changes = [1, ids(1, 2, 3, 4, 9), 5, ids(2, 1, 3), 7, ids(1, 3, 4), 9, b""]
    rides = ids(3) + (12).to_bytes(4, "big") + ids(5) + (2).to_bytes(4, "big")
    rides += ids(8) + (4).to_bytes(4, "big")
    # 9 holds block 1 but its lease lapsed (not live); 4 is back at block 7 after a hole;
    # 3 rides a prediction past its confirmed blocks; 5 rides from block 1; 8 is not live
    got = match_depths(ids(1, 2, 3, 4, 5), changes, rides, walked=9)
    assert got == {1: (8, 8), 2: (6, 6), 3: (8, 12), 4: (4, 4), 5: (0, 2)}
    # a walk that reached the chain's end: who is left holds all of it
    assert match_depths(ids(1, 2), [1, ids(1, 2), 3, ids(2)], b"", walked=40) == {
        1: (2, 2), 2: (40, 40)}
    assert match_depths(ids(1), [1, b""], ids(1) + (0).to_bytes(4, "big"), walked=1) == {}
    assert match_depths(b"", [], b"", walked=0) == {}


async def test_within_returns_the_result_or_times_out_and_cancels() -> None:
    assert await within(asyncio.sleep(0, result=7), 1.0) == 7
    cancelled = asyncio.Event()

    async def stuck() -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    with pytest.raises(TimeoutError):
        await within(stuck(), 0.01)
    assert cancelled.is_set()  # the lookup given up on does not run on


@pytest.mark.cluster
async def test_a_block_every_worker_holds_is_one_change(
    index: RedisPrefixIndex, redis_server: LocalRedis
) -> None:
    ch = chain_of(26, 40)
    wids = [await register(index, f"S{i}") for i in range(50)]
    for k, wid in enumerate(wids):  # all hold 30 blocks; each a block more than the one before
        assert await index.apply(stored(wid, 1, ch[: 30 + k // 5])) is ResultCode.OK
    assert depths(await index.lookup(ch)) == {
        f"S{k}": (30 + k // 5, 30 + k // 5) for k in range(50)}
    raw = redis.Redis.from_url(redis_server.url)
    keys = ("live", "load", "rv", "lv", "T", "lz")
    reply = msgpack.unpackb(raw.evalsha(
        index._scripts["lookup"].sha, 6, *("{" + index.tag + "}" + k for k in keys),
        "{" + index.tag + "}", b"".join(ch), b""), raw=True)
    # the 30 blocks all hold are one change; then one per block as holders leave, then nobody
    assert reply[2][::2] == [1, *range(31, 41)]
    assert reply[2][1] == ids(*wids) and reply[2][-1] == b""


@pytest.mark.cluster
async def test_deep_walk_across_chunk_boundaries(index: RedisPrefixIndex) -> None:
    ch = chain_of(22, 200)
    holds = {"A": 200, "B": 100, "C": 23, "D": 8, "E": 9, "F": 24}
    await hold(index, ch, holds)
    result = await index.lookup(ch)
    assert depths(result) == {rid: (n, n) for rid, n in holds.items()}
    assert result.blocks_walked == 200
    assert depths(await index.lookup(ch[:50])) == {r: (min(n, 50),) * 2 for r, n in holds.items()}


def hash_reads(url: str) -> int:
    """HGET and HMGET calls the server has run (scripts' calls count too)."""
    stats = redis.Redis.from_url(url).info("commandstats")
    return sum(stats.get(f"cmdstat_{c}", {}).get("calls", 0) for c in ("hget", "hmget"))


@pytest.mark.cluster
async def test_long_runs_of_the_same_holders_are_galloped_exactly(
    index: RedisPrefixIndex, redis_server: LocalRedis
) -> None:
    ch = chain_of(23, 3000)
    # depths around the gallop's steps and the binary search's midpoints
    holds = {"A": 3000, "B": 2500, "C": 1025, "D": 1024, "E": 1023, "F": 130, "G": 57}
    await hold(index, ch, holds)
    result = await index.lookup(ch)
    assert depths(result) == {rid: (n, n) for rid, n in holds.items()}
    assert result.blocks_walked == 3000
    assert depths(await index.lookup(ch[:1024])) == {r: (min(n, 1024),) * 2
                                                     for r, n in holds.items()}
    assert depths(await index.lookup(ch[:2499] + chain_of(24, 9))) == {
        r: (min(n, 2499),) * 2 for r, n in holds.items()}
    long = chain_of(25, 4000)
    assert await index.apply(stored(1, 2, long)) is ResultCode.OK
    assert await index.apply(stored(2, 2, long[:2000])) is ResultCode.OK
    before = hash_reads(redis_server.url)
    assert depths(await index.lookup(long)) == {"A": (4000, 4000), "B": (2000, 2000)}
    # block by block, in 64-block chunks, that would be 65 reads
    assert hash_reads(redis_server.url) - before < 35


@pytest.mark.cluster
@pytest.mark.parametrize("holders", [3, 70])  # 70: a first block many workers hold
async def test_only_live_holders_of_block_0_are_matched(
    index: RedisPrefixIndex, redis_server: LocalRedis, holders: int
) -> None:
    ids = [await register(index, f"W{i}") for i in range(holders + 2)]
    ch = chain_of(41, 3)
    for w in ids[:holders]:
        assert await index.apply(stored(w, 1, ch if w != ids[1] else ch[:2])) is ResultCode.OK
    assert await index.apply(stored(ids[-1], 1, ch[1:])) is ResultCode.OK  # no block 0: no match
    await index.predict(ch, ids[-2])  # W{holders} holds it by a prediction only
    only_w0 = chain_of(42, 3)
    assert await index.apply(stored(ids[0], 2, only_w0)) is ResultCode.OK
    want = {f"W{i}": (3, 3) for i in range(2, holders)} | {"W1": (2, 2)}
    # the client knows them all as live workers: only the index can tell their leases lapsed
    assert depths(await index.lookup(ch)) == want | {"W0": (3, 3), f"W{holders}": (0, 3)}
    raw = redis.Redis.from_url(redis_server.url)
    seconds, micros = raw.time()
    just_now = seconds * 1000 + micros // 1000 - 50  # ms, Redis' clock
    lapsed = {ids[0].to_bytes(2, "big"): just_now, ids[-2].to_bytes(2, "big"): 1}
    raw.zadd("{" + index.tag + "}live", lapsed)  # their leases lapsed
    result = await index.lookup(ch)
    assert depths(result) == want
    assert result.blocks_walked == 3
    alone = await index.lookup(only_w0)  # its one holder is not live: no walk past block 0
    assert alone.matches == {} and alone.blocks_walked == 1


def count_lists(idx: RedisPrefixIndex, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the index's reads of the live workers' list: ``[n]``, updated as they happen."""
    calls, live_workers = [0], idx.live_workers

    async def counted():
        calls[0] += 1
        return await live_workers()

    monkeypatch.setattr(idx, "live_workers", counted)
    return calls


@pytest.mark.cluster
@pytest.mark.parametrize("stray", ["swept", "junk"])
async def test_holders_that_are_no_live_worker_match_nothing_and_cost_one_list(
    index: RedisPrefixIndex, redis_server: LocalRedis, stray: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A dead worker whose entries the sweep is removing (out of the live set), or an id no
    worker has among block 0's holders: it matches nothing, and it makes the client read the
    live workers once, not on every lookup."""
    a, b = await register(index, "A"), await register(index, "B")
    ch = chain_of(43, 3)
    for w in (a, b):
        assert await index.apply(stored(w, 1, ch)) is ResultCode.OK
    assert depths(await index.lookup(ch)) == {"A": (3, 3), "B": (3, 3)}
    raw, tag = redis.Redis.from_url(redis_server.url), "{" + index.tag + "}"
    want = {"A": (3, 3)}
    if stray == "swept":  # the sweep's first step (gc_mark.lua): out of the live set, rv moves
        raw.zrem(tag + "live", b.to_bytes(2, "big"))
        raw.incr(tag + "rv")
    else:  # someone else's junk: an id nobody registered, among block 0's holders
        first = ch[0][:INDEX_KEY_BYTES]
        raw.hset(tag + "B", first, raw.hget(tag + "B", first) + (999).to_bytes(2, "big"))
        want["B"] = (3, 3)
    lists = count_lists(index, monkeypatch)
    for _ in range(4):
        assert depths(await index.lookup(ch)) == want
    assert lists == [1]


@pytest.mark.cluster
async def test_unknown_holders_are_looked_up_again_after_a_lease(
    redis_server: LocalRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ids the last list of live workers lacked are asked about again once a lease has passed:
    one whose lease had lapsed then may be back (renewed by a heartbeat, which moves no rv)."""
    idx = RedisPrefixIndex(redis_server.url, model_name(), deadline_s=1.0,
                           settings=IndexSettings(lease_ttl_s=2.0))
    try:
        a = await register(idx, "A")
        ch = chain_of(44, 2)
        assert await idx.apply(stored(a, 1, ch)) is ResultCode.OK
        raw, tag = redis.Redis.from_url(redis_server.url), "{" + idx.tag + "}"
        first = ch[0][:INDEX_KEY_BYTES]
        raw.hset(tag + "B", first, raw.hget(tag + "B", first) + (999).to_bytes(2, "big"))
        await idx.lookup(ch)
        lists = count_lists(idx, monkeypatch)
        await idx.lookup(ch)
        assert lists == [0]  # the first lookup's list lacked 999: not asked again at once
        await asyncio.sleep(idx.lease_ttl_s + 0.1)
        await idx.heartbeat(a, 1, WorkerLoad())
        assert depths(await idx.lookup(ch)) == {"A": (2, 2)}
        assert lists == [1]
    finally:
        await idx.close()


@pytest.mark.cluster
async def test_lookup_always_returns_the_latest_loads(index: RedisPrefixIndex) -> None:
    a = await register(index, "A")
    b = await register(index, "B")
    ch = chain_of(19, 2)
    await index.apply(stored(a, 1, ch))
    first = await index.lookup(ch)
    assert first.loads == {} and first.matches["A"].load is None
    for running in (1, 2, 3):
        assert await index.heartbeat(a, 1, WorkerLoad(num_running=running))
        result = await index.lookup(ch)
        assert result.matches["A"].load.num_running == running
        assert result.loads == {"A": WorkerLoad(num_running=running)}
        again = await index.lookup(ch)  # unchanged loads are served from the client's cache
        assert again.matches["A"].load == result.matches["A"].load
        assert again.loads is result.loads
    await index.heartbeat(b, 1, WorkerLoad(kv_usage=0.25))
    result = await index.lookup(ch)  # B matched nothing: its load and id come all the same
    assert "B" not in result.matches and result.loads["B"].kv_usage == 0.25
    assert result.worker_ids == {"A": a, "B": b}
    await index.gc()  # nobody dead: loads stay
    await index.deregister(b)
    result = await index.lookup(ch)
    assert set(result.loads) == {"A"} and result.worker_ids == {"A": a}


@pytest.mark.cluster
async def test_a_lookup_returns_only_the_loads_changed_since_the_last(
    index: RedisPrefixIndex, redis_server: LocalRedis
) -> None:
    ids = [await register(index, f"W{i}") for i in range(20)]
    for w in ids:
        assert await index.heartbeat(w, 1, WorkerLoad(num_running=w))
    ch = chain_of(23, 2)
    raw = redis.Redis.from_url(redis_server.url)
    sha = raw.script_load(index._scripts["lookup"].script)
    prefix, lv = "{" + index.tag + "}", b""

    def changed() -> list[bytes]:
        reply = raw.evalsha(sha, 6, *(prefix + k for k in ("live", "load", "rv", "lv", "T", "lz")),
                            prefix, b"".join(ch), lv)
        return msgpack.unpackb(reply, raw=True)[5][::2]

    assert len(changed()) == 20  # a client without a version gets every load
    assert len((await index.lookup(ch)).loads) == 20
    lv = index.cache.loads_version
    assert changed() == []  # nothing changed since: nothing is sent
    await index.heartbeat(ids[3], 1, WorkerLoad(num_running=99))
    assert changed() == [ids[3].to_bytes(2, "big")]
    assert (await index.lookup(ch)).loads["W3"].num_running == 99


@pytest.mark.cluster
async def test_removed_and_cleared_events(index: RedisPrefixIndex) -> None:
    ch = chain_of(4, 8)
    a = await register(index, "A")
    b = await register(index, "B")
    await index.apply(stored(a, 1, ch))
    await index.apply(stored(b, 1, ch[:3]))
    removed = EventBatch(a, 1, 2, (BlockRemoved((ch[5],)),))
    assert await index.apply(removed) is ResultCode.OK
    assert depths(await index.lookup(ch)) == {"A": (5, 5), "B": (3, 3)}
    # Re-applying the same seq is a no-op (a retried batch must not count twice).
    assert await index.apply(EventBatch(a, 1, 2, (BlockStored((ch[5],)),))) is ResultCode.OK
    assert depths(await index.lookup(ch))["A"] == (5, 5)
    cleared = EventBatch(a, 1, 3, (AllBlocksCleared(), BlockStored((ch[0],))))
    assert await index.apply(cleared) is ResultCode.OK
    assert depths(await index.lookup(ch)) == {"A": (1, 1), "B": (3, 3)}
    # blocks held below the pool (host memory, disk) are held: B's demoted blocks stay, and
    # A's blocks stored on disk (a warm restart's announcement) count
    lower = EventBatch(b, 1, 2, (BlockStored(tuple(ch[:3]), "host"),))
    assert await index.apply(lower) is ResultCode.OK
    on_disk = EventBatch(a, 1, 4, (BlockStored(tuple(ch[1:4]), "disk"),))
    assert await index.apply(on_disk) is ResultCode.OK
    assert depths(await index.lookup(ch)) == {"A": (4, 4), "B": (3, 3)}


@pytest.mark.cluster
async def test_register_is_idempotent_and_epoch_fences(index: RedisPrefixIndex) -> None:
    ch = chain_of(5, 4)
    a = await register(index, "A", epoch=10)
    assert await register(index, "A", epoch=10) == a
    assert await index.apply(stored(a, 1, ch, epoch=10)) is ResultCode.OK

    # A new incarnation keeps its id but must resync before its batches count.
    assert await register(index, "A", epoch=11) == a
    assert await index.apply(stored(a, 2, ch[:1], epoch=10)) is ResultCode.STALE_EPOCH
    assert await index.apply(stored(a, 1, ch[:1], epoch=11)) is ResultCode.RESYNC_NEEDED
    await index.resync(a, 11, ch[:2], seq=0)
    assert depths(await index.lookup(ch)) == {"A": (2, 2)}
    assert await index.apply(stored(a, 1, ch, epoch=11)) is ResultCode.OK
    assert depths(await index.lookup(ch)) == {"A": (4, 4)}

    with pytest.raises(StaleEpoch):
        await register(index, "A", epoch=10)
    with pytest.raises(StaleEpoch):
        await index.resync(a, 10, [], seq=0)
    assert not await index.heartbeat(a, 10, WorkerLoad())
    assert await index.heartbeat(a, 11, WorkerLoad())
    with pytest.raises(UnknownWorker):
        await index.resync(99, 1, [], seq=0)


@pytest.mark.cluster
async def test_sequence_gap_asks_for_resync_and_resync_replaces_the_set(
    index: RedisPrefixIndex,
) -> None:
    ch = chain_of(6, 10)
    a = await register(index, "A")
    assert await index.apply(stored(a, 1, ch[:6])) is ResultCode.OK
    assert await index.apply(stored(a, 3, ch[6:])) is ResultCode.RESYNC_NEEDED  # seq 2 lost
    assert await index.apply(stored(a, 4, ch[6:])) is ResultCode.RESYNC_NEEDED
    assert depths(await index.lookup(ch)) == {"A": (6, 6)}  # the gapped batch was not applied

    # The worker's truth: blocks 0..2 plus an unrelated chain (blocks 3..5 were evicted).
    unrelated = chain_of(7, 3)
    await index.resync(a, 1, ch[:3] + unrelated, seq=4)
    assert depths(await index.lookup(ch)) == {"A": (3, 3)}
    assert depths(await index.lookup(unrelated)) == {"A": (3, 3)}
    assert await index.apply(stored(a, 5, ch[3:5])) is ResultCode.OK
    assert depths(await index.lookup(ch)) == {"A": (5, 5)}


@pytest.mark.cluster
async def test_large_resync_is_chunked_and_exact(
    index: RedisPrefixIndex, redis_server: LocalRedis
) -> None:
    a = await register(index, "A")
    first = chain_of(8, 9000)
    await index.resync(a, 1, first, seq=0)
    assert depths(await index.lookup(first[:600])) == {"A": (600, 600)}
    second = first[:5000] + chain_of(9, 5000)
    await index.resync(a, 1, second, seq=0)
    assert depths(await index.lookup(first)) == {"A": (5000, 5000)}
    assert depths(await index.lookup(second[5000:])) == {"A": (5000, 5000)}
    assert await index.gc() == 0
    await index.deregister(a)
    assert block_entries(redis_server.url, index.tag) == {}


@pytest.mark.cluster
async def test_reverse_index_stays_bounded_under_churn(
    index: RedisPrefixIndex, redis_server: LocalRedis
) -> None:
    a = await register(index, "A")
    raw = redis.Redis.from_url(redis_server.url)
    seq = 0
    for round_ in range(6):
        ch = chain_of(100 + round_, 1000)
        seq += 1
        await index.apply(stored(a, seq, ch))
        seq += 1
        await index.apply(EventBatch(a, 1, seq, (BlockRemoved(tuple(ch)),)))
    # 6,000 blocks stored then evicted: garbage is compacted away, not kept forever.
    # (compaction runs once garbage exceeds 2 x live + 1024 records)
    assert len(reverse_index(raw, f"{{{index.tag}}}r:{a}")) <= INDEX_KEY_BYTES * (1024 + 1000)
    keep = chain_of(200, 50)
    await index.apply(stored(a, seq + 1, keep))
    assert depths(await index.lookup(keep)) == {"A": (50, 50)}
    await index.deregister(a)
    assert block_entries(redis_server.url, index.tag) == {}


@pytest.mark.cluster
async def test_the_reverse_index_is_kept_in_segments_allocated_at_their_size(
    index: RedisPrefixIndex, redis_server: LocalRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """2,500 keys appended 100 at a time fill two sealed 1,023-key segments and a tail; Redis
    holds them without the spare capacity of a string appended to (which doubles as it grows).
    A clear, a GC in chunks across the segments' edges, and a resync read them whole."""
    a, b = await register(index, "A"), await register(index, "B")
    ch = chain_of(30, 2500)
    for i in range(25):
        assert await index.apply(stored(a, i + 1, ch[i * 100:(i + 1) * 100])) is ResultCode.OK
    raw = redis.Redis.from_url(redis_server.url)
    r = f"{{{index.tag}}}r:{a}"
    seg = REVERSE_SEGMENT_BYTES
    assert raw.hlen(r + ":s") == 2
    assert raw.hstrlen(r + ":s", "0") == raw.hstrlen(r + ":s", "1") == seg == 1023 * 8
    assert raw.strlen(r) == 2500 * INDEX_KEY_BYTES - 2 * seg
    assert reverse_index(raw, r) == b"".join(h[:INDEX_KEY_BYTES] for h in ch)
    assert (await index.size()).reverse_index_bytes == 2500 * INDEX_KEY_BYTES
    # the sealed segments are held at their size; only the tail (here 3.6 KiB) has spare room
    assert raw.memory_usage(r + ":s", samples=0) < 1.02 * 2 * seg + 256
    assert depths(await index.lookup(ch)) == {"A": (2500, 2500)}
    # B holds the same blocks, then clears them all: A's entries stay
    assert await index.apply(stored(b, 1, ch)) is ResultCode.OK
    assert await index.apply(EventBatch(b, 1, 2, (AllBlocksCleared(),))) is ResultCode.OK
    assert not raw.exists(f"{{{index.tag}}}r:{b}", f"{{{index.tag}}}r:{b}:s")
    assert depths(await index.lookup(ch)) == {"A": (2500, 2500)}
    # a resync keeps the first 2,000 and reads the old set from every segment
    await index.resync(a, 1, ch[:2000], seq=30)
    assert depths(await index.lookup(ch)) == {"A": (2000, 2000)}
    assert reverse_index(raw, r) == b"".join(h[:INDEX_KEY_BYTES] for h in ch[:2000])
    # GC in chunks of 700 keys, which start and end inside segments
    monkeypatch.setattr(redis_index, "_GC_CHUNK", 700)
    await index.deregister(a)
    assert block_entries(redis_server.url, index.tag) == {}
    assert not raw.exists(r, r + ":s")


@pytest.mark.cluster
async def test_a_reverse_index_in_the_older_layout_is_sealed_by_its_next_append(
    index: RedisPrefixIndex, redis_server: LocalRedis
) -> None:
    """An index written by a version that appended one string per worker keeps working: the
    string is a long tail, whose whole segments the next append seals."""
    a = await register(index, "A")
    ch = chain_of(31, 1500)
    assert await index.apply(stored(a, 1, ch[:1200])) is ResultCode.OK
    raw = redis.Redis.from_url(redis_server.url)
    r = f"{{{index.tag}}}r:{a}"
    raw.delete(r, r + ":s")  # the layout before segments: one string
    raw.set(r, b"".join(h[:INDEX_KEY_BYTES] for h in ch[:1200]))
    assert (await index.size()).reverse_index_bytes == 1200 * INDEX_KEY_BYTES  # as it was
    assert await index.apply(stored(a, 2, ch[1200:])) is ResultCode.OK
    assert raw.hlen(r + ":s") == 1
    assert raw.strlen(r) == 1500 * INDEX_KEY_BYTES - REVERSE_SEGMENT_BYTES
    assert reverse_index(raw, r) == b"".join(h[:INDEX_KEY_BYTES] for h in ch)
    assert (await index.size()).reverse_index_bytes == 1500 * INDEX_KEY_BYTES
    assert await index.apply(EventBatch(a, 1, 3, (AllBlocksCleared(),))) is ResultCode.OK
    assert block_entries(redis_server.url, index.tag) == {}


@pytest.mark.cluster
async def test_lease_expiry_hides_worker_and_gc_removes_its_keys(redis_server: LocalRedis) -> None:
    idx = RedisPrefixIndex(redis_server.url, model_name(), deadline_s=1.0,
                           settings=IndexSettings(lease_ttl_s=0.3))
    try:
        ch = chain_of(10, 6)
        a = await register(idx, "A")
        b = await register(idx, "B")
        await idx.apply(stored(a, 1, ch))
        await idx.apply(stored(b, 1, ch[:4] + chain_of(11, 2)))
        await idx.heartbeat(b, 1, WorkerLoad(num_running=1))
        for _ in range(4):  # keep A alive, let B's lease lapse
            await asyncio.sleep(0.1)
            assert await idx.heartbeat(a, 1, WorkerLoad())
        result = await idx.lookup(ch)
        assert depths(result) == {"A": (6, 6)}
        assert [w.replica_id for w in await idx.live_workers()] == ["A"]

        assert await idx.gc() == 6  # B's six (block, worker) entries
        raw = redis.Redis.from_url(redis_server.url)
        p = "{" + idx.tag + "}"
        assert not raw.exists(f"{p}w:{b}", f"{p}r:{b}")
        assert raw.hget(f"{p}load", b) is None
        blocks = block_entries(redis_server.url, idx.tag)
        assert set(blocks) == block_keys(ch)  # only A's blocks are left; B-only blocks are gone
        assert reverse_index(raw, f"{p}r:{a}") == b"".join(h[:INDEX_KEY_BYTES] for h in ch)
        assert set(blocks.values()) == {a.to_bytes(2, "big")}
        assert await idx.gc() == 0

        # B comes back: it gets a fresh registration (its old id is free again) and no
        # stale entries, and its old batches are no longer accepted.
        assert not await idx.heartbeat(b, 1, WorkerLoad())
        assert await idx.apply(stored(b, 2, ch)) is ResultCode.RESYNC_NEEDED
        b2 = await register(idx, "B")
        assert b2 == b
        assert depths(await idx.lookup(ch)) == {"A": (6, 6)}
    finally:
        await idx.close()


@pytest.mark.cluster
async def test_deregister_removes_entries_at_once(
    index: RedisPrefixIndex, redis_server: LocalRedis
) -> None:
    ch = chain_of(12, 5)
    a = await register(index, "A")
    b = await register(index, "B")
    await index.apply(stored(a, 1, ch))
    await index.apply(stored(b, 1, ch))
    await index.deregister(a)
    assert depths(await index.lookup(ch)) == {"B": (5, 5)}
    await index.deregister(b)
    assert (await index.lookup(ch)).matches == {}
    assert block_entries(redis_server.url, index.tag) == {}
    p = "{" + index.tag + "}"
    assert not redis.Redis.from_url(redis_server.url).exists(f"{p}w:{a}", f"{p}r:{b}")


@pytest.mark.cluster
async def test_predicted_entries_count_and_expire(redis_server: LocalRedis) -> None:
    idx = RedisPrefixIndex(redis_server.url, model_name(), deadline_s=1.0,
                           settings=IndexSettings(predict_ttl_s=0.3))
    try:
        ch = chain_of(13, 8)
        a = await register(idx, "A")
        b = await register(idx, "B")
        await idx.apply(stored(a, 1, ch[:3]))
        await idx.predict(ch, b)  # a burst routed to B before any event arrived
        await idx.predict(ch[:6], a, from_block=3)
        assert depths(await idx.lookup(ch)) == {"A": (3, 6), "B": (0, 8)}
        await asyncio.sleep(0.45)
        assert depths(await idx.lookup(ch)) == {"A": (3, 3)}
        raw = redis.Redis.from_url(redis_server.url)
        assert raw.keys("{" + idx.tag + "}q*") == []
        # A hole in the confirmed blocks bridged by a prediction: predicted depth runs on.
        await idx.apply(stored(a, 2, ch[5:8]))
        assert depths(await idx.lookup(ch)) == {"A": (3, 3)}
        await idx.predict(ch[3:5], a)
        assert depths(await idx.lookup(ch)) == {"A": (3, 8)}
    finally:
        await idx.close()


def sampled(chain: list[bytes], from_block: int, start: int) -> list[int]:
    """The block positions a prediction's tail samples (from its record)."""
    rec = tail_record(chain, from_block, start)
    count = struct.unpack(">H", rec[4:6])[0]
    return [struct.unpack(">I", rec[6 + 20 * k : 10 + 20 * k])[0] for k in range(count)]


@pytest.mark.cluster
async def test_a_long_prediction_is_a_few_keys_and_keeps_its_depth(
    redis_server: LocalRedis,
) -> None:
    """Past predict_exact_blocks a prediction is one sampled tail, not a key per block: the
    routed chain's predicted depth stays whole; a chain that leaves it is credited up to the
    last sample before it leaves (never past it)."""
    exact = 8
    idx = RedisPrefixIndex(redis_server.url, model_name(), deadline_s=1.0,
                           settings=IndexSettings(predict_exact_blocks=exact, predict_ttl_s=1.0))
    raw = redis.Redis.from_url(redis_server.url)
    try:
        ch = chain_of(30, 300)
        a = await register(idx, "A")
        b = await register(idx, "B")
        await idx.apply(stored(a, 1, ch[:5]))
        await idx.predict(ch, a, from_block=5)
        await idx.predict(ch, b)
        # B's exact blocks 0..7 and A's 5..12: 13 keys, not 300; one tail each.
        assert len(raw.keys("{" + idx.tag + "}q*")) == 13
        assert raw.hlen("{" + idx.tag + "}T") == 2
        result = await idx.lookup(ch)
        assert depths(result) == {"A": (5, 300), "B": (0, 300)}
        assert result.blocks_walked == 300  # skipped ahead while both rode their tails

        leaves = ch[:150] + chain_of(31, 20)  # same first 150 blocks, then another prompt
        got = depths(await idx.lookup(leaves))
        a_at = max(p for p in sampled(ch, 5, 5 + exact) if p < 150) + 1
        b_at = max(p for p in sampled(ch, 0, exact) if p < 150) + 1
        assert got == {"A": (5, a_at), "B": (0, b_at)}
        assert min(a_at, b_at) >= 150 - 300 // 63 and max(a_at, b_at) <= 150
        head = max(p for p in sampled(ch, 0, exact) if p < 100) + 1
        assert depths(await idx.lookup(ch[:100]))["B"] == (0, head)

        # A's prefill confirms blocks past the exact ones: confirmed walk, then the tail.
        await idx.apply(stored(a, 2, ch[5:200]))
        assert depths(await idx.lookup(ch)) == {"A": (200, 300), "B": (0, 300)}
        await idx.deregister(b)  # its tails go with it
        assert raw.hkeys("{" + idx.tag + "}T") == [a.to_bytes(2, "big")]
        await asyncio.sleep(1.1)
        assert depths(await idx.lookup(ch)) == {"A": (200, 200)}
        assert not raw.exists("{" + idx.tag + "}T")
    finally:
        raw.close()
        await idx.close()


@pytest.mark.cluster
async def test_tails_per_worker_are_bounded_and_a_repeat_replaces_its_own(
    redis_server: LocalRedis,
) -> None:
    idx = RedisPrefixIndex(redis_server.url, model_name(), deadline_s=1.0,
                           settings=IndexSettings(predict_exact_blocks=4))
    raw = redis.Redis.from_url(redis_server.url)
    try:
        a = await register(idx, "A")
        chains = [chain_of(40 + i, 20) for i in range(MAX_TAILS + 3)]
        for ch in chains:
            await idx.predict(ch, a)
        await idx.predict(chains[-1], a)
        record = 13 + 6 + 16 * 20  # expiry, from + count, 16 samples (blocks 4..19)
        assert len(raw.hget("{" + idx.tag + "}T", a.to_bytes(2, "big"))) == MAX_TAILS * record
        assert depths(await idx.lookup(chains[-1])) == {"A": (0, 20)}
        assert depths(await idx.lookup(chains[3])) == {"A": (0, 20)}
        assert depths(await idx.lookup(chains[0])) == {"A": (0, 4)}  # the oldest tail dropped
    finally:
        raw.close()
        await idx.close()


@pytest.mark.cluster
async def test_long_model_names_get_a_short_tag(redis_server: LocalRedis) -> None:
    name = "meta-llama/Llama-3.1-8B-Instruct-" + uuid.uuid4().hex[:6]
    assert key_tag(name).startswith("m") and len(key_tag(name)) == 8
    assert key_tag("qwen-7b") == "qwen-7b"
    idx = RedisPrefixIndex(redis_server.url, name, deadline_s=1.0)
    try:
        a = await register(idx, "A")
        await idx.apply(stored(a, 1, chain_of(14, 2)))
        assert all(k.startswith(b"{" + idx.tag.encode() + b"}") for k in
                   keys_of(redis_server.url, idx.tag))
    finally:
        await idx.close()


@pytest.mark.cluster
async def test_bad_digests_are_rejected(index: RedisPrefixIndex) -> None:
    ok = chain_of(20, 2)
    for bad in ([b"short"], [ok[0][:15], ok[1] + b"x"], [ok[0], b""]):
        with pytest.raises(ValueError):
            await index.lookup(bad)
    a = await register(index, "A")
    with pytest.raises(ValueError):
        await index.apply(stored(a, 1, [ok[0][:15], ok[1] + b"x"]))


@pytest.mark.cluster
async def test_auth_via_url() -> None:
    with LocalRedis(password="s3cret-pw") as server:
        idx = RedisPrefixIndex(server.url, model_name(), deadline_s=1.0)
        try:
            a = await register(idx, "A")
            await idx.apply(stored(a, 1, chain_of(15, 3)))
            assert depths(await idx.lookup(chain_of(15, 3))) == {"A": (3, 3)}
        finally:
            await idx.close()
        bad = RedisPrefixIndex(f"redis://:wrong@127.0.0.1:{server.port}/0", model_name(),
                               deadline_s=1.0)
        try:
            with pytest.raises(IndexUnavailable):
                await bad.lookup(chain_of(15, 3))
        finally:
            await bad.close()


@pytest.mark.cluster
async def test_redis_down_raises_fast_then_recovers(redis_server: LocalRedis) -> None:
    idx = RedisPrefixIndex(redis_server.url, model_name(), deadline_s=0.05)
    try:
        ch = chain_of(16, 4)
        a = await register(idx, "A")
        await idx.apply(stored(a, 1, ch))
        redis_server.stop()
        try:
            for call in (idx.lookup(ch), idx.apply(stored(a, 2, ch)),
                         idx.heartbeat(a, 1, WorkerLoad())):
                start = time.monotonic()
                with pytest.raises(IndexUnavailable):
                    await call
                assert time.monotonic() - start < 1.0
        finally:
            redis_server.start()
        idx.deadline_s = 1.0  # from here on the test checks recovery, not speed (busy host)
        # Redis came back empty: the worker is unknown until it registers and resyncs.
        assert (await idx.lookup(ch)).matches == {}
        assert not await idx.heartbeat(a, 1, WorkerLoad())
        a = await register(idx, "A")
        await idx.resync(a, 1, ch, seq=2)
        assert depths(await idx.lookup(ch)) == {"A": (4, 4)}
    finally:
        await idx.close()


@pytest.mark.cluster
async def test_blackholed_redis_raises_within_deadline() -> None:
    # A server that accepts connections but never answers (SIGSTOP'd redis-server).
    import os
    import signal

    with LocalRedis() as server:
        idx = RedisPrefixIndex(server.url, model_name(), deadline_s=0.05)
        try:
            await register(idx, "A")
            os.kill(server._proc.pid, signal.SIGSTOP)
            try:
                start = time.monotonic()
                with pytest.raises(IndexUnavailable):
                    await idx.lookup(chain_of(17, 4))
                assert time.monotonic() - start < 1.0
            finally:
                os.kill(server._proc.pid, signal.SIGCONT)
            idx.deadline_s = 1.0
            assert (await idx.lookup(chain_of(17, 4))).blocks_walked == 1
        finally:
            await idx.close()


@pytest.mark.cluster
async def test_tls_via_rediss_url(tls_redis: TlsRedis) -> None:
    idx = RedisPrefixIndex(tls_redis.url, model_name(), deadline_s=2.0)
    try:
        a = await register(idx, "A")
        await idx.apply(stored(a, 1, chain_of(18, 3)))
        assert depths(await idx.lookup(chain_of(18, 3))) == {"A": (3, 3)}
    finally:
        await idx.close()
    plain = RedisPrefixIndex(tls_redis.plaintext_url, model_name(), deadline_s=1.0)
    try:
        with pytest.raises(IndexUnavailable):  # a TLS port refuses plaintext clients
            await plain.lookup(chain_of(18, 3))
    finally:
        await plain.close()


class SlowStartProxy:
    """A loopback TCP proxy to ``port`` that holds the first chunk of each direction of every
    connection for ``delay_s``: setting a connection up (TCP, TLS, HELLO/AUTH) takes two
    delays or more, every later round trip none."""

    def __init__(self, port: int, delay_s: float) -> None:
        self.port, self.delay_s = port, delay_s
        self.connections = 0
        self._tasks: set[asyncio.Task] = set()

    def url(self, url: str) -> str:
        """``url`` (to 127.0.0.1:``port``) through the proxy."""
        return url.replace(f"127.0.0.1:{self.port}", f"127.0.0.1:{self.listen_port}")

    async def __aenter__(self) -> SlowStartProxy:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.listen_port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        task = asyncio.current_task()
        self._tasks.add(task)
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.port)
            await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        except (asyncio.CancelledError, OSError):
            pass  # the test is over, or a side hung up
        finally:
            writer.close()
            self._tasks.discard(task)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        first = True
        try:
            while data := await reader.read(65536):
                if first:
                    await asyncio.sleep(self.delay_s)
                    first = False
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()


@pytest.mark.cluster
@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls+auth"])
async def test_connection_setup_is_not_counted_in_the_lookup_deadline(
    request: pytest.FixtureRequest, tls: bool
) -> None:
    """Through the proxy a connection takes >= 300 ms to set up, three 100 ms lookup deadlines:
    lookups still answer within that deadline from the first one on, also when several at once
    each need a connection of their own. (The deadline leaves a busy CI host room for a TLS round
    trip through the proxy; the setup stays three deadlines long.)"""
    if tls:
        server: TlsRedis = request.getfixturevalue("tls_redis")
        direct, port = server.url, server.tls_port
    else:
        direct = request.getfixturevalue("redis_server").url
        port = int(direct.rsplit(":", 1)[1].split("/")[0])
    model = model_name()
    writer = RedisPrefixIndex(direct, model, deadline_s=2.0)
    ch = chain_of(23, 6)
    try:
        a = await register(writer, "A")
        await writer.apply(stored(a, 1, ch))
        async with SlowStartProxy(port, delay_s=0.15) as proxy:
            idx = RedisPrefixIndex(proxy.url(direct), model, deadline_s=0.1)
            try:
                start = time.monotonic()
                assert depths(await idx.lookup(ch)) == {"A": (6, 6)}
                assert time.monotonic() - start >= 0.3  # the setup alone: past the deadline
                for result in await asyncio.gather(*(idx.lookup(ch) for _ in range(4))):
                    assert depths(result) == {"A": (6, 6)}
                for _ in range(10):
                    assert depths(await idx.lookup(ch)) == {"A": (6, 6)}
                assert proxy.connections >= 2
            finally:
                await idx.close()
    finally:
        await writer.close()


@pytest.mark.cluster
async def test_a_setup_outlives_a_caller_that_gives_up(redis_server: LocalRedis) -> None:
    """The router caps a lookup at 4 x its deadline; a setup cut short there every time would
    never finish. It goes on, and the next lookup finds the connection ready."""
    model = model_name()
    writer = RedisPrefixIndex(redis_server.url, model, deadline_s=1.0)
    ch = chain_of(24, 3)
    try:
        a = await register(writer, "A")
        await writer.apply(stored(a, 1, ch))
        async with SlowStartProxy(redis_server.port, delay_s=0.25) as proxy:
            idx = RedisPrefixIndex(proxy.url(redis_server.url), model, deadline_s=0.1)
            try:
                with contextlib.suppress(asyncio.TimeoutError):  # the router's cap
                    await asyncio.wait_for(idx.lookup(ch), 0.4)
                await asyncio.sleep(0.8)
                assert depths(await idx.lookup(ch)) == {"A": (3, 3)}
                assert proxy.connections == 1
            finally:
                await idx.close()
    finally:
        await writer.close()


@pytest.mark.cluster
async def test_connect_timeout_bounds_a_setup_that_hangs(redis_server: LocalRedis) -> None:
    async with SlowStartProxy(redis_server.port, delay_s=30.0) as proxy:
        idx = RedisPrefixIndex(proxy.url(redis_server.url), model_name(), deadline_s=0.02,
                               settings=IndexSettings(connect_timeout_s=0.2))
        try:
            start = time.monotonic()
            with pytest.raises(IndexUnavailable, match="Timeout connecting"):
                await idx.lookup(chain_of(25, 2))
            assert 0.2 <= time.monotonic() - start < 1.5
        finally:
            await idx.close()


@pytest.mark.cluster
async def test_redis_cluster_via_url() -> None:
    with LocalRedisCluster(3) as cluster:
        raws = [redis.Redis.from_url(n.url) for n in cluster.servers]
        idx = RedisPrefixIndex(cluster.url, model_name(), deadline_s=2.0)
        try:
            ch = chain_of(21, 6)
            a = await register(idx, "A")
            b = await register(idx, "B")
            assert await idx.apply(stored(a, 1, ch)) is ResultCode.OK
            await idx.resync(b, 1, ch[:2], seq=0)
            await idx.predict(ch, b, from_block=2)
            assert depths(await idx.lookup(ch)) == {"A": (6, 6), "B": (2, 6)}
            await idx.deregister(a)
            assert depths(await idx.lookup(ch)) == {"B": (2, 6)}
            # every key of the model lives on the one node that owns its hash tag's slot
            holders = [r for r in raws if r.keys("{" + idx.tag + "}*")]
            assert len(holders) == 1
        finally:
            await idx.close()
        # ... unless the model is split over worker groups: then their slots spread it
        name = model_name()
        sharded = open_index(cluster.url, name, deadline_s=2.0,
                             settings=IndexSettings(shards=8))
        try:
            rids = [f"W{i}" for i in range(24)]
            wids = [await register(sharded, rid) for rid in rids]
            for seq, wid in enumerate(wids):
                assert await sharded.apply(stored(wid, 1, ch[: 1 + seq % 6])) is ResultCode.OK
            assert depths(await sharded.lookup(ch)) == {
                rid: (1 + i % 6,) * 2 for i, rid in enumerate(rids)}
            tags = {"{" + key_tag(f"{name}#{g}") + "}" for g in range(8)}
            holders = [r for r in raws if any(r.keys(t + "*") for t in tags)]
            assert len(holders) >= 2
        finally:
            await sharded.close()


class RecordingStore:
    """A stand-in store: what open_index passes to a store's constructor."""

    def __init__(self, url: str, model: str, **options: float) -> None:
        self.url, self.model, self.options = url, model, options


def test_open_index_picks_the_store_by_scheme(monkeypatch: pytest.MonkeyPatch) -> None:
    for url in ("redis://127.0.0.1:1/0", "rediss://h:1/0", "unix:///tmp/redis.sock"):
        assert type(open_index(url, "m", deadline_s=1.0)) is RedisPrefixIndex
    monkeypatch.setitem(INDEX_STORES, "mem", f"{__name__}:RecordingStore")
    settings = IndexSettings(lease_ttl_s=3.0)
    store = open_index("mem://", "m", deadline_s=0.5, settings=settings)
    assert isinstance(store, RecordingStore) and (store.url, store.model) == ("mem://", "m")
    assert store.options == {"deadline_s": 0.5, "settings": settings}
    with pytest.raises(ValueError, match="no prefix index store serves etcd"):
        open_index("etcd://host", "m", deadline_s=1.0)


def test_lua_result_codes_match_the_enum() -> None:
    codes = (files("prefixserve.router") / "lua" / "_codes.lua").read_text()
    names, values = re.search(r"local ([A-Z_, ]+) = ([0-9, ]+)", codes).groups()
    lua = dict(zip(names.split(", "), map(int, values.split(", ")), strict=True))
    assert lua == {code.name: code.value for code in ResultCode}


def test_expect_decodes_every_code_in_one_place() -> None:
    assert expect(0, "op") is ResultCode.OK
    assert expect(2, "op", ResultCode.OK, ResultCode.RESYNC_NEEDED) is ResultCode.RESYNC_NEEDED
    for raw, error in ((1, StaleEpoch), (3, UnknownWorker), (4, ValueError), (5, RuntimeError),
                       (2, RuntimeError), (99, RuntimeError)):
        with pytest.raises(error, match=r"^op: "):
            expect(raw, "op")


def test_scripts_are_assembled_from_shared_fragments() -> None:
    for name in SCRIPTS:
        text = source(name)
        assert "--#include" not in text
        assert text.count("local OK, STALE_EPOCH") <= 1  # a fragment at most once
    assert "local function epoch_state" in source("resync_chunk")
    assert "local function add_blocks" in source("resync_chunk")
    assert "redis.call('TIME')" in source("lookup")
    # the scripts and the client cut digests to the same key length
    for name in ("apply", "lookup", "gc_chunk", "resync_chunk", "resync_commit", "register"):
        assert f"local KEY = {INDEX_KEY_BYTES}\n" in source(name), name
    # and the client sizes the reverse index's segments as the scripts cut them
    assert f"local SEG = {REVERSE_SEGMENT_BYTES // INDEX_KEY_BYTES} * KEY" in source("apply")
    with pytest.raises(ValueError):
        source("../index")


@pytest.mark.cluster
async def test_the_store_reports_its_size(index: RedisPrefixIndex) -> None:
    chain = chain_of(70, 5)
    assert await index.size() == IndexSize(0, 0, 0)
    await hold(index, chain, {"A": 5, "B": 3})  # 8 entries over 5 distinct blocks
    assert await index.size() == IndexSize(8, 5, 8 * INDEX_KEY_BYTES)
    await index.deregister(await register(index, "B"))  # B's entries are collected
    size = await index.size()
    assert (size.entries, size.blocks) == (5, 5)
    assert size + size == IndexSize(10, 10, 2 * size.reverse_index_bytes)
