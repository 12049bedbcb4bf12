"""Which LoRA adapters each worker holds, as a router sees them, and what a request for one pays
where it is missing: the reports, this router's own sends, the prices, and the ranking they
change (pure: no Ray)."""

from __future__ import annotations

import pytest

from prefixserve.router.adapter_slots import AdapterSlots, SlotReport
from prefixserve.router.decision_types import Candidate
from prefixserve.router.policy import Fleet, PolicyConfig, WorkerView, rank
from prefixserve.router.router_settings import RouterSettings
from prefixserve.router.router_state import RouterState

MISS = 0.05


def report(*resident: str, max_loras: int = 2, load_s: float = 0.01, at: float = 10.0
           ) -> dict:
    return SlotReport(resident, max_loras, load_s, at).stats()


def test_a_report_round_trips_through_the_routing_stats() -> None:
    stats = {"worker": "w", **report("a@1", "b@2", max_loras=3, load_s=0.2, at=5.0)}
    assert SlotReport.of(stats) == SlotReport(("a@1", "b@2"), 3, 0.2, 5.0)


@pytest.mark.parametrize("raw", [
    None, "a@1", {"resident": ["a"], "max_loras": 2, "load_s": 0.1},  # no "at"
    {"resident": ["a"], "max_loras": "two", "load_s": 0.1, "at": 1.0},
    {"resident": 3, "max_loras": 2, "load_s": 0.1, "at": 1.0},
    {"resident": [], "max_loras": 0, "load_s": 0.1, "at": 1.0},
])
def test_a_malformed_report_is_no_report(raw: object) -> None:
    assert SlotReport.of({"loras": raw}) is None


def test_resident_adds_this_routers_sends_since_the_report_most_recent_last() -> None:
    slots = AdapterSlots()
    t = 1000.0  # the report's time
    slots.note("w", "b", now=t - 1)  # before the report, which holds it: the report tells
    slots.note("w", "c", now=t + 1)
    slots.note("w", "a", now=t + 2)
    got = slots.resident("w", SlotReport.of(report("a", "b", max_loras=3, at=t)), now=t + 3)
    assert got == ["b", "c", "a"]
    got = slots.resident("w", SlotReport.of(report("a", "b", max_loras=2, at=t)), now=t + 3)
    assert got == ["c", "a"]  # b was the least recently used: evicted
    assert slots.resident("w", None, now=t + 3) == ["a"]  # never reported: one slot
    assert slots.resident("w", None, now=t + 31) == ["a"]  # 29 s on: a send still counts
    assert slots.resident("w", None, now=t + 32) == ["a"]  # 30 s: still
    assert slots.resident("w", None, now=t + 33) == []  # past 30 s: forgotten
    assert slots.resident("other", None, now=t + 3) == []
    assert SlotReport.of(report("a", max_loras=1)).max_loras == 1


def test_a_report_that_lacks_a_send_overrules_it_only_5_s_after_it() -> None:
    """The request may not have reached the worker when the report was taken (the race that
    once sent a second adapter to the worker the first had just taken); a report taken 5 s or
    more after the send that still lacks the adapter means the worker has evicted it."""
    slots = AdapterSlots()
    slots.note("w", "x", now=100.0)
    for at, held in [(99.0, ["y", "x"]), (100.0, ["y", "x"]), (104.9, ["y", "x"]),
                     (105.0, ["y"]), (110.0, ["y"])]:
        got = slots.resident("w", SlotReport.of(report("y", max_loras=2, at=at)), now=at + 0.1)
        assert got == held, at
    got = slots.resident("w", SlotReport.of(report("x", "y", max_loras=2, at=101.0)), now=102.0)
    assert got == ["x", "y"]  # the report holds it: its order stands
    got = slots.resident("w", SlotReport.of(report("x", "y", max_loras=2, at=100.0)), now=101.0)
    assert got == ["x", "y"]  # likewise for a report taken as it was sent
    assert slots.resident("w", SlotReport.of(report("y", at=101.0)), now=130.5) == ["y"]


def test_old_sends_are_dropped_and_recent_ones_kept() -> None:
    slots = AdapterSlots()
    t = 1000.0
    slots.note("w", "stale", now=t)
    slots.note("w", "edge", now=t + 10)
    slots.note("w", "fresh", now=t + 40)  # the first send is 40 s old: the list is compacted
    assert [a for _, a in slots.sent["w"]] == ["edge", "fresh"]  # 30 s old: kept


def test_sends_are_bounded_per_worker() -> None:
    slots = AdapterSlots()
    for i in range(200):
        slots.note("w", f"a{i}", now=float(i) / 100)
    assert len(slots.sent["w"]) <= 65
    assert slots.sent["w"][-1] == (1.99, "a199")


def test_prices_free_where_held_else_the_load_at_least_the_miss_or_half_into_a_free_slot(
        ) -> None:
    slots = AdapterSlots()
    workers = [("held", report("x", "y")), ("free", report("y", load_s=0.01)),
               ("full", report("y", "z", load_s=0.01)), ("slow", report("y", "z", load_s=0.3)),
               ("slow-free", report(load_s=0.3)), ("silent", {})]
    assert slots.prices("x", workers, 11.0, MISS) == [0.0, MISS / 2, MISS, 0.3, 0.3, MISS / 2]
    slots.note("silent", "y", 11.0)  # its one assumed slot is taken now
    assert slots.prices("x", workers, 11.5, MISS)[-1] == MISS


def test_the_price_is_added_to_the_cost_and_can_outweigh_a_prefix() -> None:
    views = [WorkerView("prefix", confirmed_depth=1), WorkerView("adapter")]
    plain = Fleet.of(views)
    assert rank(40, plain, PolicyConfig())[0].key == "prefix"
    priced = Fleet(*[getattr(plain, f) for f in ("keys", "confirmed", "predicted", "loads",
                                                   "pending_tokens", "pending_requests",
                                                   "queue_len")], adapter_s=[MISS, 0.0])
    ranking = rank(40, priced, PolicyConfig())
    assert ranking[0].key == "adapter"
    assert ranking[1].cost_s - rank(40, plain, PolicyConfig())[0].cost_s == pytest.approx(MISS)
    with pytest.raises(ValueError, match="adapter_miss_s"):
        PolicyConfig(adapter_miss_s=-1.0)


def test_with_one_slot_each_adapter_keeps_to_the_worker_that_holds_it() -> None:
    """max_loras 1 on two idle workers: the first adapter takes one, the second the other
    (whose slot is free), and later requests for either go where it is held, whatever their
    prompt."""
    st = RouterState(RouterSettings(fingerprint="fp", block_size=16))
    workers = [Candidate("w1", report(max_loras=1, at=0.0)),
               Candidate("w2", report(max_loras=1, at=0.0))]
    where = {}
    for key, adapter in enumerate(["a@1", "b@2", "a@1", "b@2", "a@1", "b@2", "a@1"]):
        tokens = [key * 100 + i for i in range(40)]  # no prefix in common
        ctx = st.context(key, tokens, None, 1.0 + key, adapter)
        best = st.rank(key, ctx, workers, None, 1.0 + key)[0].key
        st.note_routed(key, best, ctx, f"r{key}", 1.0 + key)
        assert where.setdefault(adapter, best) == best, (key, adapter)
    assert set(where.values()) == {"w1", "w2"}
