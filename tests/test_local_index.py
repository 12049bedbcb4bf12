"""The router-local index: confirmed depths from KV events, against a plain reference walk and
against the Redis index fed the same events."""

from __future__ import annotations

import random

import pytest

from cluster.local_redis import LocalRedis
from router.blocks import DIGEST_BYTES, Chain
from router.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from router.index import IndexSettings, ResultCode
from router.local_index import LocalIndex
from router.redis_index import RedisPrefixIndex


def digests(rng: random.Random, n: int) -> list[bytes]:
    return [rng.randbytes(DIGEST_BYTES) for _ in range(n)]


def reference(held: dict[int, set[bytes]], chain: list[bytes]) -> dict[int, int]:
    """Each worker's consecutive run of ``chain`` from block 0, block by block."""
    out = {}
    for worker, blocks in held.items():
        depth = 0
        while depth < len(chain) and chain[depth] in blocks:
            depth += 1
        if depth:
            out[worker] = depth
    return out


class Fleet:
    """Workers caching prefixes of a few shared chains as an engine does: a block only after
    the ones before it, a chain's tail evicted first. Every change goes to the index under test
    as events and to ``held`` as sets."""

    def __init__(self, rng: random.Random, workers: int, chains: int, length: int) -> None:
        self.rng = rng
        self.chains = [digests(rng, length) for _ in range(chains)]
        # a chain's later blocks fork: some chains share their first blocks with chain 0
        for chain in self.chains[1:]:
            cut = rng.randrange(length)
            chain[:cut] = self.chains[0][:cut]
        self.held: dict[int, set[bytes]] = {w: set() for w in range(1, workers + 1)}
        self.depth = {(w, c): 0 for w in self.held for c in range(chains)}

    def step(self) -> tuple[int, list]:
        """One worker's random change: cache more of a chain, evict its tail, or clear all."""
        w = self.rng.choice(list(self.held))
        c = self.rng.randrange(len(self.chains))
        chain, depth, roll = self.chains[c], self.depth[w, c], self.rng.random()
        if roll < 0.05:
            self.held[w].clear()
            for key in self.depth:
                if key[0] == w:
                    self.depth[key] = 0
            return w, [AllBlocksCleared()]
        if roll < 0.65:
            new = min(len(chain), depth + self.rng.randint(1, 12))
            stored = tuple(chain[depth:new])
            self.held[w].update(stored)
            self.depth[w, c] = new
            return w, [BlockStored(stored)] if stored else []
        cut = self.rng.randint(0, depth)
        # a block another held chain of this worker still needs stays (shared prefixes)
        keep = {b for (ww, cc), d in self.depth.items() if ww == w and cc != c
                for b in self.chains[cc][:d]}
        removed = tuple(b for b in chain[cut:depth] if b not in keep)
        self.held[w].difference_update(removed)
        self.depth[w, c] = cut
        return w, [BlockRemoved(removed)] if removed else []

    def query(self) -> list[bytes]:
        chain = self.rng.choice(self.chains)
        return chain[: self.rng.randint(0, len(chain))]


@pytest.mark.parametrize("seed", range(6))
def test_depths_equal_a_block_by_block_walk(seed: int) -> None:
    rng = random.Random(seed)
    fleet, index = Fleet(rng, workers=9, chains=4, length=300), LocalIndex()
    for _ in range(1500):
        worker, events = fleet.step()
        index.apply(worker, events)
        query = fleet.query()
        assert index.depths(Chain.of(query)) == reference(fleet.held, query)


def test_a_cleared_worker_keeps_nothing_and_the_others_keep_theirs() -> None:
    rng = random.Random(1)
    chain = digests(rng, 40)
    index = LocalIndex()
    index.apply(7, [BlockStored(tuple(chain))])
    index.apply(9, [BlockStored(tuple(chain[:25]))])
    assert index.depths(Chain.of(chain)) == {7: 40, 9: 25}
    index.apply(7, [AllBlocksCleared()])
    assert index.depths(Chain.of(chain)) == {9: 25}
    index.apply(9, [BlockRemoved(tuple(chain[10:25]))])
    assert index.depths(Chain.of(chain)) == {9: 10}
    assert index.depths(Chain.of(chain[:1])) == {9: 1}
    assert index.depths(Chain()) == {}


def test_a_dropped_worker_s_slot_serves_the_next_without_its_blocks() -> None:
    rng = random.Random(2)
    a, b = digests(rng, 30), digests(rng, 30)
    index = LocalIndex()
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


def test_replace_states_a_worker_s_whole_set() -> None:
    rng = random.Random(3)
    a, b = digests(rng, 20), digests(rng, 20)
    index = LocalIndex()
    index.apply(4, [BlockStored(tuple(a))])
    index.apply(5, [BlockStored(tuple(a[:3]))])
    index.replace(4, b[:8])
    assert index.depths(Chain.of(a)) == {5: 3}
    assert index.depths(Chain.of(b)) == {4: 8}


@pytest.mark.cluster
async def test_depths_equal_the_redis_index_fed_the_same_events(redis_server: LocalRedis) -> None:
    rng = random.Random(11)
    fleet, local = Fleet(rng, workers=6, chains=3, length=200), LocalIndex()
    redis_index = RedisPrefixIndex(redis_server.url, f"local-{rng.getrandbits(32):08x}",
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
