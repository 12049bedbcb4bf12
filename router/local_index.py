"""A router's own copy of which worker holds which block, fed by the workers' KV events: the
confirmed part of a lookup without a round trip to the index.

On a shared 2-vCPU host a decision's round trip to Redis (its wake-up latency, and Redis' own
time while events flow) is more than half of a routing decision's p99; answered in process, the
walk costs about 0.1 ms. :class:`LocalIndex` holds the confirmed holders, what the workers'
events say; :class:`PredictedBlocks` the routers' predicted entries while they last. Both key a
block by its digest's first ``INDEX_KEY_BYTES``, as the index does, so a follower can start
from the index's own blocks (:mod:`router.index_follower` keeps them up to date).

The confirmed holders are packed (:class:`LocalIndex`: about 10 bytes per (block, worker) entry
in sorted arrays, with a bounded delta of recent changes), so a router can keep the copy of a
1,000-worker fleet. A walk reads each block's holders as a bitmask of worker slots and
intersects one integer per block it reads. A worker caches a block only after the blocks before
it and evicts a chain's tail first, so the holders of block ``j`` hold every block before it;
the walk gallops over runs of unchanged holders and binary-searches the block where the next
worker leaves.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, KeysView, Mapping
from operator import itemgetter

import numpy as np

from prefixserve.router.blocks import DIGEST_BYTES, BlockHash, Chain
from prefixserve.router.events import (
    DEVICE,
    DISK,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
)
from prefixserve.router.packed_entries import KEY, PackedEntries, chain_keys, keys_of

_FEW_BITS = 16  # a mask with more set bits is read through an array


class LocalIndex:
    """Confirmed block holders, as the KV events of each worker (by index worker id) say: every
    (block, worker) entry, whatever tier holds it, packed (:class:`PackedEntries`); and, once some
    worker reports blocks below its pool (KV tiers), those entries again per tier, so a lookup
    also tells how much of each worker's depth is in host memory or on disk."""

    MERGE_MIN = 65_536
    MERGE_SHARE = 0.05

    def __init__(self) -> None:
        self._held = PackedEntries(self)  # every entry, at any tier
        self._lower: dict[str, PackedEntries] = {}  # medium (host, disk) -> the entries held there
        self._slots: dict[int, int] = {}  # worker id -> its bit's position
        self._ids: dict[int, int] = {}  # bit position -> worker id
        self._free: list[int] = []  # positions of dropped workers, reused first

    def __len__(self) -> int:
        """(block, worker) entries held."""
        return len(self._held)

    @property
    def nbytes(self) -> int:
        """The base arrays' bytes (the delta's Python objects come on top)."""
        return self._held.nbytes + sum(t.nbytes for t in self._lower.values())

    def apply(self, worker_id: int, events: Iterable[KVEvent]) -> None:
        """One worker's events, in order."""
        for event in events:
            if isinstance(event, BlockStored):
                self._store(worker_id, event.hashes, event.medium)
            elif isinstance(event, BlockRemoved):
                self._remove(worker_id, event.hashes)
            elif isinstance(event, AllBlocksCleared) and worker_id in self._slots:
                self._clear(self._slots[worker_id])

    def replace(self, worker_id: int, hashes: Iterable[bytes]) -> None:
        """The worker's whole block set, as a resync states it (digests, or their keys): in its
        pool, as far as a resync tells."""
        self.drop(worker_id)
        self._store(worker_id, tuple(hashes), DEVICE)

    def drop(self, worker_id: int) -> None:
        """Forget the worker (gone, or about to be replaced) and free its slot."""
        slot = self._slots.pop(worker_id, None)
        if slot is None:
            return
        self._clear(slot)
        del self._ids[slot]
        self._free.append(slot)

    def workers(self) -> KeysView[int]:
        """The ids of the workers holding something."""
        return self._slots.keys()

    def depths(self, chain: Chain) -> dict[int, int]:
        """Each worker's consecutive confirmed depth of ``chain`` from block 0 (blocks), for
        the workers holding block 0."""
        return self._walk(chain_keys(chain), self._held.holders)

    def lower_blocks(self, chain: Chain, depths: Mapping[int, int]) -> dict[int, tuple[int, int]]:
        """Of each worker's ``depths`` blocks, those held below its pool, (host, disk), where
        some are (``WorkerMatch.lower_blocks``): the pool's consecutive depth and the pool's
        or host's are walked as the confirmed one is."""
        lower = [t for t in self._lower.values() if len(t)]
        if not lower or not depths:
            return {}
        keys = chain_keys(chain)
        held, disk = self._held.holders, self._lower.get(DISK)

        def in_pool(key: np.uint64) -> int:
            mask = held(key)
            for table in lower:
                mask &= ~table.holders(key)
            return mask

        def pool_or_host(key: np.uint64) -> int:
            return held(key) & ~disk.holders(key) if disk is not None else held(key)

        pool, upper = self._walk(keys, in_pool), self._walk(keys, pool_or_host)
        out = {}
        for worker_id, depth in depths.items():
            p = pool.get(worker_id, 0)
            if p < depth:
                host = min(depth, upper.get(worker_id, 0)) - p
                out[worker_id] = (max(0, host), depth - p - max(0, host))
        return out

    def _walk(self, keys: np.ndarray, holders: Callable[[np.uint64], int]) -> dict[int, int]:
        """Each worker's consecutive depth from block 0 of the blocks ``holders`` gives it."""
        n = len(keys)
        if not n:
            return {}
        alive = holders(keys[0])
        out: dict[int, int] = {}
        lo = 0  # every worker still in ``alive`` holds blocks 0..lo
        while alive:
            hi, step = n, 1
            while lo + 1 < n:  # gallop to a block some of them lack
                at = min(n - 1, lo + step)
                if alive & holders(keys[at]) == alive:
                    lo, step = at, step * 2
                else:
                    hi = at
                    break
            if hi == n:
                break
            while hi - lo > 1:  # the first block one of them lacks
                mid = (lo + hi) // 2
                if alive & holders(keys[mid]) == alive:
                    lo = mid
                else:
                    hi = mid
            still = alive & holders(keys[hi])
            self._settle(alive & ~still, hi, out)
            alive, lo = still, hi
        self._settle(alive, n, out)
        return out

    def _settle(self, mask: int, depth: int, out: dict[int, int]) -> None:
        """Record ``depth`` for every worker in ``mask`` (many at once through an array: a
        system prompt's first block has a fleet's holders)."""
        if mask.bit_count() > _FEW_BITS:
            bits = np.frombuffer(mask.to_bytes((mask.bit_length() + 7) // 8, "little"), np.uint8)
            slots = np.flatnonzero(np.unpackbits(bits, bitorder="little")).tolist()
            out.update(dict.fromkeys(itemgetter(*slots)(self._ids), depth))
            return
        while mask:
            low = mask & -mask
            out[self._ids[low.bit_length() - 1]] = depth
            mask ^= low

    def _slot(self, worker_id: int) -> int:
        slot = self._slots.get(worker_id)
        if slot is None:
            slot = self._free.pop() if self._free else len(self._slots)
            self._slots[worker_id], self._ids[slot] = slot, worker_id
        return slot

    def _store(self, worker_id: int, hashes: tuple[bytes, ...], medium: str) -> None:
        """Held now, in ``medium`` (the best tier the worker holds them in)."""
        slot = self._slot(worker_id)
        keys = keys_of(hashes)
        self._held.store(slot, keys)
        if medium != DEVICE and medium not in self._lower:
            self._lower[medium] = PackedEntries(self)
        for tier, table in self._lower.items():
            if tier == medium:
                table.store(slot, keys)
            elif len(table):
                table.remove(slot, keys)

    def _remove(self, worker_id: int, hashes: tuple[bytes, ...]) -> None:
        slot = self._slots.get(worker_id)
        if slot is None:  # nothing stored yet (a worker's blocks and slot come together)
            return
        keys = keys_of(hashes)
        for table in (self._held, *self._lower.values()):
            if table is self._held or len(table):
                table.remove(slot, keys)

    def _clear(self, slot: int) -> None:
        for table in (self._held, *self._lower.values()):
            table.clear(slot)

    def _merge(self) -> None:
        """Every table's delta into its base now."""
        for table in (self._held, *self._lower.values()):
            table.merge()


class PredictedBlocks:
    """Routers' predicted entries (a chain's blocks routed to a worker, for a short while) as a
    follower of the index's event log receives them: the blocks past the worker's confirmed
    depth, keyed as :class:`LocalIndex` keys them, each expiring ``ttl`` after it arrived."""

    def __init__(self) -> None:
        self._until: dict[bytes, dict[int, float]] = {}  # block key -> worker id -> expiry
        self._expiry: deque[tuple[float, int, tuple[bytes, ...]]] = deque()  # arrival order

    def __len__(self) -> int:
        """Blocks with an unexpired prediction (or one that expired since the last lookup)."""
        return len(self._until)

    def add(self, worker_id: int, hashes: Iterable[BlockHash], until: float) -> None:
        """``hashes`` routed to the worker, predicted there until ``until``."""
        keys = tuple(h[:KEY] for h in hashes)
        for k in keys:
            self._until.setdefault(k, {})[worker_id] = until
        self._expiry.append((until, worker_id, keys))

    def depths(self, chain: Chain, confirmed: Mapping[int, int], now: float) -> dict[int, int]:
        """Each worker's depth of ``chain`` that its confirmed blocks (``confirmed``: worker id
        -> depth) and its unexpired predicted ones make together, where predictions take it
        past its confirmed depth."""
        self._expire(now)
        if not self._until:
            return {}
        packed, get = chain.packed, self._until.get

        def at(j: int) -> dict[int, float]:  # past the chain's end: b"", no block's key
            return get(packed[j * DIGEST_BYTES : j * DIGEST_BYTES + KEY], _NONE)

        out: dict[int, int] = {}
        for start in {0, *confirmed.values()}:
            for worker_id, until in at(start).items():
                if until > now and confirmed.get(worker_id, 0) == start:
                    j = start + 1
                    while at(j).get(worker_id, 0.0) > now:
                        j += 1
                    out[worker_id] = j
        return out

    def _expire(self, now: float) -> None:
        expiry, until = self._expiry, self._until
        while expiry and expiry[0][0] <= now:
            when, worker_id, keys = expiry.popleft()
            for k in keys:
                holders = until.get(k)
                if holders is not None and holders.get(worker_id) == when:
                    del holders[worker_id]
                    if not holders:
                        del until[k]


_NONE: dict[int, float] = {}
