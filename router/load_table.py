"""Workers' loads as the cost model reads them: one float row per worker.

An index client hands out the live workers' loads as one map per change (never changed after).
At 1,000 workers, reading every load into a row on every decision costs more than the cost
model does, so the client's map is a :class:`LoadMap`: it carries its rows, kept up to date by
the client as each load arrives, and a router gathers its candidates' rows with one array index.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from itertools import chain
from operator import attrgetter

import numpy as np

from prefixserve.router.events import WorkerLoad

# The load fields the cost model reads, in this order in a row.
LOAD_FIELDS = ("prefill_tokens_per_s", "decode_tokens_per_s", "queued_prefill_tokens",
               "num_running", "kv_empty_blocks", "num_waiting", "busy_share",
               "kv_total_blocks", "host_load_tokens_per_s", "disk_load_tokens_per_s")
_COLUMNS = attrgetter(*LOAD_FIELDS)
# A worker that has not reported: nothing queued, running or free that we know of, rates unmeasured
# (so the reference and default rates apply), busy (never ahead of an idle one in a tie): what
# the cost model assumes without a load.
UNREPORTED = WorkerLoad(busy_share=1.0)


def load_row(load: WorkerLoad | None) -> tuple[float, ...]:
    """One worker's row (a worker without a load reads as unreported)."""
    return _COLUMNS(load or UNREPORTED)


def load_rows(loads: Sequence[WorkerLoad | None]) -> np.ndarray:
    """One row per worker."""
    table = np.fromiter(chain.from_iterable(map(load_row, loads)), float)
    return table.reshape(len(loads), len(LOAD_FIELDS))  # zero rows for no workers


class LoadMap(dict[str, WorkerLoad]):
    """Replica id -> latest load, with each entry's row in :attr:`rows` (in the map's order) and
    :attr:`layout`, the keys in that order: one object shared by the successive maps of the same
    workers, so a reader that matched its candidates to a layout once reuses the match."""

    def __init__(self, loads: Iterable[tuple[str, WorkerLoad]], rows: np.ndarray | None = None,
                 layout: tuple[str, ...] | None = None) -> None:
        super().__init__(loads)
        self.layout = layout if layout is not None and len(layout) == len(self) else tuple(self)
        self.rows = rows if rows is not None else load_rows(list(self.values()))

    @classmethod
    def merged(cls, maps: Sequence[Mapping[str, WorkerLoad]]) -> LoadMap:
        """One map of several maps' loads (a sharded index's groups), their rows reused where
        they carry them (a replica in two: the later's load)."""
        items = [item for m in maps for item in m.items()]
        if not maps or len({k for k, _ in items}) < len(items):
            return cls(items)
        return cls(items, np.concatenate([  # no replica in two: the rows in order
            m.rows if isinstance(m, LoadMap) else load_rows(list(m.values())) for m in maps]))

    def positions(self, keys: Sequence[str]) -> np.ndarray:
        """Each key's row in :attr:`rows`; -1 where the map has no load for it."""
        at = {k: i for i, k in enumerate(self.layout)}
        return np.fromiter((at.get(k, -1) for k in keys), np.intp)


class LoadTable:
    """The rows of one index client's loads, one slot per worker id, written as loads arrive;
    :meth:`publish` makes the :class:`LoadMap` to hand out."""

    def __init__(self) -> None:
        self._slots: dict[int, int] = {}  # worker id -> row slot
        self._rows = np.zeros((0, len(LOAD_FIELDS)))
        # the last map's worker ids, replica ids and their slots, while the slots stay
        self._layout: tuple[tuple[int, ...], tuple[str, ...], np.ndarray] = (
            (), (), np.zeros(0, np.intp))

    def write(self, worker_id: int, load: WorkerLoad) -> None:
        slot = self._slots.setdefault(worker_id, len(self._slots))
        if slot == len(self._rows):  # full: doubled, so a fleet's first loads copy it ~log n times
            grown = np.zeros((max(16, 2 * slot), len(LOAD_FIELDS)))
            grown[:slot] = self._rows
            self._rows = grown
        self._rows[slot] = load_row(load)

    def forget(self, worker_ids: Iterable[int]) -> None:
        """Rows of workers gone; their slots are compacted away."""
        gone = set(worker_ids) & self._slots.keys()
        if gone:
            kept = [(w, s) for w, s in self._slots.items() if w not in gone]
            self._rows = self._rows[[s for _, s in kept]]
            self._slots = {w: i for i, (w, _) in enumerate(kept)}
            self._layout = ((), (), np.zeros(0, np.intp))

    def publish(self, loads: Mapping[int, tuple[str, WorkerLoad]]) -> LoadMap:
        """The map of ``loads`` (worker id -> replica id, load; every one written here), in its
        order."""
        ids, names = tuple(loads), tuple(name for name, _ in loads.values())
        if (ids, names) != self._layout[:2]:
            slots = np.fromiter(map(self._slots.__getitem__, ids), np.intp)
            self._layout = (ids, names, slots)
        return LoadMap(loads.values(), self._rows[self._layout[2]], self._layout[1])
