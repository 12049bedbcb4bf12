"""The packed (block, worker slot) entries under a router's copy of the index: when the delta
merges into the base, and entries that only a full 64-bit key tells apart."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from prefixserve.router.packed_entries import PackedEntries


@dataclass
class Owner:
    MERGE_MIN: int = 4
    MERGE_SHARE: float = 0.0


def keys(*ks: int) -> np.ndarray:
    return np.array(ks, dtype=np.uint64)


def test_the_delta_merges_once_it_holds_more_than_merge_min_changes() -> None:
    """Each kind of change counts one: a new entry, a base entry removed, a removed base entry
    stored again (one fewer), an entry of the delta removed (one fewer). The base grows by 10
    bytes an entry, and only when the delta merges."""
    e = PackedEntries(Owner())
    e.store(0, keys(1, 2, 3, 4))  # 4 changes: not more than 4
    assert (e.nbytes, len(e)) == (0, 4)
    e.store(0, keys(5))  # 5: merged
    assert (e.nbytes, len(e)) == (50, 5)
    e.remove(0, keys(1, 2, 3))  # 3 base entries removed
    e.store(0, keys(1))  # one back: 2 changes
    e.store(0, keys(6, 7))  # 4
    assert (e.nbytes, len(e)) == (50, 5)
    e.store(0, keys(8))  # 5: merged, less 2 and 3
    assert (e.nbytes, len(e)) == (60, 6)
    assert [e.holders(np.uint64(k)) for k in (1, 2, 3, 8)] == [1, 0, 0, 1]
    e.store(0, keys(10, 11, 12))  # 3 new
    e.remove(0, keys(10))  # one of them gone again: 2 changes
    e.store(0, keys(13, 14))  # 4
    assert (e.nbytes, len(e)) == (60, 10)
    e.store(0, keys(15))  # 5: merged
    assert (e.nbytes, len(e)) == (110, 11)
    assert e.holders(np.uint64(10)) == 0 and e.holders(np.uint64(15)) == 1


def test_storing_again_restores_one_worker_of_a_block_many_lost() -> None:
    e = PackedEntries(Owner(MERGE_MIN=100))
    e.store(0, keys(7))
    e.store(1, keys(7))
    e.store(2, keys(7))
    e.merge()
    e.remove(0, keys(7))
    e.remove(1, keys(7))
    assert e.holders(np.uint64(7)) == 0b100
    e.store(0, keys(7))  # slot 1 stays removed
    assert e.holders(np.uint64(7)) == 0b101
    e.merge()
    assert e.holders(np.uint64(7)) == 0b101 and len(e) == 2


def test_keys_a_float_cannot_tell_apart_stay_apart_through_a_merge() -> None:
    """Two keys 1 apart near 2^63 are one float64: removing one must not remove the other."""
    big = 1 << 63
    e = PackedEntries(Owner(MERGE_MIN=100))
    e.store(0, keys(big, big + 1, big + 2))
    e.store(1, keys(big + 1))
    e.merge()
    e.remove(0, keys(big + 1))
    e.remove(1, keys(big))  # slot 1 never held it: nothing to remove
    e.merge()
    assert [e.holders(np.uint64(k)) for k in (big, big + 1, big + 2)] == [0b01, 0b10, 0b01]
    assert (len(e), e.nbytes) == (3, 30)
