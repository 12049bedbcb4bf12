"""(block, worker slot) entries packed in sorted arrays with a bounded delta: the storage of a
router's copy of the index (:mod:`router.local_index`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import numpy as np

from prefixserve.router.blocks import Chain
from prefixserve.router.index import INDEX_KEY_BYTES

KEY = INDEX_KEY_BYTES


class MergeThresholds(Protocol):
    MERGE_MIN: int
    MERGE_SHARE: float


class PackedEntries:
    """(block, worker slot) entries, packed.

    Held as two packed arrays sorted by block key, the base (each entry a key, 8 bytes, and a
    worker slot, 2 bytes), and a delta of the changes since the base was last rebuilt: per block
    key, a bitmask of the slots stored since (none of them in the base) and one of base entries
    removed since. A lookup reads the base's run of a key (a binary search) and corrects it by
    the delta; the delta is merged into the base once it holds ``MERGE_SHARE`` of the base's
    entries (at least ``MERGE_MIN``): the sorted new entries inserted in one pass, the removed
    ones masked out in another. So an entry costs about 10 bytes plus its share of the bounded
    delta, where a dict of bitmasks and a set per worker cost about 200. The thresholds are
    the owner's (``MERGE_MIN``, ``MERGE_SHARE``: a
    :class:`router.local_index.LocalIndex`).
    """

    def __init__(self, owner: MergeThresholds) -> None:
        self._owner = owner
        self._keys = np.empty(0, np.uint64)  # base, sorted
        self._slot_col = np.empty(0, np.uint16)  # base: each entry's worker slot
        self._base_count = np.zeros(0, np.int64)  # base entries per slot
        self._added: dict[int, int] = {}  # block key -> slots stored since the base (not in it)
        self._removed: dict[int, int] = {}  # block key -> base entries removed since
        self._delta = 0  # entries the two dicts hold

    def __len__(self) -> int:
        removed = sum(m.bit_count() for m in self._removed.values())
        return len(self._keys) - removed + sum(m.bit_count() for m in self._added.values())

    @property
    def nbytes(self) -> int:
        return self._keys.nbytes + self._slot_col.nbytes

    def holders(self, key: np.uint64) -> int:
        """The bitmask of the slots holding block ``key``."""
        base = self._keys
        lo = int(base.searchsorted(key))
        mask = 0
        if lo < len(base) and base[lo] == key:
            hi = int(base.searchsorted(key, "right"))
            mask = _mask_of(self._slot_col[lo:hi])
        k = int(key)
        return (mask | self._added.get(k, 0)) & ~self._removed.get(k, 0)

    def _in_base(self, keys: np.ndarray, slot: int) -> list[bool]:
        """Whether each (key, ``slot``) entry is in the base."""
        base, col = self._keys, self._slot_col
        lo = base.searchsorted(keys)
        hi = base.searchsorted(keys, "right")
        out = [False] * len(keys)
        for i in np.flatnonzero(hi > lo).tolist():
            out[i] = bool((col[lo[i] : hi[i]] == slot).any())
        return out

    def store(self, slot: int, keys: np.ndarray) -> None:
        bit, added, removed = 1 << slot, self._added, self._removed
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

    def remove(self, slot: int, keys: np.ndarray) -> None:
        bit, added, removed = 1 << slot, self._added, self._removed
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

    def clear(self, slot: int) -> None:
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
        owner = self._owner
        if self._delta > max(owner.MERGE_MIN, owner.MERGE_SHARE * len(self._keys)):
            self.merge()

    def merge(self) -> None:
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


def chain_keys(chain: Chain) -> np.ndarray:
    """Each digest's first 8 bytes, as the entries key blocks."""
    return np.frombuffer(chain.packed, dtype=_KEY_DTYPE)[::2]


def keys_of(hashes: Iterable[bytes]) -> np.ndarray:
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
