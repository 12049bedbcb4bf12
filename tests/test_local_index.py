"""The router-local index: confirmed depths from KV events, against a plain reference walk and
against the Redis index fed the same events."""

from __future__ import annotations

import random
import uuid

import pytest
from fleetkit import Fleet, digests, reference, reference_lower

from prefixserve.cluster.local_redis import LocalRedis
from prefixserve.router.blocks import Chain
from prefixserve.router.events import (
    DISK,
    HOST,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
)
from prefixserve.router.index import IndexSettings, ResultCode
from prefixserve.router.local_index import LocalIndex, PredictedBlocks
from prefixserve.router.redis_index import RedisPrefixIndex


@pytest.fixture(params=["delta", "always-merged"])
def make(request: pytest.FixtureRequest):
    """A LocalIndex holding its changes in the delta, or merging them at once (packed)."""
    def new() -> LocalIndex:
        index = LocalIndex()
        if request.param == "always-merged":
            index.MERGE_MIN, index.MERGE_SHARE = 0, 0.0
        return index
    return new


@pytest.mark.parametrize("merge_min", [LocalIndex.MERGE_MIN, 8, 0], ids=["delta", "merging",
                                                                          "always-merged"])
@pytest.mark.parametrize("seed", range(6))
def test_depths_equal_a_block_by_block_walk(seed: int, merge_min: int) -> None:
    """Whether the changes sit in the delta, are merged into the packed base now and then, or
    after every store."""
    rng = random.Random(seed)
    fleet, index = Fleet(rng, workers=9, chains=4, length=300), LocalIndex()
    index.MERGE_MIN, index.MERGE_SHARE = merge_min, 0.0 if merge_min == 0 else 0.05
    for _ in range(1500):
        worker, events = fleet.step()
        index.apply(worker, events)
        query = fleet.query()
        assert index.depths(Chain.of(query)) == reference(fleet.held, query)
    assert len(index) == sum(len(held) for held in fleet.held.values())
    if merge_min == 0:
        assert index.nbytes == 10 * len(index)  # every entry packed: 8 + 2 bytes


@pytest.mark.parametrize("merge", [False, True])
def test_many_workers_at_one_depth_are_settled_together(merge: bool) -> None:
    """A system prompt everyone holds: groups of more than 16 workers at one depth, beside a
    few workers at depths of their own."""
    rng = random.Random(3)
    chain = digests(rng, 40)
    depth = {w: 10 if w <= 60 else 25 if w <= 100 else 40 if w <= 130 else w - 130
             for w in range(1, 136)}
    index = LocalIndex()
    for worker in rng.sample(list(depth), len(depth)):
        index.apply(worker, [BlockStored(tuple(chain[: depth[worker]]))])
    if merge:
        index._merge()
    assert index.depths(Chain.of(chain)) == depth
    assert index.depths(Chain.of(chain[:20])) == {w: min(d, 20) for w, d in depth.items()}


def test_a_cleared_worker_keeps_nothing_and_the_others_keep_theirs(make) -> None:
    rng = random.Random(1)
    chain = digests(rng, 40)
    index = make()
    index.apply(7, [BlockStored(tuple(chain))])
    index.apply(9, [BlockStored(tuple(chain[:25]))])
    assert index.depths(Chain.of(chain)) == {7: 40, 9: 25}
    index.apply(7, [AllBlocksCleared()])
    assert index.depths(Chain.of(chain)) == {9: 25}
    index.apply(9, [BlockRemoved(tuple(chain[10:25]))])
    assert index.depths(Chain.of(chain)) == {9: 10}
    assert index.depths(Chain.of(chain[:1])) == {9: 1}
    assert index.depths(Chain()) == {}


def test_a_dropped_worker_s_slot_serves_the_next_without_its_blocks(make) -> None:
    rng = random.Random(2)
    a, b = digests(rng, 30), digests(rng, 30)
    index = make()
    index.apply(1, [BlockStored(tuple(a))])
    index.apply(2, [BlockStored(tuple(a[:12]))])
    index.drop(1)
    assert index.depths(Chain.of(a)) == {2: 12}
    index.apply(3, [BlockStored(tuple(b[:5]))])  # takes worker 1's freed slot
    assert index.depths(Chain.of(a)) == {2: 12}
    assert index.depths(Chain.of(b)) == {3: 5}
    index.apply(1, [BlockRemoved(tuple(a))])  # a dropped worker's late events change nothing
    index.drop(1)  # nor does dropping it again, or one never seen
    index.drop(8)
    assert index.depths(Chain.of(a)) == {2: 12} and index.depths(Chain.of(b)) == {3: 5}
    index.drop(2)  # the second slot
    assert index.depths(Chain.of(a)) == {} and index.depths(Chain.of(b)) == {3: 5}


def test_replace_states_a_worker_s_whole_set(make) -> None:
    rng = random.Random(3)
    a, b = digests(rng, 20), digests(rng, 20)
    index = make()
    index.apply(4, [BlockStored(tuple(a))])
    index.apply(5, [BlockStored(tuple(a[:3]))])
    index.replace(4, b[:8])
    assert index.depths(Chain.of(a)) == {5: 3}
    assert index.depths(Chain.of(b)) == {4: 8}


def test_blocks_are_known_by_their_first_eight_bytes_as_in_the_index(make) -> None:
    rng = random.Random(4)
    chain = digests(rng, 6)
    index = make()
    index.replace(1, [h[:8] for h in chain[:4]])  # a resync states keys, not digests
    index.apply(2, [BlockStored(tuple(chain[:2]))])
    assert index.depths(Chain.of(chain)) == {1: 4, 2: 2}
    twin = chain[0][:8] + bytes(8)  # another digest with the same key: the same block
    assert index.depths(Chain.of([twin])) == {1: 1, 2: 1}
    index.apply(2, [BlockRemoved((chain[1][:8] + b"-" * 8,))])
    assert index.depths(Chain.of(chain)) == {1: 4, 2: 1}


def test_predictions_carry_a_worker_past_its_confirmed_depth_until_they_expire() -> None:
    rng = random.Random(5)
    chain = digests(rng, 20)
    predicted = PredictedBlocks()
    predicted.add(3, chain[:4], until=10.0)  # from block 0: where it holds 2, the walk starts there
    predicted.add(1, chain[5:12], until=10.0)  # past its 5 confirmed blocks
    predicted.add(2, chain[:3], until=20.0)  # from block 0
    predicted.add(4, chain[7:8], until=10.0)  # one block past its 7
    whole = Chain.of(chain)
    assert predicted.depths(whole, {1: 5, 3: 2, 4: 7}, now=0.5) == {1: 12, 2: 3, 3: 4, 4: 8}
    assert predicted.depths(Chain.of(chain[:9]), {1: 5}, now=1.0) == {1: 9, 2: 3, 3: 4}
    assert predicted.depths(whole, {1: 5, 2: 3}, now=1.0) == {1: 12, 3: 4}  # nothing past 3
    assert predicted.depths(whole, {}, now=1.0) == {2: 3, 3: 4}
    assert len(predicted) == 11
    predicted.add(2, chain[:3], until=30.0)  # renewed: its first expiry leaves it be
    assert predicted.depths(whole, {}, now=10.0) == {2: 3}  # expiring at 10: gone at 10
    assert len(predicted) == 4  # worker 4's block waits in memory behind worker 2's expiry
    assert predicted.depths(whole, {}, now=20.0) == {2: 3}
    assert len(predicted) == 3
    assert predicted.depths(whole, {}, now=30.0) == {} and len(predicted) == 0


def test_a_prediction_queued_behind_a_later_expiry_still_expires_on_time() -> None:
    rng = random.Random(6)
    chain = digests(rng, 6)
    predicted = PredictedBlocks()
    predicted.add(1, chain[:4], until=30.0)
    predicted.add(2, chain[:2], until=10.0)  # arrived later, expires sooner (a shorter TTL)
    predicted.add(2, chain[4:6], until=10.0)
    predicted.add(1, chain[4:5], until=10.0)
    assert predicted.depths(Chain.of(chain), {2: 4}, now=9.0) == {1: 5, 2: 6}
    assert predicted.depths(Chain.of(chain), {2: 4}, now=10.0) == {1: 4}
    assert predicted.depths(Chain.of(chain), {}, now=10.0) == {1: 4}


@pytest.mark.cluster
async def test_depths_equal_the_redis_index_fed_the_same_events(redis_server: LocalRedis,
                                                                make) -> None:
    rng = random.Random(11)
    fleet, local = Fleet(rng, workers=6, chains=3, length=200), make()
    redis_index = RedisPrefixIndex(redis_server.url, f"local-{uuid.uuid4().hex[:8]}",
                                   deadline_s=2.0, settings=IndexSettings(lease_ttl_s=600))
    try:
        ids = {w: await redis_index.register(f"W{w}", epoch=1, block_size=16, fingerprint="fp")
               for w in fleet.held}
        seq = dict.fromkeys(ids.values(), 0)
        for step in range(600):
            worker, events = fleet.step()
            wid = ids[worker]
            if events:
                seq[wid] += 1
                batch = EventBatch(wid, 1, seq[wid], tuple(events))
                assert await redis_index.apply(batch) is ResultCode.OK
                local.apply(wid, events)
            if step % 5 == 0:
                query = fleet.query()
                result = await redis_index.lookup(query)
                want = {m.worker_id: m.confirmed_depth for m in result.matches.values()}
                assert local.depths(Chain.of(query)) == want
    finally:
        await redis_index.close()


def test_a_block_held_by_many_workers_and_keys_near_each_other(make) -> None:
    """Forty workers hold one chain to forty depths (a holder run past the small-run path), and
    two blocks whose keys differ in their lowest bits only stay two blocks once packed."""
    rng = random.Random(6)
    chain = digests(rng, 40)
    index = make()
    for worker in range(1, 41):
        index.apply(worker, [BlockStored(tuple(chain[:worker]))])
    assert index.depths(Chain.of(chain)) == {w: w for w in range(1, 41)}
    index.apply(40, [BlockRemoved(tuple(chain[20:]))])
    assert index.depths(Chain.of(chain))[40] == 20
    assert len(index) == sum(range(1, 41)) - 20
    near = [bytes([i]) + chain[0][1:] for i in range(3)]  # keys 0, 1, 2 apart
    index.apply(50, [BlockStored((near[0],))])
    index.apply(51, [BlockStored((near[1],))])
    assert index.depths(Chain.of(near[:1])) == {50: 1}
    assert index.depths(Chain.of(near[1:2])) == {51: 1}
    assert index.depths(Chain.of(near[2:])) == {}


def test_entries_count_what_the_base_and_the_delta_hold_together() -> None:
    rng = random.Random(7)
    chain = digests(rng, 30)
    index = LocalIndex()
    index.apply(1, [BlockStored(tuple(chain))])
    index.apply(2, [BlockStored(tuple(chain[:10]))])
    index._merge()
    assert (len(index), index.nbytes) == (40, 400)
    index.apply(1, [BlockRemoved(tuple(chain[25:]))])  # tombstones over the base
    index.apply(3, [BlockStored(tuple(chain[:4]))])  # new entries beside it
    assert len(index) == 40 - 5 + 4
    assert index.depths(Chain.of(chain)) == {1: 25, 2: 10, 3: 4}
    index.apply(1, [BlockStored(tuple(chain[25:27]))])  # stored again: the tombstones lift
    assert len(index) == 40 - 3 + 4 and index.depths(Chain.of(chain))[1] == 27
    index.drop(2)  # its base entries go without a merge
    assert len(index) == 40 - 3 + 4 - 10 and index.nbytes == 300
    index._merge()
    assert (len(index), index.nbytes) == (31, 310)
    assert index.depths(Chain.of(chain)) == {1: 27, 3: 4}


def test_a_worker_whose_first_block_is_below_its_pool_has_every_block_there(make) -> None:
    chain = digests(random.Random(11), 6)
    index = make()
    index.apply(1, [BlockStored(tuple(chain), HOST)])
    index.apply(2, [BlockStored(tuple(chain[:4]), DISK)])
    index.apply(3, [BlockStored(tuple(chain[:2]), HOST), BlockStored(tuple(chain[2:5]), DISK)])
    index.apply(4, [BlockStored(tuple(chain))])
    depths = index.depths(Chain.of(chain))
    assert depths == {1: 6, 2: 4, 3: 5, 4: 6}
    assert index.lower_blocks(Chain.of(chain), depths) == {1: (6, 0), 2: (0, 4), 3: (2, 3)}
    index.replace(1, chain)  # a resync states the pool's blocks: none below it now
    depths = index.depths(Chain.of(chain))
    assert depths == {1: 6, 2: 4, 3: 5, 4: 6}
    assert index.lower_blocks(Chain.of(chain), depths) == {2: (0, 4), 3: (2, 3)}


def test_a_removed_block_leaves_every_tier() -> None:
    chain = digests(random.Random(12), 10)
    index = LocalIndex()
    index.apply(1, [BlockStored(tuple(chain[:5])), BlockStored(tuple(chain[5:]), HOST)])
    index._merge()
    assert (len(index), index.nbytes) == (10, 150)  # every entry, and the host tier's 5 again
    index.apply(1, [BlockRemoved(tuple(chain))])
    index._merge()
    assert (len(index), index.nbytes) == (0, 0)
    assert index.lower_blocks(Chain.of(chain), {1: 10}) == {}


@pytest.mark.parametrize("merge_min", [LocalIndex.MERGE_MIN, 0], ids=["delta", "always-merged"])
@pytest.mark.parametrize("seed", range(4))
def test_blocks_below_the_pool_equal_a_block_by_block_walk(seed: int, merge_min: int) -> None:
    """With KV tiers: chains' tails move to host memory or disk and back; each worker's depth
    is every tier's, and its (host, disk) blocks are what the reference says."""
    rng = random.Random(100 + seed)
    fleet, index = Fleet(rng, workers=7, chains=4, length=120, tiers=True), LocalIndex()
    index.MERGE_MIN, index.MERGE_SHARE = merge_min, 0.0 if merge_min == 0 else 0.05
    lower_seen = 0
    for _ in range(1200):
        worker, events = fleet.step()
        index.apply(worker, events)
        query = fleet.query()
        depths = index.depths(Chain.of(query))
        assert depths == reference(fleet.held, query)
        lower = index.lower_blocks(Chain.of(query), depths)
        assert lower == reference_lower(fleet.held, fleet.medium, query)
        lower_seen += bool(lower)
    assert lower_seen > 20  # the walk did meet blocks below the pools
