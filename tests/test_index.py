"""The Redis prefix index against a real redis-server: depths, fencing, resync, leases, GC."""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
import time
import uuid
from importlib.resources import files

import pytest
import redis
from conftest import TlsRedis

from cluster.local_redis import LocalRedis, free_port
from router.blocks import hash_chain, namespace
from router.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, WorkerLoad
from router.index import (
    INDEX_STORES,
    IndexSettings,
    IndexUnavailable,
    ResultCode,
    StaleEpoch,
    UnknownWorker,
    expect,
    open_index,
)
from router.redis_index import RedisPrefixIndex, key_tag
from router.redis_scripts import SCRIPTS, source

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


def depths(result) -> dict[str, tuple[int, int]]:
    return {rid: (m.confirmed_depth, m.predicted_depth) for rid, m in result.matches.items()}


def keys_of(url: str, tag: str) -> list[bytes]:
    return redis.Redis.from_url(url).keys("{" + tag + "}*")


def block_entries(url: str, tag: str) -> dict[bytes, bytes]:
    """The block hash: digest -> 2-byte big-endian ids of its holders."""
    return redis.Redis.from_url(url).hgetall("{" + tag + "}B")


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

    miss = await index.lookup(chain_of(3, 64))
    assert depths(miss) == {"A": (0, 0), "B": (0, 0), "C": (0, 0)}
    assert miss.blocks_walked == 1
    assert depths(await index.lookup(other)) == {"A": (0, 0), "B": (0, 0), "C": (6, 6)}
    assert depths(await index.lookup([])) == {"A": (0, 0), "B": (0, 0), "C": (0, 0)}


@pytest.mark.cluster
async def test_deep_walk_across_chunk_boundaries(index: RedisPrefixIndex) -> None:
    ch = chain_of(22, 200)
    holds = {"A": 200, "B": 100, "C": 23, "D": 8, "E": 9, "F": 24}
    for rid, n in holds.items():
        wid = await register(index, rid)
        assert await index.apply(stored(wid, 1, ch[:n])) is ResultCode.OK
    result = await index.lookup(ch)
    assert depths(result) == {rid: (n, n) for rid, n in holds.items()}
    assert result.blocks_walked == 200
    assert depths(await index.lookup(ch[:50])) == {r: (min(n, 50),) * 2 for r, n in holds.items()}


@pytest.mark.cluster
async def test_lookup_always_returns_the_latest_loads(index: RedisPrefixIndex) -> None:
    a = await register(index, "A")
    b = await register(index, "B")
    ch = chain_of(19, 2)
    assert {m.load for m in (await index.lookup(ch)).matches.values()} == {None}
    for running in (1, 2, 3):
        assert await index.heartbeat(a, 1, WorkerLoad(num_running=running))
        result = await index.lookup(ch)
        assert result.matches["A"].load.num_running == running
        assert result.matches["B"].load is None
        again = await index.lookup(ch)  # unchanged loads are served from the client's cache
        assert again.matches["A"].load == result.matches["A"].load
    await index.heartbeat(b, 1, WorkerLoad(kv_usage=0.25))
    assert (await index.lookup(ch)).matches["B"].load.kv_usage == 0.25


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
    assert raw.strlen(f"{{{index.tag}}}r:{a}") <= 16 * (1024 + 1000)
    keep = chain_of(200, 50)
    await index.apply(stored(a, seq + 1, keep))
    assert depths(await index.lookup(keep)) == {"A": (50, 50)}
    await index.deregister(a)
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
        assert set(blocks) == set(ch)  # only A's blocks are left; B-only blocks are gone
        assert set(blocks.values()) == {a.to_bytes(2, "big")}
        assert await idx.gc() == 0

        # B comes back: it gets a fresh registration (its old id is free again) and no
        # stale entries, and its old batches are no longer accepted.
        assert not await idx.heartbeat(b, 1, WorkerLoad())
        assert await idx.apply(stored(b, 2, ch)) is ResultCode.RESYNC_NEEDED
        b2 = await register(idx, "B")
        assert b2 == b
        assert depths(await idx.lookup(ch)) == {"A": (6, 6), "B": (0, 0)}
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
        assert depths(await idx.lookup(ch)) == {"A": (3, 3), "B": (0, 0)}
        raw = redis.Redis.from_url(redis_server.url)
        assert raw.keys("{" + idx.tag + "}q*") == []
        # A hole in the confirmed blocks bridged by a prediction: predicted depth runs on.
        await idx.apply(stored(a, 2, ch[5:8]))
        assert depths(await idx.lookup(ch)) == {"A": (3, 3), "B": (0, 0)}
        await idx.predict(ch[3:5], a)
        assert depths(await idx.lookup(ch)) == {"A": (3, 8), "B": (0, 0)}
    finally:
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
            assert set((await idx.lookup(chain_of(17, 4))).matches) == {"A"}
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


@pytest.mark.cluster
@pytest.mark.skipif(shutil.which("redis-cli") is None, reason="needs redis-cli to form a cluster")
async def test_redis_cluster_via_url() -> None:
    # an explicit bus port: the default (port + 10000) may be taken or past 65535
    nodes = [LocalRedis(extra_args=["--cluster-enabled", "yes", "--cluster-port", str(free_port())])
             for _ in range(3)]
    try:
        for node in nodes:
            node.start()
        subprocess.run(["redis-cli", "--cluster", "create",
                        *[f"127.0.0.1:{n.port}" for n in nodes],
                        "--cluster-replicas", "0", "--cluster-yes"],
                       check=True, capture_output=True, timeout=30)
        raws = [redis.Redis.from_url(n.url) for n in nodes]
        deadline = time.monotonic() + 15
        while not all(b"cluster_state:ok" in r.execute_command("CLUSTER", "INFO") for r in raws):
            assert time.monotonic() < deadline, "cluster did not converge"
            await asyncio.sleep(0.1)

        idx = RedisPrefixIndex(nodes[0].url + "?cluster=true", model_name(), deadline_s=2.0)
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
    finally:
        for node in nodes:
            node.close()


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
    codes = (files("router") / "lua" / "_codes.lua").read_text()
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
    with pytest.raises(ValueError):
        source("../index")
