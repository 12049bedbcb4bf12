"""A router's columns: loads as the cost model reads them (router.load_table, each
candidate's load in router.candidate_loads) and a lookup's matches (router.index.Matches)."""

from __future__ import annotations

import numpy as np

from prefixserve.router.candidate_loads import CandidateLoads
from prefixserve.router.decision_types import Candidate
from prefixserve.router.events import WorkerLoad
from prefixserve.router.index import LookupResult, Matches, WorkerMatch
from prefixserve.router.load_table import LOAD_FIELDS, UNREPORTED, LoadMap, LoadTable, load_rows

A, B, C = (WorkerLoad(num_running=n, prefill_tokens_per_s=1000.0 * n) for n in (1, 2, 3))


def row(load: WorkerLoad | None) -> list[float]:
    return [float(getattr(load or UNREPORTED, f)) for f in LOAD_FIELDS]


def test_rows_follow_the_fields_and_read_no_load_as_unreported() -> None:
    assert load_rows([]).shape == (0, len(LOAD_FIELDS))
    assert load_rows([A, None]).tolist() == [row(A), row(None)]
    assert row(None)[LOAD_FIELDS.index("busy_share")] == 1.0


def test_a_table_publishes_each_workers_latest_row_in_the_maps_order() -> None:
    table = LoadTable()
    for wid, load in ((7, A), (3, B), (9, C)):
        table.write(wid, load)
    first = table.publish({3: ("b", B), 7: ("a", A)})
    assert dict(first) == {"b": B, "a": A} and first.layout == ("b", "a")
    assert first.rows.tolist() == [row(B), row(A)]
    table.write(7, C)
    second = table.publish({3: ("b", B), 7: ("a", C)})
    assert second.layout is first.layout  # the same workers: one layout object
    assert second.rows.tolist() == [row(B), row(C)]
    assert first.rows.tolist() == [row(B), row(A)]  # a published map never changes
    table.forget([3, 42])  # 42: never written
    assert sorted(table._slots) == [7, 9] and len(table._rows) >= 2  # 3's row is gone
    third = table.publish({7: ("a", C), 9: ("c", C)})
    assert third.layout == ("a", "c") and third.rows.tolist() == [row(C), row(C)]
    table.forget([7, 9])
    empty = table.publish({})  # nothing left: no rows, and positions that index none
    assert empty.rows.shape == (0, len(LOAD_FIELDS)) and len(empty) == 0
    assert table.publish({}).rows.shape == (0, len(LOAD_FIELDS))
    assert empty.rows[empty.positions([])].shape == (0, len(LOAD_FIELDS))
    for wid in range(20):  # grows past its first rows
        table.write(100 + wid, A)
    fourth = table.publish({100 + w: (f"w{w}", A) for w in range(20)})
    assert fourth.rows.tolist() == [row(A)] * 20


def test_a_map_without_rows_reads_them_and_merged_maps_keep_theirs() -> None:
    one, two = LoadMap([("a", A)]), LoadMap([("b", B), ("c", C)])
    assert one.rows.tolist() == [row(A)] and one.layout == ("a",)
    merged = LoadMap.merged([one, two, {"d": A}])
    assert merged.layout == ("a", "b", "c", "d")
    assert merged.rows.tolist() == [row(A), row(B), row(C), row(A)]
    twice = LoadMap.merged([one, LoadMap([("a", B)])])  # one replica in two maps: the later's
    assert dict(twice) == {"a": B} and twice.rows.tolist() == [row(B)]
    assert LoadMap.merged([]).rows.shape == (0, len(LOAD_FIELDS))
    assert merged.positions(["c", "x", "a"]).tolist() == [2, -1, 0]


def test_candidates_read_the_map_then_kept_loads_then_routing_stats() -> None:
    loads = CandidateLoads(max_age_s=10.0)
    stats = {"load": {"num_running": 7, "bogus": 1}}
    cands = [Candidate("a", stats), Candidate("b"), Candidate("c", {"load": "junk"})]
    keys = [c.key for c in cands]
    loads.take(LoadMap([("a", A), ("b", B)]), now=0.0)
    read = loads.read(cands, keys, now=0.0)
    assert [read.of(k) for k in keys] == [A, B, None]
    assert read.rows.tolist() == [row(A), row(B), row(None)]
    assert [loads.read(cands, keys, now=5.0).of(k) for k in keys] == [A, B, None]  # still fresh
    assert loads.read(cands, keys, now=10.0).of("b") == B  # as old as it may be
    too_old = loads.read(cands, keys, now=11.0)  # no lookup since: the stats' where they have one
    assert [too_old.of(k) for k in keys] == [WorkerLoad(num_running=7), None, None]
    first = LoadMap([("a", A), ("b", B)])
    loads.take(first, now=12.0)
    loads.take(LoadMap([("b", C)]), now=13.0)  # a left the index: its last load is kept
    read = loads.read(cands, keys, now=13.0)
    assert [read.of(k) for k in keys] == [A, C, None]
    assert read.rows.tolist() == [row(A), row(C), row(None)]
    assert loads.read(cands, keys, now=22.0).of("a") == A  # kept from when it was last carried
    loads.take(LoadMap([("b", C)]), now=23.0)
    assert loads.read(cands, keys, now=23.0).of("a") == WorkerLoad(num_running=7)  # kept too long


def test_candidates_match_a_new_layout_and_a_plain_map() -> None:
    loads = CandidateLoads(max_age_s=10.0)
    cands = [Candidate("a"), Candidate("b")]
    keys = ["a", "b"]
    loads.take(LoadMap([("b", B), ("a", A)]), now=0.0)
    assert loads.read(cands, keys, now=0.0).rows.tolist() == [row(A), row(B)]
    loads.take(LoadMap([("a", C), ("b", B)]), now=1.0)  # other order: matched again
    assert loads.read(cands, keys, now=1.0).rows.tolist() == [row(C), row(B)]
    other = ["b", "a"]  # other candidates' keys: matched again
    assert loads.read(cands[::-1], other, now=1.0).rows.tolist() == [row(B), row(C)]
    loads.take({"a": B}, now=2.0)  # a plain map (no rows): read per candidate
    read = loads.read(cands, keys, now=2.0)
    assert [read.of(k) for k in keys] == [B, B]  # b's from the map before, kept
    loads.take(LoadMap([]), now=3.0)  # an empty map
    assert loads.read(cands, keys, now=3.0).rows.tolist() == [row(B), row(B)]
    put = loads.read(cands, keys, now=3.0)
    put.put(0, "a", C)
    assert put.of("a") == C and put.rows[0].tolist() == row(C)
    assert isinstance(put.rows, np.ndarray)


def test_matches_are_columns_that_read_as_a_map_of_worker_matches() -> None:
    a = WorkerMatch(1, "a", 3, 5, A, (1, 2))
    b = WorkerMatch(2, "b", 4, 4, None)
    matches = Matches.of([a, b])
    assert matches.names == ["a", "b"] and matches.ids == [1, 2]
    assert matches.confirmed == [3, 4] and matches.predicted == [5, 4]
    assert matches.lower == {"a": (1, 2)} and matches.deepest == 5
    assert dict(matches) == {"a": a, "b": b} and len(matches) == 2 and "c" not in matches
    assert LookupResult({"a": a, "b": b}).matches == matches  # a dict is taken as columns
    assert Matches([], [], [], [], {}).deepest == 0
    shared = Matches(["b"], [2], [1], [1], {"b": B})  # loads read from the map given
    assert shared["b"].load == B and shared["b"].lower_blocks == (0, 0)


def test_candidates_are_matched_to_a_layout_once_while_it_and_they_stay() -> None:
    calls = []

    class Counted(LoadMap):
        def positions(self, keys):
            calls.append(tuple(keys))
            return super().positions(keys)

    loads = CandidateLoads(max_age_s=10.0)
    cands, keys = [Candidate("a"), Candidate("b")], ["a", "b"]
    first = Counted([("a", A), ("b", B)])
    loads.take(first, now=0.0)
    for now in (0.0, 1.0):
        assert loads.read(cands, keys, now).rows.tolist() == [row(A), row(B)]
    later = Counted([("a", C), ("b", B)], rows=load_rows([C, B]), layout=first.layout)
    loads.take(later, now=2.0)  # the same workers: the same layout object
    assert loads.read(cands, keys, now=2.0).rows.tolist() == [row(C), row(B)]
    assert calls == [("a", "b")]  # matched once
    loads.read(cands, ["a", "b"], now=2.0)  # another list of keys: matched again
    loads.take(Counted([("a", C), ("b", B)]), now=3.0)  # another layout: matched again
    loads.read(cands, keys, now=3.0)
    assert len(calls) == 3
