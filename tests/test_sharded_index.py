"""One model's index over K worker groups (``IndexSettings.shards``), on a real Redis."""

from __future__ import annotations

import os
import signal
import uuid

import pytest
import redis

from prefixserve.cluster.local_redis import LocalRedis
from prefixserve.router.blocks import hash_chain, namespace
from prefixserve.router.decision import LookupSource, RoutingCore
from prefixserve.router.decision_types import Candidate
from prefixserve.router.events import BlockStored, EventBatch, WorkerLoad
from prefixserve.router.index import (
    INDEX_KEY_BYTES,
    IndexSettings,
    IndexSize,
    IndexUnavailable,
    ResultCode,
    WorkerInfo,
)
from prefixserve.router.index_stores import open_index
from prefixserve.router.redis_index import RedisPrefixIndex
from prefixserve.router.redis_records import key_tag
from prefixserve.router.request import Expected
from prefixserve.router.router_settings import RouterSettings
from prefixserve.router.router_state import RouterState
from prefixserve.router.sharded_index import GROUP_SPAN, ShardedPrefixIndex, group_name, groups_of

SHARDS = 3
NS = namespace("sharded")
pytestmark = pytest.mark.cluster


def chain_of(seed: int, n: int) -> list[bytes]:
    return hash_chain([seed * 1000 + i for i in range(n * 4)], block_size=4, ns=NS)


def depths(result) -> dict[str, tuple[int, int]]:
    return {rid: (m.confirmed_depth, m.predicted_depth) for rid, m in result.matches.items()}


def one_per_group(shards: int = SHARDS) -> list[str]:
    """A replica id for each group, in group order."""
    found: dict[int, str] = {}
    i = 0
    while len(found) < shards:
        found.setdefault(groups_of(f"R{i}", shards)[0], f"R{i}")
        i += 1
    return [found[g] for g in range(shards)]


@pytest.fixture
async def index(redis_server: LocalRedis):
    idx = open_index(redis_server.url, "s" + uuid.uuid4().hex[:7], deadline_s=1.0,
                     settings=IndexSettings(shards=SHARDS, lease_ttl_s=5.0, predict_ttl_s=5.0))
    assert isinstance(idx, ShardedPrefixIndex)
    yield idx
    await idx.close()


async def register(idx, rid: str, epoch: int = 1) -> int:
    return await idx.register(rid, epoch=epoch, block_size=4, fingerprint="fp", node="n0")


def tag_keys(url: str, model: str, group: int) -> list[bytes]:
    return redis.Redis.from_url(url).keys("{" + key_tag(group_name(model, group)) + "}*")


async def test_workers_write_to_their_group_and_lookups_merge_every_group(
    index: ShardedPrefixIndex, redis_server: LocalRedis
) -> None:
    names = one_per_group()
    ids = [await register(index, rid) for rid in names]
    assert [divmod(w, GROUP_SPAN) for w in ids] == [(g, 1) for g in range(SHARDS)]
    assert await register(index, names[2]) == ids[2]  # idempotent, in the same group
    ch = chain_of(1, 8)
    for w, n in zip(ids, (8, 5, 2), strict=True):
        assert await index.apply(EventBatch(w, 1, 1, (BlockStored(tuple(ch[:n])),))) \
            is ResultCode.OK
    for g in range(SHARDS):  # each group's keys hold only its own worker's blocks
        assert any(k.endswith(b"B") for k in tag_keys(redis_server.url, index.model, g))
    # the groups' sizes add up: a block held in two groups counts in each
    assert await index.size() == IndexSize(15, 15, 15 * INDEX_KEY_BYTES)
    assert await index.heartbeat(ids[1], 1, WorkerLoad(num_running=4))

    result = await index.lookup(ch)
    assert depths(result) == {names[0]: (8, 8), names[1]: (5, 5), names[2]: (2, 2)}
    assert {k: m.worker_id for k, m in result.matches.items()} == dict(zip(names, ids,
                                                                          strict=True))
    assert result.blocks_walked == 8
    assert result.worker_ids == dict(zip(names, ids, strict=True))
    assert result.loads == {names[1]: WorkerLoad(num_running=4)}
    assert result.matches[names[1]].load == WorkerLoad(num_running=4)
    again = await index.lookup(ch)  # nothing changed: the merged mappings are reused
    assert again.loads is result.loads and again.worker_ids is result.worker_ids
    assert await index.heartbeat(ids[2], 1, WorkerLoad(kv_usage=0.5))
    assert (await index.lookup(ch)).loads[names[2]] == WorkerLoad(kv_usage=0.5)

    assert sorted((w.worker_id, w.replica_id) for w in await index.live_workers()) == \
        sorted(zip(ids, names, strict=True))


async def test_predictions_resync_and_removal_go_to_the_workers_group(
    index: ShardedPrefixIndex, redis_server: LocalRedis
) -> None:
    names = one_per_group()
    ids = [await register(index, rid) for rid in names]
    ch = chain_of(2, 6)
    await index.resync(ids[0], 1, ch[:3], seq=0)
    await index.predict(ch, ids[2], from_block=0)
    assert depths(await index.lookup(ch)) == {names[0]: (3, 3), names[2]: (0, 6)}
    predicted = [k for k in tag_keys(redis_server.url, index.model, 2) if b"}q" in k]
    assert len(predicted) == 6  # written under the predicted worker's group only
    assert not [k for g in (0, 1) for k in tag_keys(redis_server.url, index.model, g)
                if b"}q" in k]
    await index.deregister(ids[0])
    assert depths(await index.lookup(ch)) == {names[2]: (0, 6)}
    assert {w.replica_id for w in await index.live_workers()} == set(names[1:])
    assert await index.gc() == 0  # deregister removed its entries at once
    with pytest.raises(ValueError, match="names no group"):
        await index.heartbeat(SHARDS * GROUP_SPAN + 1, 1, WorkerLoad())


def test_candidate_groups_are_stable_distinct_and_spread() -> None:
    pairs = [groups_of(f"replica-{i}", 4) for i in range(400)]
    assert pairs == [groups_of(f"replica-{i}", 4) for i in range(400)]
    assert all(a != b and {a, b} <= {0, 1, 2, 3} for a, b in pairs)
    for g in range(4):
        assert 60 < [a for a, _ in pairs].count(g) < 140
        assert 60 < [b for _, b in pairs].count(g) < 140
    assert groups_of("replica-0", 1) == (0, 0)
    assert len({key_tag(group_name("m", g)) for g in range(4)}) == 4  # a key prefix each


async def test_a_replica_registers_in_the_emptier_of_its_two_groups(
    redis_server: LocalRedis
) -> None:
    """60 replicas over 3 groups land 20 a group, where their first choices alone would not;
    a live replica registering again stays in its group, and when one of its groups fails to
    answer it registers in the other."""
    names = [f"replica-{i}" for i in range(60)]
    first = [groups_of(n, 3)[0] for n in names]
    assert sorted(first.count(g) for g in range(3)) != [20, 20, 20]  # one hashed choice
    model = "b" + uuid.uuid4().hex[:7]
    settings = IndexSettings(shards=3, lease_ttl_s=30.0, shard_backoff_s=30.0)
    with LocalRedis() as other:
        def open_store(name: str) -> RedisPrefixIndex:
            url = other.url if name == group_name(model, 2) else redis_server.url
            return RedisPrefixIndex(url, name, deadline_s=0.5, settings=settings)

        index = ShardedPrefixIndex(model, settings, open_store)
        try:
            ids = [await register(index, n) for n in names]
            groups = [w // GROUP_SPAN for w in ids]
            assert sorted(groups.count(g) for g in range(3)) == [20, 20, 20]
            assert all(g in groups_of(n, 3) for n, g in zip(names, groups, strict=True))
            # a new incarnation of a live replica finds its group and its id there
            moved = next(i for i, n in enumerate(names) if groups[i] != first[i])
            assert await register(index, names[moved], epoch=2) == ids[moved]
            # group 2's shard is down: a new replica whose candidates include it goes to the other
            other.stop()
            late = next(f"late-{i}" for i in range(100) if 2 in groups_of(f"late-{i}", 3))
            (rest,) = set(groups_of(late, 3)) - {2}
            assert (await register(index, late)) // GROUP_SPAN == rest
        finally:
            await index.close()


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_a_slow_group_leaves_its_part_unknown_until_its_backoff_ends(
    redis_server: LocalRedis
) -> None:
    names = one_per_group()
    model = "s" + uuid.uuid4().hex[:7]
    settings = IndexSettings(shards=SHARDS, lease_ttl_s=30.0, shard_backoff_s=1.0)
    with LocalRedis() as slow:
        def open_store(name: str) -> RedisPrefixIndex:
            url = slow.url if name == group_name(model, 1) else redis_server.url
            return RedisPrefixIndex(url, name, deadline_s=0.3, settings=settings)

        clock = Clock()
        index = ShardedPrefixIndex(model, settings, open_store, clock)
        try:
            ids = [await register(index, rid) for rid in names]
            tokens = list(range(6 * 16 + 1))
            ch = hash_chain(tokens, 16, namespace("fp"))
            for w, n in zip(ids, (6, 4, 2), strict=True):
                await index.apply(EventBatch(w, 1, 1, (BlockStored(tuple(ch[:n])),)))
            await index.heartbeat(ids[1], 1, WorkerLoad(num_running=3))
            full = await index.lookup(ch)
            assert depths(full) == {names[0]: (6, 6), names[1]: (4, 4), names[2]: (2, 2)}
            assert (full.unknown, full.unknown_shards) == (frozenset(), 0)

            os.kill(slow._proc.pid, signal.SIGSTOP)  # group 1's shard stops answering
            try:
                part = await index.lookup(ch)
                assert depths(part) == {names[0]: (6, 6), names[2]: (2, 2)}
                assert (part.unknown, part.unknown_shards) == ({names[1]}, 1)
                # its workers as last known: still candidates, on their last loads
                assert part.loads[names[1]] == WorkerLoad(num_running=3)
                assert part.worker_ids[names[1]] == ids[1]
                assert index.backing_off() == [1]
                # a decision over the partial answer: ranked, counted, and what travels to a
                # worker of the unknown shard says why its depth may be off
                state = RouterState(RouterSettings(fingerprint="fp", block_size=16))
                state.gate.check_workers([WorkerInfo(1, names[0], 1, 16, "fp", "")], [], 0.0)
                core = RoutingCore(state, LookupSource(state, index, None, deadline_s=0.3))
                decision = await core.decide(
                    1, tokens, None, [Candidate(n) for n in names], "r1", now=0.0)
                assert decision.best == names[0]
                assert [(a.source, a.failopen, a.unknown_shards) for a in decision.lookups] \
                    == [("index", None, 1)]
                assert state.expected(1, names[0]) == Expected(6, None)
                assert state.expected(1, names[1]) == Expected(0, "partial")
                assert state.expected(1, names[2]) == Expected(2, "serve")
                # the other groups still answer the rest of the index's calls
                assert {w.replica_id for w in await index.live_workers()} == {names[0], names[2]}
                assert await index.gc() == 0
            finally:
                os.kill(slow._proc.pid, signal.SIGCONT)
            # answering again, but not asked until its backoff ends
            assert (await index.lookup(ch)).unknown == {names[1]}
            clock.now = 1.0
            assert index.backing_off() == []
            back = await index.lookup(ch)
            assert depths(back) == depths(full) and back.unknown_shards == 0
        finally:
            await index.close()


async def test_a_lookup_fails_only_when_no_group_answers() -> None:
    settings = IndexSettings(shards=2, shard_backoff_s=1.0)
    with LocalRedis() as server:
        clock = Clock()
        index = ShardedPrefixIndex(
            "down", settings,
            lambda name: RedisPrefixIndex(server.url, name, deadline_s=0.3, settings=settings),
            clock)
        try:
            wid = await register(index, "R0")
            server.stop()
            with pytest.raises(IndexUnavailable):
                await index.lookup(chain_of(4, 2))
            assert index.backing_off() == [0, 1]
            with pytest.raises(IndexUnavailable, match=r"every shard .* is backing off"):
                await index.lookup(chain_of(4, 2))
            with pytest.raises(IndexUnavailable):  # no group to take it
                await index.heartbeat(wid, 1, WorkerLoad())
        finally:
            await index.close()
