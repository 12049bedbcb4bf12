"""Paged KV cache bookkeeping: the block pool, the prefix cache and per-sequence block tables.

The KV tensor itself is one preallocated pool (``workers.kv_tensor.allocate_kv_cache``); this module
only decides which block of it each sequence uses. Modelled on vLLM v1's ``block_pool`` and
``kv_cache_manager``.

Invariants (tests/test_kv_cache.py checks them):

1. Every block is either free (``ref_cnt == 0``, linked in the free queue) or used
   (``ref_cnt > 0``, not linked); ``num_free + num_used == num_blocks`` at all times.
2. A block carries a hash only while ``cached[hash] is block``: one block per hash. Only full
   blocks are hashed, and a hashed block is never written again (writes go past it).
3. Free-queue order: unhashed free blocks sit at the front and are reused first; hashed ones
   follow in LRU order (least recently freed first). A sequence frees its blocks in reverse, so
   a chain's tail is evicted before its head and a surviving prefix stays reachable.
4. Eviction is lazy: a hashed free block keeps its hash (and stays a cache hit) until it is
   popped for reuse; only then is the hash dropped and ``BlockRemoved`` emitted.
5. Events are buffered in order and drained once per engine step (``take_events``).
   Hashes are registered at schedule time, before the forward pass writes their KV; until the
   step commits they are provisional, and a failed step rolls them back (``BlockRemoved``).
6. A block shared by several sequences (``ref_cnt > 1``) is copied before one of them writes
   into it (copy-on-write); the copy pairs are drained by the runner before the forward pass.
7. ``num_cached_free`` counts the free blocks that hold a hash, so ``num_empty`` (free minus
   those) is how many blocks can be allocated without evicting a cached prefix: the room the
   router's cost model weighs against evictions.
8. With KV tiers below the pool (``workers.kv_tiers``), ``on_evict`` sees every committed
   hashed block as it is evicted, while its KV is still intact, and reports the event itself;
   ``on_commit`` sees every block once its KV is written.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Sequence

from prefixserve.router.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from prefixserve.workers.free_blocks import Block, FreeBlockQueue

__all__ = ["Block", "BlockPool", "KVCacheManager", "cdiv"]


class BlockPool:
    """All blocks, the free queue, the hash→block map and the event buffer."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, Block] = {}
        self.events: list[KVEvent] = []
        self.uncommitted: list[Block] = []  # hashed since the last commit: KV not written yet
        self.num_cached_free = 0  # free blocks that still hold a hash (evictable cache hits)
        # the tiers below the pool (the KV tiers' invariants); None: an evicted block is gone
        self.on_evict: Callable[[list[tuple[bytes, Block]]], None] | None = None
        self.on_commit: Callable[[list[Block]], None] | None = None

    @property
    def num_free(self) -> int:
        return self.free.num_free

    def num_free_besides(self, hits: Sequence[Block]) -> int:
        """Free blocks once `hits` are taken: a cached hit no one uses is itself free."""
        return self.free.num_free - sum(1 for b in hits if b.ref_cnt == 0)

    @property
    def num_empty(self) -> int:
        """Free blocks holding no hash: allocating up to this many evicts nothing."""
        return self.free.num_free - self.num_cached_free

    def allocate(self, n: int) -> list[Block]:
        """Pop ``n`` free blocks (ref 1 each), evicting the hashes of reused cached blocks.

        They are returned in ascending id order (invariant 8): eviction pops a finished
        sequence's blocks tail first, and a table that runs backwards through memory halves the
        rate at which the CPU decode kernel streams its K/V.
        """
        if n > self.free.num_free:
            raise RuntimeError(f"asked for {n} KV blocks, {self.free.num_free} free")
        out: list[Block] = []
        evicted: list[tuple[bytes, Block]] = []
        for _ in range(n):
            block = self.free.pop_front()
            if block.block_hash is not None:
                self.num_cached_free -= 1
                del self.cached[block.block_hash]
                evicted.append((block.block_hash, block))
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        if evicted:
            self._evicted(evicted)
        out.sort(key=lambda b: b.block_id)
        return out

    def _evicted(self, evicted: list[tuple[bytes, Block]]) -> None:
        """Report evicted blocks, handing the committed ones to the tiers below, if any (a
        block hashed in this step has no KV yet: it is only removed)."""
        if self.on_evict is None:
            self.events.append(BlockRemoved(tuple(h for h, _ in evicted)))
            return
        fresh = {id(b) for b in self.uncommitted}
        if fresh:
            gone = tuple(h for h, b in evicted if id(b) in fresh)
            if gone:
                self.events.append(BlockRemoved(gone))
            evicted = [(h, b) for h, b in evicted if id(b) not in fresh]
        if evicted:
            self.on_evict(evicted)

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take one more reference; a free (cached) block leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free.remove(block)
                if block.block_hash is not None:
                    self.num_cached_free -= 1
            block.ref_cnt += 1

    def release(self, blocks: Iterable[Block]) -> None:
        """Drop one reference each, in the given order (callers pass tail first)."""
        for block in blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block.block_id} freed twice"
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free.push_front(block)
                else:
                    self.free.push_back(block)
                    self.num_cached_free += 1

    def cache(self, blocks: Sequence[Block], hashes: Sequence[bytes]) -> None:
        """Register full blocks under their chain hashes; emit ``BlockStored`` per run.

        A hash already held by another block is left to that block (one block per hash); the
        duplicate stays unhashed and is reused first once freed.
        """
        run: list[bytes] = []
        for block, block_hash in zip(blocks, hashes, strict=True):
            if block_hash in self.cached or block.block_hash is not None:
                if run:
                    self.events.append(BlockStored(tuple(run)))
                    run = []
                continue
            block.block_hash = block_hash
            self.cached[block_hash] = block
            self.uncommitted.append(block)
            run.append(block_hash)
        if run:
            self.events.append(BlockStored(tuple(run)))

    def commit(self) -> None:
        """The step's forward pass wrote the KV of every block hashed since the last commit."""
        if self.on_commit is not None and self.uncommitted:
            self.on_commit([b for b in self.uncommitted if b.block_hash is not None])
        self.uncommitted.clear()

    def rollback(self) -> None:
        """Unhash every block hashed since the last commit: its KV was never written, and a
        prefix hit on it would read garbage. ``BlockRemoved`` undoes the queued ``BlockStored``."""
        removed: list[bytes] = []
        for block in self.uncommitted:
            block_hash = block.block_hash
            if block_hash is None or self.cached.get(block_hash) is not block:
                continue  # already evicted (and reported) within the step
            del self.cached[block_hash]
            block.block_hash = None
            removed.append(block_hash)
            if block.ref_cnt == 0:  # free and now unhashed: it belongs at the front
                self.free.remove(block)
                self.free.push_front(block)
                self.num_cached_free -= 1
        self.uncommitted.clear()
        if removed:
            self.events.append(BlockRemoved(tuple(removed)))

    def reset(self) -> None:
        """Forget every hash (used blocks keep their data but are no longer shareable)."""
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()
        self.uncommitted.clear()
        self.num_cached_free = 0
        self.events.append(AllBlocksCleared())

    def take_events(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Per-sequence block tables on top of a :class:`BlockPool`, with prefix reuse and CoW.

    Sequences are named by a string id. A sequence's ``hashes`` (from its own
    ``router.blocks.BlockHasher``) cover its full blocks; the manager only reads them.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks)
        self.tables: dict[str, list[Block]] = {}
        self._num_cached: dict[str, int] = {}  # leading blocks of the table already registered
        self.pending_copies: list[tuple[int, int]] = []
        self.num_copies = 0  # copy-on-write block copies so far
        # blocks a waiting sequence keeps from eviction until it is admitted: its prefix hits
        # and the blocks loaded (or loading) into from lower tiers
        self.held: dict[str, list[Block]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_empty_blocks(self) -> int:
        return self.pool.num_empty

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    def block_ids(self, seq_id: str) -> list[int]:
        return [b.block_id for b in self.tables.get(seq_id, ())]

    def reusable(self, hashes: Sequence[bytes], num_tokens: int) -> Sequence[bytes]:
        """Hashes of the blocks a sequence of ``num_tokens`` tokens may take from the cache:
        none without caching, and never the block of its last token (its logits are needed,
        so that token is always recomputed)."""
        if not self.enable_caching:
            return ()
        return hashes[: (num_tokens - 1) // self.block_size]

    def expected_hit_blocks(self, hashes: Sequence[bytes], num_tokens: int,
                            coming: Container[bytes] = ()) -> int:
        """Leading blocks a waiting sequence would hit if admitted now: cached in the pool, or
        in ``coming`` (blocks that sequences ahead of it will have computed by then)."""
        reusable = self.reusable(hashes, num_tokens)
        for i, block_hash in enumerate(reusable):
            if block_hash not in self.pool.cached and block_hash not in coming:
                return i
        return len(reusable)

    def computed_blocks(self, hashes: Sequence[bytes], num_tokens: int) -> list[Block]:
        """The longest cached chain for a sequence of ``num_tokens`` tokens."""
        hits: list[Block] = []
        for block_hash in self.reusable(hashes, num_tokens):
            block = self.pool.cached.get(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate_slots(
        self,
        seq_id: str,
        num_computed: int,
        num_new_tokens: int,
        hashes: Sequence[bytes],
        computed: Sequence[Block] = (),
    ) -> bool:
        """Make room to write ``num_new_tokens`` after ``num_computed``; False if it cannot.

        ``computed`` (first admission only) are prefix-cache hits to share; ``num_computed``
        already counts their tokens. Full blocks whose tokens are written by this step are
        registered now (schedule time), so identical prompts admitted in the same step share
        blocks: the model writes every new K/V of a layer before any attention reads it.
        """
        table = self.tables.get(seq_id)
        if table is None:
            table = self.tables[seq_id] = []
            self._num_cached[seq_id] = len(computed)
        bs = self.block_size
        num_tokens_after = num_computed + num_new_tokens
        num_new = cdiv(num_tokens_after, bs) - len(table) - len(computed)
        # copy-on-write: the first block written may be a partial block shared with a fork
        first = num_computed // bs
        cow = int(first < len(table) and table[first].ref_cnt > 1)
        if num_new + cow > self.pool.num_free_besides(computed):
            if not table:
                del self.tables[seq_id], self._num_cached[seq_id]
            return False
        if computed:
            self.pool.touch(computed)
            table.extend(computed)
        held = self.held.pop(seq_id, None)
        if held:  # admitted: its table holds what it needs of them now
            self.pool.release(reversed(held))
        if cow:
            old = table[first]
            assert old.block_hash is None, "a cached block is immutable"
            (new,) = self.pool.allocate(1)
            self.pending_copies.append((old.block_id, new.block_id))
            self.num_copies += 1
            table[first] = new
            self.pool.release([old])
        if num_new > 0:
            table.extend(self.pool.allocate(num_new))
        if self.enable_caching:
            self._register(seq_id, table, num_tokens_after, hashes)
        return True

    def _register(
        self, seq_id: str, table: list[Block], num_tokens_after: int, hashes: Sequence[bytes]
    ) -> None:
        start = self._num_cached[seq_id]
        end = min(num_tokens_after // self.block_size, len(hashes), len(table))
        if end > start:
            self.pool.cache(table[start:end], hashes[start:end])
            self._num_cached[seq_id] = end

    def fork(self, parent_id: str, child_id: str) -> None:
        """Share every block of ``parent_id`` (the partial last one too) with a new sequence."""
        table = self.tables[parent_id]
        self.pool.touch(table)
        self.tables[child_id] = list(table)
        self._num_cached[child_id] = self._num_cached[parent_id]

    def hold(self, seq_id: str, blocks: Sequence[Block], referenced: bool = False) -> None:
        """Keep `blocks` until `seq_id` is admitted or freed, taking a reference on each
        (`referenced`: the caller's, just allocated)."""
        if not blocks:
            return
        if not referenced:
            self.pool.touch(blocks)
        self.held.setdefault(seq_id, []).extend(blocks)

    def release_held(self) -> None:
        """Give back every waiting sequence's held blocks."""
        for blocks in self.held.values():
            self.pool.release(reversed(blocks))
        self.held.clear()

    def free(self, seq_id: str) -> None:
        """Release a sequence's blocks, tail first (so chain tails are evicted first)."""
        table = self.tables.pop(seq_id, None)
        self._num_cached.pop(seq_id, None)
        if table:
            self.pool.release(reversed(table))
        held = self.held.pop(seq_id, None)
        if held:
            self.pool.release(reversed(held))

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def take_events(self) -> list[KVEvent]:
        return self.pool.take_events()

    def commit_step(self) -> None:
        """Blocks hashed while scheduling this step now hold their KV; keep them cached."""
        self.pool.commit()

    def rollback_step(self) -> None:
        """The step failed: unregister every block hashed while scheduling it."""
        self.pool.rollback()

    def cached_hashes(self) -> list[bytes]:
        return list(self.pool.cached)

    def reset_prefix_cache(self) -> None:
        self.pool.reset()
        for seq_id, table in self.tables.items():
            # registered blocks lost their hash; never re-register them under this sequence
            self._num_cached[seq_id] = max(self._num_cached[seq_id], len(table))
