"""Paged KV bookkeeping, exactly: free-queue links, ref counts, CoW capacity, rollback, events."""

from __future__ import annotations

import random

import pytest

from prefixserve.router.blocks import hash_chain, namespace
from prefixserve.router.events import AllBlocksCleared, BlockRemoved, BlockStored
from prefixserve.workers.kv_cache import Block, BlockPool, FreeBlockQueue, KVCacheManager, cdiv

BS = 4
NS = namespace("kv-invariants")


def chain(tokens: list[int]) -> list[bytes]:
    return hash_chain(tokens, BS, NS)


def free_ids(kv: KVCacheManager | BlockPool) -> list[int]:
    pool = kv.pool if isinstance(kv, KVCacheManager) else kv
    return [b.block_id for b in pool.free]


def refs(kv: KVCacheManager) -> list[int]:
    return [b.ref_cnt for b in kv.pool.blocks]


def admit(kv: KVCacheManager, seq_id: str, tokens: list[int]) -> bool:
    """Admit a whole prompt with its prefix hits, as the scheduler does."""
    hashes = chain(tokens)
    hits = kv.computed_blocks(hashes, len(tokens))
    done = len(hits) * BS
    return kv.allocate_slots(seq_id, done, len(tokens) - done, hashes, hits)


def check_invariants(kv: KVCacheManager) -> None:
    """Invariants 1-3 of workers/kv_cache.py, plus table/ref-count agreement."""
    pool = kv.pool
    free = list(pool.free)
    assert len(free) == pool.num_free == kv.num_free_blocks
    assert all(b.ref_cnt == 0 for b in free)
    assert len({b.block_id for b in free}) == len(free)
    used = [b for b in pool.blocks if b.ref_cnt > 0]
    assert len(free) + len(used) == pool.num_blocks
    counted: dict[int, int] = {}
    for table in kv.tables.values():
        for b in table:
            counted[b.block_id] = counted.get(b.block_id, 0) + 1
    assert {b.block_id: b.ref_cnt for b in used} == counted
    assert all(b.block_hash == h for h, b in pool.cached.items())
    assert sum(b.block_hash is not None for b in pool.blocks) == len(pool.cached)
    kinds = [b.block_hash is not None for b in free]
    assert kinds == sorted(kinds)  # unhashed free blocks first
    assert set(kv._num_cached) == set(kv.tables)
    assert pool.num_cached_free == sum(kinds)  # invariant 7
    assert kv.num_empty_blocks == pool.num_empty == len(free) - sum(kinds)


# --- FreeBlockQueue -----------------------------------------------------------------------


def test_free_queue_push_pop_remove_exact() -> None:
    q = FreeBlockQueue([])
    assert list(q) == [] and q.num_free == 0
    with pytest.raises(RuntimeError, match=r"^no free KV blocks$"):
        q.pop_front()
    b0, b1, b2 = Block(0), Block(1), Block(2)
    q.push_front(b0)  # into an empty queue: links between the two sentinels
    q.push_back(b1)
    q.push_front(b2)
    assert [b.block_id for b in q] == [2, 0, 1] and q.num_free == 3
    q.remove(b0)
    assert [b.block_id for b in q] == [2, 1] and q.num_free == 2
    assert b0.prev is None and b0.next is None
    with pytest.raises(AssertionError, match=r"^block is not in the free queue$"):
        q.remove(b0)  # removing twice is refused, not silently corrupting the list
    assert q.pop_front() is b2
    assert b2.prev is None and b2.next is None
    assert q.pop_front() is b1
    assert q.num_free == 0
    with pytest.raises(RuntimeError, match=r"^no free KV blocks$"):
        q.pop_front()


def test_pool_construction_and_allocation_errors() -> None:
    with pytest.raises(ValueError, match=r"^the KV cache needs at least one block$"):
        BlockPool(0)
    pool = BlockPool(1)
    assert pool.num_blocks == 1 and pool.num_free == 1
    with pytest.raises(RuntimeError, match=r"^asked for 2 KV blocks, 1 free$"):
        pool.allocate(2)
    assert pool.num_free == 1 and pool.events == []
    assert pool.allocate(0) == [] and pool.num_free == 1


# --- BlockPool.cache ----------------------------------------------------------------------


def test_cache_needs_one_hash_per_block() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    with pytest.raises(ValueError):
        pool.cache(blocks, chain([1, 2, 3, 4]))


def test_cache_splits_event_runs_around_an_already_cached_hash() -> None:
    pool = BlockPool(8)
    h = chain(list(range(12)))
    (holder,) = pool.allocate(1)
    pool.cache([holder], [h[1]])
    assert pool.take_events() == [BlockStored((h[1],))]
    b0, b1, b2 = pool.allocate(3)
    pool.cache([b0, b1, b2], h)
    # h[1] stays with its holder; b1 stays unhashed; the runs on either side are reported apart
    assert pool.take_events() == [BlockStored((h[0],)), BlockStored((h[2],))]
    assert b0.block_hash == h[0] and b1.block_hash is None and b2.block_hash == h[2]
    assert pool.cached == {h[0]: b0, h[1]: holder, h[2]: b2}
    assert pool.uncommitted == [holder, b0, b2]


def test_cache_never_rehashes_a_hashed_block() -> None:
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    h = chain(list(range(8)))
    pool.cache([b], [h[0]])
    pool.take_events()
    pool.cache([b], [h[1]])
    assert b.block_hash == h[0] and pool.cached == {h[0]: b}
    assert pool.take_events() == []


# --- commit / rollback --------------------------------------------------------------------


def test_rollback_unhashes_only_this_steps_blocks() -> None:
    kv = KVCacheManager(8, BS)
    a, b = chain(list(range(8))), chain(list(range(100, 108)))
    assert admit(kv, "a", list(range(9)))
    kv.commit_step()
    assert admit(kv, "b", list(range(100, 109)))
    assert kv.take_events() == [BlockStored(tuple(a)), BlockStored(tuple(b))]
    kv.rollback_step()
    assert kv.take_events() == [BlockRemoved(tuple(b))]
    assert kv.cached_hashes() == a
    # b keeps its blocks (ref 1), they just are not shareable any more
    assert kv.block_ids("b") == [3, 4, 5]
    assert [kv.pool.blocks[i].block_hash for i in (3, 4, 5)] == [None, None, None]
    assert refs(kv)[:6] == [1] * 6
    check_invariants(kv)
    # nothing uncommitted: a second rollback, or one after a commit, removes nothing
    kv.rollback_step()
    kv.commit_step()
    kv.rollback_step()
    assert kv.take_events() == []
    assert kv.cached_hashes() == a


def test_rollback_moves_freed_blocks_to_the_front() -> None:
    kv = KVCacheManager(6, BS)
    assert admit(kv, "a", list(range(8)))
    kv.free("a")  # hashed: back of the free queue, tail first
    assert free_ids(kv) == [2, 3, 4, 5, 1, 0]
    kv.rollback_step()
    # unhashed now: they are reused first (rolled back in registration order, each to the front)
    assert free_ids(kv) == [1, 0, 2, 3, 4, 5]
    assert kv.take_events() == [BlockStored(tuple(chain(list(range(8))))),
                                BlockRemoved(tuple(chain(list(range(8)))))]
    check_invariants(kv)


def test_rollback_skips_blocks_evicted_within_the_step() -> None:
    kv = KVCacheManager(3, BS)
    a = chain(list(range(8)))
    assert admit(kv, "a", list(range(8)))
    kv.free("a")
    # same step: c needs every block, evicting a's hashes (reported once, by the eviction)
    c = chain(list(range(50, 60)))
    assert admit(kv, "c", list(range(50, 60)))
    # a's blocks are evicted tail first and reused for c's head; block 2 (never used) is c's
    # unhashed partial block
    assert kv.block_ids("c") == [0, 1, 2]
    assert kv.take_events() == [
        BlockStored(tuple(a)),
        BlockRemoved((a[1], a[0])),
        BlockStored(tuple(c)),
    ]
    kv.rollback_step()
    # blocks 0 and 1 are listed twice (under a's hashes, then c's): their first listings find
    # c's hashes and undo them; the second find no hash and are skipped
    assert kv.take_events() == [BlockRemoved((c[0], c[1]))]
    assert kv.cached_hashes() == []
    check_invariants(kv)


def test_rollback_goes_on_past_a_block_evicted_and_reused_unhashed_within_the_step() -> None:
    kv = KVCacheManager(4, BS)
    z = list(range(5))
    assert admit(kv, "z", z)  # blocks [0, 1], z's first block hashed on 0
    p = [*z[:4], *range(100, 105)]
    assert admit(kv, "p", p)  # hit 0, then [2, 3], p's second block hashed on 2
    p1 = chain(p)[1]
    kv.free("p")  # 3 (unhashed) to the front, 2 (hashed) to the back
    assert free_ids(kv) == [3, 2]
    assert admit(kv, "w", [500, 501])  # takes 3
    assert admit(kv, "q", [*z[:4], 600, 601])  # hit 0, then 2 as its partial block: p1 evicted
    assert kv.block_ids("q") == [0, 2] and kv.pool.blocks[2].block_hash is None
    kv.free("w")
    y = list(range(700, 704))
    assert admit(kv, "y", y)  # 3 again, hashed y's block
    assert [b.block_id for b in kv.pool.uncommitted] == [0, 2, 3]
    kv.take_events()
    kv.rollback_step()
    # block 2's listing (its hash evicted in the step) is skipped, and y's after it undone too
    assert kv.take_events() == [BlockRemoved((chain(z)[0], chain(y)[0]))]
    assert kv.cached_hashes() == [] and p1 not in kv.pool.cached
    check_invariants(kv)


def test_with_tiers_below_a_block_hashed_in_the_step_is_removed_not_offloaded() -> None:
    kv = KVCacheManager(4, BS)
    offloaded: list[list[bytes]] = []
    kv.pool.on_evict = lambda evicted: offloaded.append([h for h, _ in evicted])
    a, b = list(range(8)), list(range(100, 108))
    assert admit(kv, "a", a)  # blocks [0, 1]
    kv.commit_step()  # a's KV is written: an eviction may offload it
    kv.free("a")
    assert admit(kv, "b", b)  # blocks [2, 3], hashed in this step: no KV yet
    kv.free("b")
    assert free_ids(kv) == [1, 0, 3, 2]
    kv.take_events()
    assert admit(kv, "c", list(range(50, 66)))  # every block: a's and b's evicted together
    ha, hb = chain(a), chain(b)
    assert offloaded == [[ha[1], ha[0]]]  # the committed ones go to the tiers, and only they
    assert kv.take_events() == [BlockRemoved((hb[1], hb[0])),
                                BlockStored(tuple(chain(list(range(50, 66)))))]
    check_invariants(kv)


def test_admission_gives_back_the_blocks_held_while_waiting() -> None:
    kv = KVCacheManager(4, BS)
    a = list(range(8))
    assert admit(kv, "a", a)
    kv.free("a")
    hashes = chain([*a, 9])
    hits = kv.computed_blocks(hashes, 9)
    kv.hold("s", hits)  # a waiting sequence keeps its hits from eviction
    assert [kv.pool.blocks[i].ref_cnt for i in (0, 1)] == [1, 1] and kv.num_free_blocks == 2
    assert kv.allocate_slots("s", 8, 1, hashes, hits)
    # admitted: the table's references replace the hold's
    assert kv.held == {} and refs(kv) == [1, 1, 1, 0]
    kv.free("s")
    assert refs(kv) == [0, 0, 0, 0] and kv.num_free_blocks == 4
    check_invariants(kv)


# --- KVCacheManager -----------------------------------------------------------------------


def test_counters_and_usage() -> None:
    kv = KVCacheManager(8, BS)
    assert kv.num_copies == 0 and kv.pending_copies == []
    assert kv.num_total_blocks == 8 and kv.num_free_blocks == 8
    assert kv.usage == 0.0
    assert admit(kv, "a", list(range(6)))  # 2 blocks
    assert kv.num_free_blocks == 6
    assert kv.usage == pytest.approx(0.25)
    assert admit(kv, "b", list(range(100, 124)))  # 6 blocks
    assert kv.usage == pytest.approx(1.0)
    assert kv.block_ids("nobody") == []
    assert cdiv(0, 4) == 0 and cdiv(1, 4) == 1 and cdiv(4, 4) == 1 and cdiv(5, 4) == 2


def test_copy_on_write_needs_a_free_block() -> None:
    kv = KVCacheManager(2, BS)
    prompt = list(range(6))  # block 0 full, block 1 partial
    assert admit(kv, "p", prompt)
    kv.fork("p", "q")
    assert kv.num_free_blocks == 0 and refs(kv) == [2, 2]
    # p writes token 6 into the shared partial block: 0 new blocks + 1 copy > 0 free
    assert not kv.allocate_slots("p", 6, 1, chain([*prompt, 7]))
    assert kv.block_ids("p") == kv.block_ids("q") == [0, 1]
    assert refs(kv) == [2, 2] and kv.take_copies() == [] and kv.num_copies == 0
    check_invariants(kv)
    kv.free("q")
    assert kv.allocate_slots("p", 6, 1, chain([*prompt, 7]))
    assert kv.take_copies() == [] and kv.num_copies == 0  # p owns block 1 alone now


def test_copy_on_write_counts_every_copy() -> None:
    kv = KVCacheManager(8, BS)
    prompt = list(range(6))
    assert admit(kv, "p", prompt)
    kv.fork("p", "q")
    kv.fork("p", "r")
    assert refs(kv)[:2] == [3, 3]
    assert kv.allocate_slots("q", 6, 1, chain([*prompt, 1]))
    assert kv.allocate_slots("r", 6, 1, chain([*prompt, 2]))
    assert kv.num_copies == 2
    assert kv.take_copies() == [(1, 2), (1, 3)]
    assert kv.take_copies() == []
    assert kv.block_ids("p") == [0, 1] and kv.block_ids("q") == [0, 2]
    assert kv.block_ids("r") == [0, 3]
    assert refs(kv)[:4] == [3, 1, 1, 1]
    check_invariants(kv)


def test_writing_into_a_shared_cached_block_is_refused() -> None:
    kv = KVCacheManager(8, BS)
    tokens = list(range(8))
    assert admit(kv, "p", tokens)  # both blocks full and hashed
    kv.fork("p", "q")
    with pytest.raises(AssertionError, match=r"^a cached block is immutable$"):
        kv.allocate_slots("q", 4, 1, chain(tokens))


def test_chunked_prefill_registers_blocks_once_written() -> None:
    kv = KVCacheManager(8, BS)
    tokens = list(range(14))
    h = chain(tokens)
    assert kv.allocate_slots("a", 0, 6, h)  # writes block 0 and half of block 1
    assert kv.block_ids("a") == [0, 1]
    assert kv.take_events() == [BlockStored((h[0],))]
    assert kv.allocate_slots("a", 6, 6, h)
    assert kv.take_events() == [BlockStored((h[1], h[2]))]
    assert kv.allocate_slots("a", 12, 2, h)  # partial block 3: nothing to register
    assert kv.take_events() == []
    assert kv.block_ids("a") == [0, 1, 2, 3]
    check_invariants(kv)


def test_registers_only_blocks_it_has_hashes_for() -> None:
    kv = KVCacheManager(8, BS)
    h = chain(list(range(12)))
    assert kv.allocate_slots("a", 0, 12, [])
    assert kv.take_events() == [] and kv.cached_hashes() == []
    assert kv.allocate_slots("b", 0, 12, h[:1])
    assert kv.take_events() == [BlockStored((h[0],))]
    assert kv.cached_hashes() == [h[0]]
    check_invariants(kv)


def test_refused_admission_leaves_no_trace() -> None:
    kv = KVCacheManager(2, BS)
    assert not kv.allocate_slots("a", 0, 12, chain(list(range(12))))
    assert "a" not in kv.tables and kv._num_cached == {}
    assert kv.num_free_blocks == 2 and kv.take_events() == []


def test_free_unknown_sequence_is_a_no_op_and_free_forgets() -> None:
    kv = KVCacheManager(4, BS)
    kv.free("never-admitted")
    assert admit(kv, "a", list(range(5)))
    kv.free("a")
    assert kv.tables == {} and kv._num_cached == {}
    assert kv.num_free_blocks == 4
    check_invariants(kv)


def test_reset_never_reregisters_a_running_sequences_blocks() -> None:
    kv = KVCacheManager(8, BS)
    tokens = list(range(9))  # blocks 0, 1 hashed; 2 partial
    assert admit(kv, "a", tokens)
    kv.take_events()
    kv.reset_prefix_cache()
    assert kv.take_events() == [AllBlocksCleared()]
    assert kv.cached_hashes() == [] and all(b.block_hash is None for b in kv.pool.blocks)
    # block 2 fills up: it was in the table at the reset, so it is never registered
    tokens += [9, 10, 11]
    assert kv.allocate_slots("a", 9, 3, chain(tokens))
    assert kv.take_events() == []
    # block 3 was allocated after the reset: it is registered once full
    tokens += [12, 13, 14, 15]
    assert kv.allocate_slots("a", 12, 4, chain(tokens))
    assert kv.take_events() == [BlockStored((chain(tokens)[3],))]
    check_invariants(kv)


def test_random_walk_keeps_invariants() -> None:
    """Seeded mix of admissions, decodes, forks, frees, commits, rollbacks and cache resets."""
    rng = random.Random(1234)
    kv = KVCacheManager(12, BS)
    seqs: dict[str, list[int]] = {}
    for step in range(300):
        op = rng.choice(["admit", "decode", "fork", "free", "commit", "rollback"] * 4 + ["reset"])
        if op == "admit" and len(seqs) < 6:
            name = f"s{step}"
            tail = [rng.randrange(50) for _ in range(rng.randrange(1, 9))]
            tokens = [rng.randrange(3)] * 4 + tail  # a few shared first blocks
            if admit(kv, name, tokens):
                seqs[name] = tokens
        elif op == "decode" and seqs:
            name = rng.choice(sorted(seqs))
            tokens = seqs[name]
            tokens.append(rng.randrange(50))
            if not kv.allocate_slots(name, len(tokens) - 1, 1, chain(tokens)):
                kv.free(name)
                del seqs[name]
        elif op == "fork" and seqs and len(seqs) < 6:
            parent = rng.choice(sorted(seqs))
            kv.fork(parent, f"f{step}")
            seqs[f"f{step}"] = list(seqs[parent])
        elif op == "free" and seqs:
            name = rng.choice(sorted(seqs))
            kv.free(name)
            del seqs[name]
        elif op == "commit":
            kv.commit_step()
        elif op == "rollback":
            kv.rollback_step()
        elif op == "reset":
            kv.reset_prefix_cache()
        check_invariants(kv)
        for name, tokens in seqs.items():
            assert len(kv.block_ids(name)) == cdiv(len(tokens), BS)
    kv.take_copies()
    for name in list(seqs):
        kv.free(name)
    assert kv.num_free_blocks == 12
    check_invariants(kv)
