"""The routing cost model, exactly: config bounds, every Score field, tie-breaking rules."""

from __future__ import annotations

import hashlib
from dataclasses import fields, replace

import pytest

from prefixserve.router.events import WorkerLoad
from prefixserve.router.load_table import load_rows
from prefixserve.router.policy import (
    Fleet,
    PolicyConfig,
    Score,
    WorkerView,
    _weight,
    rank,
    reference_prefill_rate,
    rendezvous,
    score,
)

# block 16, prefill 4000/s, decode 1000/s, credit 0.95; uncached 2, decode 0.5, no eviction term
# (the formulas below are written for these; the eviction term has its own tests)
CFG = PolicyConfig(uncached_weight=2.0, eviction_weight=0.0)


def cached(view: WorkerView, prompt: int) -> float:
    """The expected cached tokens of one worker (its Score's; the reference rate plays no part)."""
    return score(view, prompt, CFG, 4000.0).cached_tokens


BAD_WEIGHTS = "uncached_weight must be >= 1, decode_weight and eviction_weight >= 0"


def ref_rendezvous(tie_key: bytes, worker_key: str) -> int:
    """BLAKE2b-64 of the key XOR that of the worker, through MurmurHash3's fmix64, in plain ints."""
    def b64(data: bytes) -> int:
        return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")

    z, mask = b64(tie_key) ^ b64(worker_key.encode()), 2**64 - 1
    z ^= z >> 33
    z = z * 0xFF51AFD7ED558CCD & mask
    z ^= z >> 33
    z = z * 0xC4CEB9FE1A85EC53 & mask
    return z ^ z >> 33


def test_weight_fields_carry_default_and_description() -> None:
    f = _weight(3.5, "how much")
    assert f.default == 3.5
    assert dict(f.metadata) == {"description": "how much"}
    described = {f.name: f.metadata.get("description") for f in fields(PolicyConfig)}
    assert described["uncached_weight"].startswith("Cost of an uncached prompt token")
    assert described["block_size"] is None
    defaults = PolicyConfig()
    assert (defaults.uncached_weight, defaults.eviction_weight, defaults.decode_weight) == (
        6.0, 0.5, 0.5)
    assert defaults.tie_tolerance_s == 0.001


@pytest.mark.parametrize(
    ("fields_", "message"),
    [
        ({"block_size": 0}, "block_size must be >= 1"),
        ({"default_prefill_tokens_per_s": 0.0}, "default rates must be > 0"),
        ({"default_decode_tokens_per_s": 0.0}, "default rates must be > 0"),
        ({"default_host_load_tokens_per_s": 0.0}, "default rates must be > 0"),
        ({"default_disk_load_tokens_per_s": -1.0}, "default rates must be > 0"),
        ({"predicted_credit": -0.01}, "predicted_credit must be in [0, 1]"),
        ({"predicted_credit": 1.01}, "predicted_credit must be in [0, 1]"),
        ({"uncached_weight": 0.99}, BAD_WEIGHTS),
        ({"decode_weight": -0.01}, BAD_WEIGHTS),
        ({"eviction_weight": -0.01}, BAD_WEIGHTS),
        ({"adapter_miss_s": -0.01}, "adapter_miss_s must be >= 0"),
    ],
)
def test_config_rejects_out_of_range(fields_: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError) as info:
        PolicyConfig(**fields_)
    assert str(info.value) == message


@pytest.mark.parametrize(
    "fields_",
    [
        {"block_size": 1},
        {"default_prefill_tokens_per_s": 0.5, "default_decode_tokens_per_s": 0.5},
        {"predicted_credit": 0.0},
        {"predicted_credit": 1.0},
        {"uncached_weight": 1.0, "decode_weight": 0.0, "eviction_weight": 0.0},
        {"uncached_weight": 1.5, "decode_weight": 0.5},
        {"adapter_miss_s": 0.0},
    ],
)
def test_config_accepts_the_bounds(fields_: dict[str, float]) -> None:
    config = PolicyConfig(**fields_)
    for name, value in fields_.items():
        assert getattr(config, name) == value


def test_a_rankings_entry_is_found_by_worker_key() -> None:
    ranking = rank(64, [WorkerView("a"), WorkerView("b", confirmed_depth=2, predicted_depth=3)],
                   CFG)
    assert ranking.keys == ["b", "a"] and ranking.deepest == 3
    assert ranking.of("b") == ranking[0] and ranking.of("a") == ranking[1]
    assert ranking.of("c") is None


def test_a_ranking_over_given_rows_is_the_ranking_over_the_loads() -> None:
    a, b = (WorkerLoad(num_running=n, prefill_tokens_per_s=1000.0 * n) for n in (1, 2))
    keys, loads = ["x", "y"], [b, a]
    fleet = Fleet(keys, [0, 2], [0, 2], loads, [0, 0], [0, 0], [0, 0])
    rows = load_rows(loads)
    given = Fleet(keys, [0, 2], [0, 2], (), [0, 0], [0, 0], [0, 0], rows=rows)
    assert [s.cost_s for s in rank(64, given, CFG)] == [s.cost_s for s in rank(64, fleet, CFG)]
    assert (rows == load_rows(loads)).all()  # ranking left the caller's rows as they were


def test_reference_rate_is_the_mean_of_measured_rates() -> None:
    views = [
        WorkerView("a", load=WorkerLoad(prefill_tokens_per_s=1000.0)),
        WorkerView("b", load=WorkerLoad(prefill_tokens_per_s=3000.0)),
        WorkerView("c", load=WorkerLoad()),  # unmeasured: left out
        WorkerView("d"),
    ]
    loads = [v.load for v in views]
    assert reference_prefill_rate(loads, CFG) == 2000.0
    assert reference_prefill_rate(loads[2:], CFG) == 4000.0
    assert reference_prefill_rate([], PolicyConfig(default_prefill_tokens_per_s=7.0)) == 7.0


def test_cached_tokens_credit_and_caps() -> None:
    view = WorkerView("a", confirmed_depth=2, predicted_depth=6)
    assert cached(view, 1000) == pytest.approx(16 * (2 + 0.95 * 4))
    assert cached(view, 40) == 39  # the last prompt token is always computed
    assert cached(WorkerView("a", confirmed_depth=3, predicted_depth=1), 1000) == 48
    assert cached(WorkerView("a"), 1) == 0.0


def test_score_without_load_report() -> None:
    view = WorkerView("w", confirmed_depth=1, predicted_depth=3, pending_prefill_tokens=400,
                      pending_requests=2, queue_len=1)
    s = score(view, 100, CFG, 4000.0)
    cached = 16 * (1 + 0.95 * 2)
    assert s == Score(
        key="w",
        cost_s=pytest.approx(400 / 4000 + 2 * (100 - cached) / 4000 + 0.5 * 2 / 1000),
        cached_tokens=pytest.approx(cached),
        uncached_tokens=pytest.approx(100 - cached),
        matched_blocks=3,
        new_tokens=100 - 48,
    )


def test_score_of_an_idle_unknown_worker_is_its_own_prefill_only() -> None:
    s = score(WorkerView("w"), 100, CFG, 5000.0)
    assert s.cost_s == pytest.approx(2 * 100 / 5000, rel=1e-12)
    assert (s.cached_tokens, s.uncached_tokens, s.matched_blocks, s.new_tokens) == (0, 100, 0, 100)


def test_score_with_load_report_adds_router_pending_work() -> None:
    load = WorkerLoad(num_running=3, queued_prefill_tokens=600, prefill_tokens_per_s=2000.0,
                      decode_tokens_per_s=1500.0)
    view = WorkerView("w", load=load, pending_prefill_tokens=200, pending_requests=2)
    s = score(view, 50, CFG, 4000.0)
    # queued at the worker's own rate; 3 running + 2 routed since; decode at its (higher) rate
    expected = (600 + 200) / 2000 + 2 * 50 / 4000 + 0.5 * (3 + 2) / 1500
    assert s.cost_s == pytest.approx(expected, rel=1e-12)
    # Serve's queue length is a floor on the running count
    floored = score(WorkerView("w", load=load, pending_requests=2, queue_len=9), 50, CFG, 4000.0)
    assert floored.cost_s == pytest.approx(600 / 2000 + 100 / 4000 + 0.5 * 9 / 1500, rel=1e-12)


def test_score_measured_decode_rate_is_floored_and_unmeasured_prefill_uses_reference() -> None:
    load = WorkerLoad(num_running=4, decode_tokens_per_s=10.0, queued_prefill_tokens=300)
    s = score(WorkerView("w", load=load), 20, CFG, 3000.0)
    assert s.cost_s == pytest.approx(300 / 3000 + 2 * 20 / 3000 + 0.5 * 4 / 1000, rel=1e-12)


@pytest.mark.parametrize(
    ("confirmed", "predicted", "prompt", "new_tokens"),
    [
        (0, 0, 100, 100),
        (2, 0, 100, 68),
        (2, 5, 100, 20),  # every predicted block is assumed to land
        (5, 2, 100, 20),
        (7, 0, 100, 1),  # a full match still recomputes the last token
        (6, 0, 97, 1),
        (6, 0, 98, 2),
        (1, 0, 1, 1),
    ],
)
def test_new_tokens(confirmed: int, predicted: int, prompt: int, new_tokens: int) -> None:
    view = WorkerView("w", confirmed_depth=confirmed, predicted_depth=predicted)
    assert score(view, prompt, CFG, 4000.0).new_tokens == new_tokens


def test_rendezvous_mixes_both_blake2b_64s() -> None:
    for tie_key, worker in [(b"", "a"), (b"prefix", "worker-1"), (b"\x00" * 16, "w"),
                            (b"\xff" * 16, "replica-\u00e9")]:
        assert rendezvous(tie_key, worker) == ref_rendezvous(tie_key, worker)
    assert rendezvous(b"ab", "c") != rendezvous(b"a", "bc")  # each is hashed on its own
    assert type(rendezvous(b"x", "a")) is int


def test_a_fleet_of_columns_ranks_as_its_views_do() -> None:
    views = [WorkerView("a", 1, 2, WorkerLoad(num_running=2, busy_share=0.5), 16, 1, 3),
             WorkerView("b", 0, 0, None, 0, 0, None), WorkerView("c", 3, 3)]
    rows = [("a", 1, 2, views[0].load, 16, 1, 3), ("b", 0, 0, None, 0, 0, 0),
            ("c", 3, 3, None, 0, 0, 0)]
    fleet = Fleet.of_rows(rows)
    assert fleet == Fleet.of(views)
    assert fleet.keys == ("a", "b", "c") and fleet.queue_len == (3, 0, 0)
    assert list(rank(100, fleet, CFG, b"k")) == list(rank(100, views, CFG, b"k"))
    assert rank(100, fleet, CFG, b"k").keys == ["c", "a", "b"]
    with pytest.raises(ValueError):
        Fleet.of_rows([rows[0], ("d", 0, 0)])
    empty = rank(10, Fleet.of_rows([]), CFG)
    assert len(empty) == 0 and list(empty) == [] and empty.keys == []


def test_a_measured_rate_below_one_token_a_second_is_still_measured() -> None:
    slow = WorkerView("w", load=WorkerLoad(queued_prefill_tokens=1, prefill_tokens_per_s=0.5))
    assert score(slow, 100, CFG, 4000.0).cost_s == pytest.approx(1 / 0.5 + 2 * 100 / 4000)


def test_rank_validates_prompt_length() -> None:
    assert [s.key for s in rank(1, [WorkerView("a")], CFG)] == ["a"]
    with pytest.raises(ValueError, match=r"^a request has at least one prompt token$"):
        rank(0, [WorkerView("a")], CFG)


def test_tied_workers_order_by_rendezvous_with_the_empty_default_key() -> None:
    workers = [WorkerView(f"w{i}") for i in range(8)]
    expected = sorted((w.key for w in workers), key=lambda k: -ref_rendezvous(b"", k))
    assert [s.key for s in rank(50, workers, CFG)] == expected
    keyed = sorted((w.key for w in workers), key=lambda k: -ref_rendezvous(b"k", k))
    assert [s.key for s in rank(50, workers, CFG, b"k")] == keyed


def test_cost_exactly_at_the_tolerance_ties_and_depth_wins() -> None:
    config = PolicyConfig(block_size=1, default_prefill_tokens_per_s=1.0,
                          default_decode_tokens_per_s=1.0, uncached_weight=1.0,
                          decode_weight=0.5, predicted_credit=0.0, tie_tolerance_s=0.5,
                          eviction_weight=0.0)
    # a: 10 s of prefill; b: the same plus one running sequence (0.5 s) and a predicted match
    # that is credited nothing but counts as depth
    a = WorkerView("a")
    b = WorkerView("b", predicted_depth=5, queue_len=1)
    ranking = rank(10, [a, b], config)
    assert [(s.key, s.cost_s) for s in ranking] == [("b", 10.5), ("a", 10.0)]
    # just past the tolerance, cost decides
    c = WorkerView("c", predicted_depth=5, queue_len=2)
    assert [s.key for s in rank(10, [a, c], config)] == ["a", "c"]


def test_room_term_weighs_uncached_tokens_by_how_full_the_pool_is() -> None:
    """Past its own prefill, an uncached token costs the rest of the weight in proportion to
    how full the pool is: the copy it adds displaces nothing in a pool with room."""
    config = PolicyConfig(uncached_weight=2.0, eviction_weight=0.25)
    # 10 empty blocks of 40 = 160 tokens of room in 640, 60 of it taken by queued and routed
    # work first: the pool is 1 - 100 / 640 full
    load = WorkerLoad(queued_prefill_tokens=40, prefill_tokens_per_s=4000.0, kv_empty_blocks=10,
                      kv_total_blocks=40)
    view = WorkerView("w", confirmed_depth=2, load=load, pending_prefill_tokens=20)
    s = score(view, 300, config, 4000.0)
    uncached = 300 - 32
    fill = 1 - 100 / 640
    # one prefill, and the rest of the weight (1 + 0.25 more) as full as the pool is
    assert s.cost_s == pytest.approx(
        60 / 4000 + (1 + 1.25 * fill) * uncached / 4000, rel=1e-12)
    # an empty pool: the tokens' own prefill only, however many tokens come
    empty = WorkerView("w", confirmed_depth=2,
                       load=WorkerLoad(kv_empty_blocks=100, kv_total_blocks=100))
    assert score(empty, 3000, config, 4000.0).cost_s == pytest.approx((3000 - 32) / 4000)
    # the smallest pool there is: one 1-token block, free
    tiny = replace(config, block_size=1)
    one = WorkerView("w", load=WorkerLoad(kv_empty_blocks=1, kv_total_blocks=1))
    assert score(one, 5, tiny, 4000.0).cost_s == pytest.approx(5 / 4000)
    # queued work beyond the room leaves none (never a negative room): a full pool
    full = WorkerView("w", load=WorkerLoad(queued_prefill_tokens=500, kv_empty_blocks=10,
                                           kv_total_blocks=40))
    assert score(full, 100, config, 4000.0).cost_s == pytest.approx(
        500 / 4000 + 2 * 100 / 4000 + 0.25 * 100 / 4000)
    # an unknown load, or empty blocks without the pool's size, is taken as a full pool
    full_cost = pytest.approx(2.25 * 100 / 4000)
    assert score(WorkerView("w"), 100, config, 4000.0).cost_s == full_cost
    sizeless = WorkerView("w", load=WorkerLoad(kv_empty_blocks=100))
    assert score(sizeless, 100, config, 4000.0).cost_s == full_cost


def test_an_emptier_worker_beats_a_fuller_one_holding_a_short_shared_prefix() -> None:
    # A new 30,000-token conversation after a 512-token system prompt: the holder's pool is half
    # full (room for all of it, so nothing would be evicted yet), the other worker's is empty
    # (it just started). The fuller pool will evict sooner, which outweighs the saved tokens.
    config = PolicyConfig()
    half = WorkerLoad(kv_empty_blocks=5000, kv_total_blocks=10_000)
    holder = WorkerView("holder", confirmed_depth=32, load=half)
    fresh = WorkerView("fresh", load=WorkerLoad(kv_empty_blocks=10_000, kv_total_blocks=10_000))
    assert rank(30_000, [holder, fresh], config)[0].key == "fresh"
    # with the room left out (every token weighed alike), the 512 saved tokens decide
    flat = PolicyConfig(uncached_weight=1.0, eviction_weight=0.0)
    assert rank(30_000, [holder, fresh], flat)[0].key == "holder"
    # and between two pools equally full, too
    both = [holder, WorkerView("other", load=half)]
    assert rank(30_000, both, config)[0].key == "holder"


def test_a_worker_with_room_takes_new_conversations_from_full_holders_of_their_prompt() -> None:
    """The trap at light load: the workers that cached a shared system prompt first would keep
    every new conversation (512 tokens saved, counted six times), the others would never get
    the prompt, and their pools would sit empty while the holders evict each other's
    conversations. A worker with room weighs the prompt's tokens at one prefill."""
    config = PolicyConfig()
    full = WorkerLoad(kv_empty_blocks=0, kv_total_blocks=10_000)
    holders = [WorkerView(f"holder{i}", confirmed_depth=32, load=full) for i in range(3)]
    empty = WorkerView("empty", load=WorkerLoad(kv_empty_blocks=10_000, kv_total_blocks=10_000))
    ranking = rank(700, [*holders, empty], config)
    assert ranking[0].key == "empty"
    assert ranking[0].cost_s == pytest.approx(700 / 4000)
    assert ranking[1].cost_s == pytest.approx(6.5 * (700 - 512) / 4000)
    # once it is as full as they are, the prompt's holders win again
    filled = WorkerView("empty", load=full)
    assert rank(700, [*holders, filled], config)[-1].key == "empty"


def test_untied_workers_rank_by_cost() -> None:
    workers = [WorkerView("a", queue_len=30), WorkerView("b", queue_len=10),
               WorkerView("c", queue_len=20)]
    assert [s.key for s in rank(16, workers, CFG)] == ["b", "c", "a"]


def test_a_tie_after_a_distinct_best_is_ordered_by_rendezvous() -> None:
    # "a" leads on depth; "b" and "c" tie on every key after it, so the hash orders them (here
    # against their order in the list)
    key = next(f"k{i}".encode() for i in range(100)
               if ref_rendezvous(f"k{i}".encode(), "c") > ref_rendezvous(f"k{i}".encode(), "b"))
    workers = [WorkerView("a", confirmed_depth=2), WorkerView("b"), WorkerView("c")]
    assert [s.key for s in rank(100, workers, CFG, key)] == ["a", "c", "b"]


def test_absurd_reported_counts_rank_last_and_break_nothing() -> None:
    huge = WorkerLoad(num_running=10**30, queued_prefill_tokens=10**30, kv_empty_blocks=10**30)
    near = WorkerLoad(num_running=2**63)  # past a signed 64-bit integer
    ranking = rank(100, [WorkerView("huge", load=huge), WorkerView("idle"),
                         WorkerView("near", load=near)], CFG)
    assert [s.key for s in ranking] == ["idle", "near", "huge"]
    assert ranking[2].cost_s == pytest.approx(10**30 / 4000 + 2 * 100 / 4000 + 0.5 * 10**30 / 1000)
    assert all(type(s.cost_s) is float and type(s.matched_blocks) is int for s in ranking)
    # a count past 64 bits where every other field is small (no column of Python ints to hide in)
    alone = WorkerLoad(num_running=10**30)
    assert rank(100, [WorkerView("alone", load=alone), WorkerView("idle")], CFG).keys == [
        "idle", "alone"]
