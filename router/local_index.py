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
from collections.abc import Iterable, KeysView, Mapping

import numpy as np

from prefixserve.router.blocks import DIGEST_BYTES, BlockHash, Chain
from prefixserve.router.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from prefixserve.router.index import INDEX_KEY_BYTES

KEY = INDEX_KEY_BYTES


class LocalIndex:
    """Confirmed block holders, as the KV events of each worker (by index worker id) say.

    Held as two packed arrays sorted by block key, the base (each entry a key, 8 bytes, and a
    worker slot, 2 bytes), and a delta of the changes since the base was last rebuilt: per block
    key, a bitmask of the slots stored since (none of them in the base) and one of base entries
    removed since. A lookup reads the base's run of a key (a binary search) and corrects it by
    the delta; the delta is merged into the base once it holds ``MERGE_SHARE`` of the base's
    entries (at least ``MERGE_MIN``): the sorted new entries inserted in one pass, the removed
    ones masked out in another. So an entry costs about 10 bytes plus its share of the bounded
    delta, where a dict of bitmasks and a set per worker cost about 200.
    """

    MERGE_MIN = 65_536
    MERGE_SHARE = 0.05

    def __init__(self) -> None:
        self._keys = np.empty(0, np.uint64)  # base, sorted
        self._slot_col = np.empty(0, np.uint16)  # base: each entry's worker slot
        self._base_count = np.zeros(0, np.int64)  # base entries per slot
        self._added: dict[int, int] = {}  # block key -> slots stored since the base (not in it)
        self._removed: dict[int, int] = {}  # block key -> base entries removed since
        self._delta = 0  # entries the two dicts hold
        self._slots: dict[int, int] = {}  # worker id -> its bit's position
        self._ids: dict[int, int] = {}  # bit position -> worker id
        self._free: list[int] = []  # positions of dropped workers, reused first

    def __len__(self) -> int:
        """(block, worker) entries held."""
        removed = sum(m.bit_count() for m in self._removed.values())
        return len(self._keys) - removed + sum(m.bit_count() for m in self._added.values())

    @property
    def nbytes(self) -> int:
        """The base arrays' bytes (the delta's Python objects come on top)."""
        return self._keys.nbytes + self._slot_col.nbytes

    def apply(self, worker_id: int, events: Iterable[KVEvent]) -> None:
        """One worker's events, in order."""
        for event in events:
            if isinstance(event, BlockStored):
                self._store(worker_id, event.hashes)
            elif isinstance(event, BlockRemoved):
                self._remove(worker_id, event.hashes)
            elif isinstance(event, AllBlocksCleared) and worker_id in self._slots:
                self._clear(self._slots[worker_id])

    def replace(self, worker_id: int, hashes: Iterable[bytes]) -> None:
        """The worker's whole block set, as a resync states it (digests, or their keys)."""
        self.drop(worker_id)
        self._store(worker_id, tuple(hashes))

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
        keys = np.frombuffer(chain.packed, dtype=_KEY_DTYPE)[::2]  # each digest's first 8 bytes
        n = len(keys)
        if not n:
            return {}
        holders = self._holders
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

    def _holders(self, key: np.uint64) -> int:
        """The bitmask of the slots holding block ``key``."""
        base = self._keys
        lo = int(base.searchsorted(key))
        mask = 0
        if lo < len(base) and base[lo] == key:
            hi = int(base.searchsorted(key, "right"))
            mask = _mask_of(self._slot_col[lo:hi])
        k = int(key)
        return (mask | self._added.get(k, 0)) & ~self._removed.get(k, 0)

    def _settle(self, mask: int, depth: int, out: dict[int, int]) -> None:
        """Record ``depth`` for every worker in ``mask``."""
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

    def _in_base(self, keys: np.ndarray, slot: int) -> list[bool]:
        """Whether each (key, ``slot``) entry is in the base."""
        base, col = self._keys, self._slot_col
        lo = base.searchsorted(keys)
        hi = base.searchsorted(keys, "right")
        out = [False] * len(keys)
        for i in np.flatnonzero(hi > lo).tolist():
            out[i] = bool((col[lo[i] : hi[i]] == slot).any())
        return out

    def _store(self, worker_id: int, hashes: tuple[bytes, ...]) -> None:
        slot = self._slot(worker_id)
        bit, added, removed = 1 << slot, self._added, self._removed
        keys = _keys_of(hashes)
        for k, in_base in zip(keys.tolist(), self._in_base(keys, slot), strict=True):
            if in_base:
                gone = removed.get(k, 0)
                if gone & bit:  # stored again: the base entry holds once more
                    _set(removed, k, gone & ~bit)
                    self._delta -= 1
            else:
                new = added.get(k, 0)
                if not new & bit:
                    added[k] = new | bit
                    self._delta += 1
        self._maybe_merge()

    def _remove(self, worker_id: int, hashes: tuple[bytes, ...]) -> None:
        slot = self._slots.get(worker_id)
        if slot is None:  # nothing stored yet (a worker's blocks and slot come together)
            return
        bit, added, removed = 1 << slot, self._added, self._removed
        keys = _keys_of(hashes)
        for k, in_base in zip(keys.tolist(), self._in_base(keys, slot), strict=True):
            new = added.get(k, 0)
            if new & bit:
                _set(added, k, new & ~bit)
                self._delta -= 1
            elif in_base:
                gone = removed.get(k, 0)
                if not gone & bit:
                    removed[k] = gone | bit
                    self._delta += 1
        self._maybe_merge()

    def _clear(self, slot: int) -> None:
        """Every entry of ``slot``, in the base and the delta."""
        if slot < len(self._base_count) and self._base_count[slot]:  # else nothing to scan
            keep = self._slot_col != slot
            self._keys, self._slot_col = self._keys[keep], self._slot_col[keep]
            self._base_count[slot] = 0
        bit = 1 << slot
        for table in (self._added, self._removed):
            for k in [k for k, m in table.items() if m & bit]:
                _set(table, k, table[k] & ~bit)
        self._delta = sum(m.bit_count() for t in (self._added, self._removed) for m in t.values())

    def _maybe_merge(self) -> None:
        if self._delta > max(self.MERGE_MIN, self.MERGE_SHARE * len(self._keys)):
            self._merge()

    def _merge(self) -> None:
        """The delta into the base: removed entries masked out, new ones inserted in order."""
        keys, col = self._keys, self._slot_col
        if self._removed:
            drop = np.zeros(len(keys), dtype=bool)
            gone = np.fromiter(self._removed, dtype=np.uint64, count=len(self._removed))
            lo, hi = keys.searchsorted(gone), keys.searchsorted(gone, "right")
            for i, mask in enumerate(self._removed.values()):
                start = int(lo[i])
                for offset, slot in enumerate(col[start : int(hi[i])].tolist()):
                    if mask >> slot & 1:
                        drop[start + offset] = True
            keys, col = keys[~drop], col[~drop]
        if self._added:
            new_keys, new_slots = [], []
            for k, mask in self._added.items():
                while mask:
                    low = mask & -mask
                    new_keys.append(k)
                    new_slots.append(low.bit_length() - 1)
                    mask ^= low
            add_keys = np.array(new_keys, dtype=np.uint64)
            order = add_keys.argsort(kind="stable")
            add_keys = add_keys[order]
            at = keys.searchsorted(add_keys)
            keys = np.insert(keys, at, add_keys)
            col = np.insert(col, at, np.array(new_slots, dtype=np.uint16)[order])
        self._keys, self._slot_col = keys, col
        self._base_count = np.bincount(col)
        self._added, self._removed, self._delta = {}, {}, 0


_KEY_DTYPE = np.dtype("<u8")


def _keys_of(hashes: Iterable[bytes]) -> np.ndarray:
    """Each digest's (or key's) first ``KEY`` bytes as a little-endian u64."""
    return np.frombuffer(b"".join(h[:KEY] for h in hashes), dtype=_KEY_DTYPE)


def _mask_of(slots: np.ndarray) -> int:
    """The bitmask of a run of slots."""
    if len(slots) <= 16:
        mask = 0
        for s in slots.tolist():
            mask |= 1 << s
        return mask
    present = np.zeros(int(slots.max()) + 1, dtype=bool)
    present[slots] = True
    return int.from_bytes(np.packbits(present, bitorder="little").tobytes(), "little")


def _set(table: dict[int, int], key: int, mask: int) -> None:
    if mask:
        table[key] = mask
    else:
        del table[key]


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
