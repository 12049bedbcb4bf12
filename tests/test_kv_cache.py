"""Block-pool invariants: ref counts, free-list order, LRU tail-first eviction, CoW, events."""

from __future__ import annotations

import pytest

from prefixserve.router.blocks import BlockHasher, hash_chain, namespace
from prefixserve.router.events import AllBlocksCleared, BlockRemoved, BlockStored
from prefixserve.workers.kv_cache import BlockPool, KVCacheManager

BS = 4
NS = namespace("fp")


def chain(tokens: list[int], ns: bytes = NS) -> list[bytes]:
    return hash_chain(tokens, BS, ns)


def free_ids(kv: KVCacheManager) -> list[int]:
    return [b.block_id for b in kv.pool.free]


def check_invariants(kv: KVCacheManager) -> None:
    pool = kv.pool
    free = list(pool.free)
    assert len(free) == pool.num_free
    assert all(b.ref_cnt == 0 for b in free)
    used = [b for b in pool.blocks if b.ref_cnt > 0]
    assert len(free) + len(used) == pool.num_blocks
    refs: dict[int, int] = {}
    for table in kv.tables.values():
        for b in table:
            refs[b.block_id] = refs.get(b.block_id, 0) + 1
    assert {b.block_id: b.ref_cnt for b in used} == refs
    for h, b in pool.cached.items():
        assert b.block_hash == h
    assert sum(b.block_hash is not None for b in pool.blocks) == len(pool.cached)
    # unhashed free blocks all come before hashed ones
    kinds = [b.block_hash is not None for b in free]
    assert kinds == sorted(kinds)
    # the empty-room count the router weighs evictions by
    assert pool.num_cached_free == sum(kinds)
    assert kv.num_empty_blocks == len(free) - sum(kinds)


def admit(kv: KVCacheManager, seq_id: str, tokens: list[int], ns: bytes = NS) -> int:
    """Admit a whole prompt; return the number of cached tokens reused."""
    hashes = chain(tokens, ns)
    hits = kv.computed_blocks(hashes, len(tokens))
    done = len(hits) * BS
    assert kv.allocate_slots(seq_id, done, len(tokens) - done, hashes, hits)
    return done


def test_allocation_order_and_refcounts() -> None:
    kv = KVCacheManager(8, BS)
    assert free_ids(kv) == list(range(8))
    assert admit(kv, "a", list(range(10))) == 0  # 3 blocks, 2 full
    assert kv.block_ids("a") == [0, 1, 2]
    assert [kv.pool.blocks[i].ref_cnt for i in range(3)] == [1, 1, 1]
    assert len(kv.pool.cached) == 2
    check_invariants(kv)
    kv.free("a")
    # partial block 2 (unhashed) goes to the front; the chain follows tail first
    assert free_ids(kv) == [2, 3, 4, 5, 6, 7, 1, 0]
    check_invariants(kv)


def test_prefix_hit_shares_blocks_and_caps_last_token() -> None:
    kv = KVCacheManager(16, BS)
    prompt = list(range(8))  # exactly two full blocks
    admit(kv, "a", prompt)
    # the same prompt: the last token must be recomputed, so only block 0 is a hit
    assert admit(kv, "b", prompt) == 4
    assert kv.block_ids("b")[0] == kv.block_ids("a")[0]
    assert kv.pool.blocks[kv.block_ids("a")[0]].ref_cnt == 2
    # a longer prompt hits both blocks
    assert admit(kv, "c", [*prompt, 99]) == 8
    check_invariants(kv)
    for s in ("a", "b", "c"):
        kv.free(s)
    check_invariants(kv)
    assert kv.num_free_blocks == 16


def test_salt_isolates_tenants() -> None:
    kv = KVCacheManager(16, BS)
    prompt = list(range(9))
    admit(kv, "a", prompt, namespace("fp", "tenant-a"))
    assert admit(kv, "b", prompt, namespace("fp", "tenant-b")) == 0
    assert admit(kv, "c", prompt, namespace("fp", "tenant-a")) == 8
    ids_a, ids_b = set(kv.block_ids("a")), set(kv.block_ids("b"))
    assert not ids_a & ids_b
    check_invariants(kv)


def test_lru_eviction_tail_first_and_cached_blocks_reusable() -> None:
    kv = KVCacheManager(6, BS)
    admit(kv, "a", list(range(12)))  # blocks 0,1,2 all full, hashed
    admit(kv, "b", list(range(100, 108)))  # blocks 3,4
    kv.free("a")
    kv.free("b")
    # LRU: a freed first (tail first: 2,1,0), then b (4,3); block 5 never used sits in front
    assert free_ids(kv) == [5, 2, 1, 0, 4, 3]
    kv.pool.take_events()
    # a new unrelated prompt needing 3 blocks takes 5, then evicts a's tail (2) then 1; its
    # table holds them in ascending order, so that its K/V run forwards through memory
    admit(kv, "c", list(range(200, 212)))
    assert kv.block_ids("c") == [1, 2, 5]
    a = chain(list(range(12)))
    assert kv.pool.take_events()[0] == BlockRemoved((a[2], a[1]))
    # a's head survives and is still a hit
    assert admit(kv, "d", [0, 1, 2, 3, 77]) == 4
    assert kv.block_ids("d")[0] == 0
    check_invariants(kv)


def test_hit_on_free_block_counts_against_free_space() -> None:
    kv = KVCacheManager(3, BS)
    admit(kv, "a", list(range(8)))
    kv.free("a")
    # 13 tokens: hits on blocks 0 and 1 (free, cached) + 2 new blocks, but only 1 is left
    hashes = chain(list(range(12)))
    hits = kv.computed_blocks(hashes, 13)
    assert len(hits) == 2
    assert not kv.allocate_slots("b", 8, 5, hashes, hits)
    assert "b" not in kv.tables
    check_invariants(kv)
    # 12 tokens: the same two hits + 1 new block fits exactly
    hits = kv.computed_blocks(hashes, 12)
    assert kv.allocate_slots("b", 8, 4, hashes, hits)
    assert kv.num_free_blocks == 0
    check_invariants(kv)


def test_copy_on_write_for_forks() -> None:
    kv = KVCacheManager(8, BS)
    prompt = list(range(6))  # one full block + a partial one
    admit(kv, "p", prompt)
    kv.fork("p", "q")
    assert kv.block_ids("p") == kv.block_ids("q") == [0, 1]
    assert [kv.pool.blocks[i].ref_cnt for i in (0, 1)] == [2, 2]
    # p writes token 6 into the shared partial block 1: it gets a copy
    assert kv.allocate_slots("p", 6, 1, chain([*prompt, 7]))
    assert kv.take_copies() == [(1, 2)]
    assert kv.block_ids("p") == [0, 2]
    # q now owns block 1 alone: no copy
    assert kv.allocate_slots("q", 6, 1, chain([*prompt, 8]))
    assert kv.take_copies() == []
    assert kv.block_ids("q") == [0, 1]
    check_invariants(kv)
    kv.free("p")
    kv.free("q")
    assert kv.num_free_blocks == 8
    check_invariants(kv)


def test_exact_event_stream() -> None:
    kv = KVCacheManager(4, BS)
    a = chain(list(range(9)))
    admit(kv, "a", list(range(9)))  # blocks 0,1 hashed, 2 partial
    assert kv.take_events() == [BlockStored((a[0], a[1]))]
    assert kv.take_events() == []
    # decode fills block 2 → registered with its parent
    hasher = BlockHasher(BS, NS)
    hasher.append(list(range(12)))
    assert kv.allocate_slots("a", 11, 1, hasher.hashes)
    assert kv.take_events() == [BlockStored((hasher.hashes[2],))]
    kv.free("a")
    b = chain(list(range(50, 62)))
    admit(kv, "b", list(range(50, 62)))  # needs 3: free 3, then evicts a's tail 2, 1
    assert kv.take_events() == [
        BlockRemoved((hasher.hashes[2], a[1])),
        BlockStored(tuple(b)),
    ]
    kv.reset_prefix_cache()
    assert kv.take_events() == [AllBlocksCleared()]
    assert kv.cached_hashes() == []
    kv.free("b")
    check_invariants(kv)


def test_duplicate_hash_keeps_first_block() -> None:
    pool = BlockPool(4)
    b0, b1 = pool.allocate(2)
    h = chain([1, 2, 3, 4])
    pool.cache([b0], h)
    pool.cache([b1], h)
    assert pool.cached[h[0]] is b0 and b1.block_hash is None
    assert pool.take_events() == [BlockStored((h[0],))]
    pool.release([b1, b0])
    assert next(iter(pool.free)).block_id == 1  # the unhashed duplicate is reused first


def test_free_queue_errors() -> None:
    pool = BlockPool(1)
    (b,) = pool.allocate(1)
    with pytest.raises(RuntimeError):
        pool.allocate(1)
    pool.release([b])
    with pytest.raises(AssertionError):
        pool.release([b])


def test_caching_disabled_never_hashes_or_shares() -> None:
    kv = KVCacheManager(8, BS, enable_caching=False)
    prompt = list(range(9))
    admit(kv, "a", prompt)
    assert admit(kv, "b", prompt) == 0
    assert not set(kv.block_ids("a")) & set(kv.block_ids("b"))
    assert kv.take_events() == [] and kv.cached_hashes() == []
    check_invariants(kv)
