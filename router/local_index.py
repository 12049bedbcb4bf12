"""A router's own copy of which worker holds which block, fed by the workers' KV events: the
confirmed part of a lookup without a round trip to the index.

On a shared 2-vCPU host a decision's round trip to Redis (its wake-up latency, and Redis' own
time while events flow) is more than half of a routing decision's p99; answered in process, the
walk costs about 0.1 ms. :class:`LocalIndex` holds the confirmed holders, what the workers'
events say; :class:`PredictedBlocks` the routers' predicted entries while they last. Both key a
block by its digest's first ``INDEX_KEY_BYTES``, as the index does, so a follower can start
from the index's own blocks (:mod:`router.index_follower` keeps them up to date).

Each block maps to a bitmask of worker slots, so a chain's walk intersects one integer per
block it reads. A worker caches a block only after the blocks before it and evicts a chain's
tail first, so the holders of block ``j`` hold every block before it; the walk gallops over runs
of unchanged holders and binary-searches the block where the next worker leaves.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, KeysView, Mapping

from prefixserve.router.blocks import DIGEST_BYTES, BlockHash, Chain
from prefixserve.router.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from prefixserve.router.index import INDEX_KEY_BYTES

KEY = INDEX_KEY_BYTES


class LocalIndex:
    """Confirmed block holders, as the KV events of each worker (by index worker id) say."""

    def __init__(self) -> None:
        self._holders: dict[bytes, int] = {}  # block key -> bitmask of worker slots
        self._blocks: dict[int, set[bytes]] = {}  # worker id -> its blocks' keys
        self._slots: dict[int, int] = {}  # worker id -> its bit's position
        self._ids: dict[int, int] = {}  # bit position -> worker id
        self._free: list[int] = []  # positions of dropped workers, reused first

    def apply(self, worker_id: int, events: Iterable[KVEvent]) -> None:
        """One worker's events, in order."""
        for event in events:
            if isinstance(event, BlockStored):
                self._store(worker_id, event.hashes)
            elif isinstance(event, BlockRemoved):
                self._remove(worker_id, event.hashes)
            elif isinstance(event, AllBlocksCleared):
                self._remove(worker_id, tuple(self._blocks.get(worker_id, ())))

    def replace(self, worker_id: int, hashes: Iterable[bytes]) -> None:
        """The worker's whole block set, as a resync states it (digests, or their keys)."""
        self.drop(worker_id)
        self._store(worker_id, tuple(hashes))

    def drop(self, worker_id: int) -> None:
        """Forget the worker (gone, or about to be replaced) and free its slot."""
        slot = self._slots.pop(worker_id, None)
        if slot is None:
            return
        self._unset(1 << slot, self._blocks.pop(worker_id))
        del self._ids[slot]
        self._free.append(slot)

    def workers(self) -> KeysView[int]:
        """The ids of the workers holding something."""
        return self._slots.keys()

    def depths(self, chain: Chain) -> dict[int, int]:
        """Each worker's consecutive confirmed depth of ``chain`` from block 0 (blocks), for
        the workers holding block 0."""
        packed, get = chain.packed, self._holders.get

        def holders(j: int) -> int:
            return get(packed[j * DIGEST_BYTES : j * DIGEST_BYTES + KEY], 0)

        n = len(packed) // DIGEST_BYTES
        alive = holders(0)  # an empty chain: b"", no block
        out: dict[int, int] = {}
        lo = 0  # every worker still in ``alive`` holds blocks 0..lo
        while alive:
            hi, step = n, 1
            while lo + 1 < n:  # gallop to a block some of them lack
                at = min(n - 1, lo + step)
                if alive & holders(at) == alive:
                    lo, step = at, step * 2
                else:
                    hi = at
                    break
            if hi == n:
                break
            while hi - lo > 1:  # the first block one of them lacks
                mid = (lo + hi) // 2
                if alive & holders(mid) == alive:
                    lo = mid
                else:
                    hi = mid
            still = alive & holders(hi)
            self._settle(alive & ~still, hi, out)
            alive, lo = still, hi
        self._settle(alive, n, out)
        return out

    def _settle(self, mask: int, depth: int, out: dict[int, int]) -> None:
        """Record ``depth`` for every worker in ``mask``."""
        while mask:
            low = mask & -mask
            out[self._ids[low.bit_length() - 1]] = depth
            mask ^= low

    def _bit(self, worker_id: int) -> int:
        slot = self._slots.get(worker_id)
        if slot is None:
            slot = self._free.pop() if self._free else len(self._slots)
            self._slots[worker_id], self._ids[slot] = slot, worker_id
        return 1 << slot

    def _store(self, worker_id: int, hashes: tuple[bytes, ...]) -> None:
        bit, holders = self._bit(worker_id), self._holders
        held = self._blocks.setdefault(worker_id, set())
        for h in hashes:
            k = h[:KEY]
            holders[k] = holders.get(k, 0) | bit
            held.add(k)

    def _remove(self, worker_id: int, hashes: tuple[bytes, ...]) -> None:
        held = self._blocks.get(worker_id)
        if not held:  # nothing stored yet (a worker's blocks and slot come together)
            return
        gone = [k for h in hashes if (k := h[:KEY]) in held]
        held.difference_update(gone)
        self._unset(1 << self._slots[worker_id], gone)

    def _unset(self, bit: int, hashes: Iterable[bytes]) -> None:
        holders = self._holders
        for h in hashes:
            rest = holders[h] & ~bit
            if rest:
                holders[h] = rest
            else:
                del holders[h]


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
