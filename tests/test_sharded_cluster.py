"""One model's index over three worker groups on a real 3-shard Redis Cluster, started here:
each group on its own shard, every index operation per shard, and a shard that dies leaving
its part of the answers unknown while the others serve."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
import redis

from prefixserve.cluster.local_redis import LocalRedisCluster
from prefixserve.router.blocks import Chain, hash_chain, namespace
from prefixserve.router.events import BlockRemoved, BlockStored, EventBatch, WorkerLoad
from prefixserve.router.index import IndexSettings, ResultCode
from prefixserve.router.index_follower import IndexFollower, event_logs
from prefixserve.router.index_stores import open_index
from prefixserve.router.redis_records import key_tag
from prefixserve.router.sharded_index import GROUP_SPAN, ShardedPrefixIndex, group_name, groups_of

SHARDS = 3
NS = namespace("sharded-cluster")
pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def redis_cluster() -> Iterator[LocalRedisCluster]:
    with LocalRedisCluster(SHARDS) as cluster:
        yield cluster


def model_on_every_shard(cluster: LocalRedisCluster, stem: str) -> str:
    """A model name whose groups' key prefixes land on the shards in group order."""
    for k in itertools.count():
        name = f"{stem}{k}"
        shards = [cluster.shard_of("{" + key_tag(group_name(name, g)) + "}")
                  for g in range(SHARDS)]
        if shards == list(range(SHARDS)):
            return name
    raise AssertionError


def one_per_group() -> list[str]:
    found: dict[int, str] = {}
    for i in itertools.count():
        found.setdefault(groups_of(f"R{i}", SHARDS)[0], f"R{i}")
        if len(found) == SHARDS:
            return [found[g] for g in range(SHARDS)]
    raise AssertionError


def chain_of(seed: int, n: int) -> list[bytes]:
    return hash_chain([seed * 1000 + i for i in range(n * 4)], block_size=4, ns=NS)


def depths(result) -> dict[str, tuple[int, int]]:
    return {rid: (m.confirmed_depth, m.predicted_depth) for rid, m in result.matches.items()}


def open_sharded(cluster: LocalRedisCluster, model: str) -> ShardedPrefixIndex:
    index = open_index(cluster.url, model, deadline_s=1.0,
                       settings=IndexSettings(shards=SHARDS, lease_ttl_s=30.0))
    assert isinstance(index, ShardedPrefixIndex)
    return index


async def register(index: ShardedPrefixIndex, rid: str) -> int:
    return await index.register(rid, epoch=1, block_size=4, fingerprint="fp", node="n0")


async def test_every_operation_and_the_followers_work_per_shard(
    redis_cluster: LocalRedisCluster,
) -> None:
    model = model_on_every_shard(redis_cluster, "all")
    index = open_sharded(redis_cluster, model)
    follower = IndexFollower(index, event_logs(index), log_entries=10_000)
    try:
        await follower.catch_up()  # follows from before any event: every one is logged
        names = one_per_group()
        ids = [await register(index, rid) for rid in names]
        assert [w // GROUP_SPAN for w in ids] == [0, 1, 2]
        ch = chain_of(1, 8)
        assert await index.apply(EventBatch(ids[0], 1, 1, (BlockStored(tuple(ch)),))) \
            is ResultCode.OK
        assert await index.apply(EventBatch(ids[1], 1, 1, (
            BlockStored(tuple(ch[:6])), BlockRemoved(tuple(ch[4:6]))))) is ResultCode.OK
        await index.resync(ids[2], 1, ch[:2], seq=1)
        await index.predict(ch, ids[2], from_block=2)
        for g, shard in enumerate(redis_cluster.servers):  # each group's keys on its shard
            with redis.Redis(port=shard.port) as raw:
                assert raw.keys("{" + key_tag(group_name(model, g)) + "}*")
        expected = {names[0]: (8, 8), names[1]: (4, 4), names[2]: (2, 8)}
        assert depths(await index.lookup(ch)) == expected
        await follower.catch_up()  # one cursor per shard's log
        assert depths(follower.lookup(Chain.of(ch))) == expected
        await index.deregister(ids[0])
        await follower.catch_up()
        assert depths(await index.lookup(ch)) == depths(follower.lookup(Chain.of(ch))) == {
            names[1]: (4, 4), names[2]: (2, 8)}
        assert await index.gc() == 0  # deregister collected its entries
    finally:
        await index.close()


async def test_a_dead_shard_leaves_its_part_unknown_and_the_rest_serves(
    redis_cluster: LocalRedisCluster,
) -> None:
    """Last in this module: it kills a shard."""
    model = model_on_every_shard(redis_cluster, "dead")
    index = open_sharded(redis_cluster, model)
    try:
        names = one_per_group()
        ids = [await register(index, rid) for rid in names]
        ch = chain_of(2, 6)
        for w, n in zip(ids, (6, 4, 2), strict=True):
            await index.apply(EventBatch(w, 1, 1, (BlockStored(tuple(ch[:n])),)))
        assert depths(await index.lookup(ch)) == {
            names[0]: (6, 6), names[1]: (4, 4), names[2]: (2, 2)}

        redis_cluster.servers[1].stop()  # group 1's shard dies
        part = await index.lookup(ch)
        assert depths(part) == {names[0]: (6, 6), names[2]: (2, 2)}
        assert (part.unknown, part.unknown_shards) == ({names[1]}, 1)
        assert set(part.worker_ids) == set(names)  # its worker is still a candidate
        # the other shards keep taking events, heartbeats and their own collection
        assert await index.apply(EventBatch(ids[2], 1, 2, (BlockStored(tuple(ch[2:5])),))) \
            is ResultCode.OK
        assert await index.heartbeat(ids[0], 1, WorkerLoad(num_running=1))
        assert {w.replica_id for w in await index.live_workers()} == {names[0], names[2]}
        assert await index.gc() == 0
        again = await index.lookup(ch)  # backing off: not asked, still unknown
        assert depths(again) == {names[0]: (6, 6), names[2]: (5, 5)}
        assert again.unknown == {names[1]}
    finally:
        await index.close()
