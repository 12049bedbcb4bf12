"""Each candidate's load, as one router's decisions read them: the index's, else the last one a
lookup carried (while fresh), else the replica's routing stats.

A lookup hands out the live workers' loads as one map per change (:class:`LoadMap`, with its
rows). A decision takes its candidates' rows from it with one array index, matched to the map's
layout once per change of workers, not per decision: at 1,000 workers, reading every load on
every decision cost a quarter of the decision.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields

import numpy as np

from prefixserve.router.decision_types import Candidate
from prefixserve.router.events import WorkerLoad
from prefixserve.router.load_table import LoadMap, load_row, load_rows

_FIELDS = {f.name for f in fields(WorkerLoad)}


@dataclass
class CandidateRows:
    """One decision's loads: a row per candidate, and each candidate's load."""

    rows: np.ndarray
    current: Mapping[str, WorkerLoad]  # the lookup's (or the last one, while fresh)
    # the candidates whose load is not the current map's: kept, stats, a match's, or None
    other: dict[str, WorkerLoad | None] = field(default_factory=dict)

    def of(self, key: str) -> WorkerLoad | None:
        other = self.other
        return other[key] if key in other else self.current.get(key)

    def put(self, i: int, key: str, load: WorkerLoad | None) -> None:
        """Candidate ``i`` (``key``) reads ``load`` instead."""
        self.rows[i] = load_row(load)
        self.other[key] = load


class CandidateLoads:
    """The loads one router's decisions read, kept between them."""

    def __init__(self, max_age_s: float) -> None:
        self.max_age_s = max_age_s
        self._current: Mapping[str, WorkerLoad] = {}  # the last lookup's map,
        self._current_at = -np.inf  # and when a lookup last carried it
        # replicas that left the maps since: their last load, and when it was last carried
        self._kept: dict[str, tuple[WorkerLoad, float]] = {}
        # the map layout and the candidate keys last matched, each candidate's row in the map's
        # rows, and the candidates the map has no load for
        self._matched: tuple[tuple[str, ...], Sequence[str], np.ndarray, list[int]] | None = None

    def take(self, loads: Mapping[str, WorkerLoad], now: float) -> None:
        """A lookup's map of every live worker's load, carried at ``now``."""
        old = self._current
        if loads is not old:
            same = isinstance(loads, LoadMap) and isinstance(old, LoadMap) and (
                loads.layout is old.layout)
            for gone in () if same else old.keys() - loads.keys():
                self._kept[gone] = (old[gone], self._current_at)
            self._current = loads
        self._current_at = now

    def read(self, candidates: Sequence[Candidate], keys: Sequence[str],
             now: float) -> CandidateRows:
        """Each candidate's row (``keys``: theirs, the same list object while they stay the
        same replicas)."""
        current = self._current if now - self._current_at <= self.max_age_s else {}
        if isinstance(current, LoadMap) and len(current):
            matched = self._matched
            if matched is None or matched[0] is not current.layout or matched[1] is not keys:
                positions = current.positions(keys)
                matched = (current.layout, keys, positions,
                           np.flatnonzero(positions < 0).tolist())
                self._matched = matched
            out = CandidateRows(current.rows[matched[2]], current)
            absent = matched[3]
        else:
            loads = [current.get(k) for k in keys]
            out = CandidateRows(load_rows(loads), current)
            absent = [i for i, load in enumerate(loads) if load is None]
        for i in absent:
            out.put(i, keys[i], self._last(candidates[i], now))
        return out

    def _last(self, candidate: Candidate, now: float) -> WorkerLoad | None:
        """A candidate's load outside the current map: kept while fresh, else its stats'."""
        kept = self._kept.get(candidate.key)
        if kept is not None and now - kept[1] <= self.max_age_s:
            return kept[0]
        raw = candidate.routing_stats.get("load")
        if isinstance(raw, dict):
            try:
                return WorkerLoad(**{k: v for k, v in raw.items() if k in _FIELDS})
            except TypeError:
                return None
        return None

