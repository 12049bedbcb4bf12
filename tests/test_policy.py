"""The pure routing policy on hand-built views: affinity, spill, no scatter, ties, fallbacks."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest

from prefixserve.router.events import WorkerLoad
from prefixserve.router.policy import PolicyConfig, WorkerView, rank, rendezvous, score

CFG = PolicyConfig(block_size=16, default_prefill_tokens_per_s=4000.0)


def cached(view: WorkerView, prompt: int) -> float:
    """The expected cached tokens of one worker (its Score's; the reference rate plays no part)."""
    return score(view, prompt, CFG, 4000.0).cached_tokens
PROMPT = 16 * 20 + 8  # a 20-block shared prefix plus an 8-token question


def load(running: int = 0, waiting: int = 0, queued: int = 0, rate: float = 4000.0) -> WorkerLoad:
    return WorkerLoad(
        num_running=running,
        num_waiting=waiting,
        queued_prefill_tokens=queued,
        prefill_tokens_per_s=rate,
        decode_tokens_per_s=1000.0,
    )


def choice(workers: list[WorkerView], prompt: int = PROMPT, key: bytes = b"k") -> str:
    return rank(prompt, workers, CFG, key)[0].key


def test_prefix_holder_wins_at_even_load() -> None:
    workers = [
        WorkerView("a", load=load(running=3)),
        WorkerView("b", confirmed_depth=20, load=load(running=3)),
        WorkerView("c", load=load(running=3)),
    ]
    ranking = rank(PROMPT, workers, CFG, b"k")
    assert ranking[0].key == "b"
    assert ranking[0].cached_tokens == 320
    assert ranking[0].matched_blocks == 20
    assert {s.key for s in ranking} == {"a", "b", "c"}


def test_no_scatter_under_small_load_differences() -> None:
    # The holder runs a few more sequences and has some queued prefill: still cheaper than
    # recomputing 320 tokens elsewhere, so the prefix is not scattered.
    workers = [
        WorkerView("a", confirmed_depth=20, load=load(running=6, queued=200)),
        WorkerView("b", load=load(running=2)),
        WorkerView("c", load=load(running=0)),
    ]
    assert choice(workers) == "a"


def test_hot_prefix_spills_when_holder_is_saturated_then_sticks_to_the_two() -> None:
    hot = [
        WorkerView("a", confirmed_depth=20, load=load(running=60, waiting=30, queued=9000)),
        WorkerView("b", load=load(running=2)),
        WorkerView("c", load=load(running=5)),  # 1.5 ms more decode work: past the tolerance
    ]
    assert choice(hot) == "b"  # spill to the least loaded, not collapse onto "a"
    # "b" now caches the prefix as well; "c" is slightly less loaded but has nothing cached:
    # requests go to the holders, not scattered to a third worker.
    after = [
        WorkerView("a", confirmed_depth=20, load=load(running=60, waiting=30, queued=9000)),
        WorkerView("b", confirmed_depth=20, load=load(running=8, queued=100)),
        WorkerView("c", load=load(running=3)),
    ]
    assert choice(after) == "b"
    # Once "a" drains, it gets the prefix back whenever it is the cheaper holder.
    drained = [
        WorkerView("a", confirmed_depth=20, load=load(running=1)),
        WorkerView("b", confirmed_depth=20, load=load(running=8, queued=100)),
        WorkerView("c", load=load(running=0)),
    ]
    assert choice(drained) == "a"


def test_one_imbalanced_worker_does_not_switch_affinity_off_for_others() -> None:
    # SGLang's gate: max - min > 64 and max > 1.5 * min -> shortest queue for EVERY request.
    # Worker "a" is far past that gate; a request whose prefix lives on "b" must still go to
    # "b", not to the emptiest worker "c".
    workers = [
        WorkerView("a", load=load(running=64, waiting=40, queued=20000)),
        WorkerView("b", confirmed_depth=20, load=load(running=4)),
        WorkerView("c", load=load(running=1)),
    ]
    assert choice(workers) == "b"
    # And the overloaded worker is last for a cold request.
    assert rank(PROMPT, workers, CFG, b"cold")[-1].key == "a"


def test_death_spiral_does_not_form_under_sustained_imbalance() -> None:
    # Four prefix families each held by one worker; worker "w0" is overloaded. Route each
    # family's next request: only w0's own family may move, the others keep their holders.
    families = {f"p{i}": f"w{i}" for i in range(4)}
    moved = {}
    for prefix, holder in families.items():
        workers = [
            WorkerView(
                f"w{i}",
                confirmed_depth=20 if f"w{i}" == holder else 0,
                load=load(running=90, waiting=50, queued=30000) if i == 0 else load(running=i),
            )
            for i in range(4)
        ]
        moved[prefix] = choice(workers, key=prefix.encode())
    assert moved["p1"] == "w1" and moved["p2"] == "w2" and moved["p3"] == "w3"
    assert moved["p0"] != "w0"


def test_predicted_depth_is_credited_but_discounted() -> None:
    # predicted_depth counts confirmed OR predicted blocks (>= confirmed_depth)
    assert cached(WorkerView("a", predicted_depth=10), 1000) == pytest.approx(152.0)
    assert cached(WorkerView("a", confirmed_depth=4, predicted_depth=10), 1000) == (
        pytest.approx(64 + 0.95 * 96)
    )
    # A predicted prefix beats no prefix at all ...
    workers = [WorkerView("a", predicted_depth=20), WorkerView("b")]
    assert choice(workers) == "a"
    # ... but a confirmed one of the same depth beats a predicted one.
    workers = [WorkerView("a", predicted_depth=20), WorkerView("b", confirmed_depth=20)]
    assert choice(workers) == "b"


def test_last_prompt_token_is_never_counted_as_cached() -> None:
    full = WorkerView("a", confirmed_depth=4)
    assert cached(full, 64) == 63
    assert rank(64, [full], CFG)[0].uncached_tokens == 1


def test_backlogs_drain_at_each_workers_rate_unmeasured_ones_at_the_mean() -> None:
    unmeasured = WorkerView("a", load=WorkerLoad(queued_prefill_tokens=1000))
    slow = WorkerView("b", load=load(queued=1000, rate=500.0))
    fast = WorkerView("c", load=load(queued=1000, rate=8000.0))
    ranking = rank(400, [unmeasured, slow, fast], CFG)
    costs = {s.key: s.cost_s for s in ranking}
    mean = (500.0 + 8000.0) / 2
    own = (CFG.uncached_weight + CFG.eviction_weight) * 400  # no room reported: it evicts
    assert costs["a"] == pytest.approx((1000 + own) / mean)
    assert costs["b"] == pytest.approx(1000 / 500 + own / mean)
    assert [s.key for s in ranking] == ["c", "a", "b"]
    # With no measurement anywhere the configured default applies.
    alone = rank(400, [WorkerView("a", load=WorkerLoad(queued_prefill_tokens=1000))], CFG)
    assert alone[0].cost_s == pytest.approx((1000 + own) / 4000)


def test_rate_measurement_noise_does_not_decide_routes_at_idle() -> None:
    # Identical idle workers whose measured rates differ by noise: cold prefixes still spread.
    workers = [WorkerView("a", load=load(rate=9000.0)), WorkerView("b", load=load(rate=11000.0))]
    picks = Counter(choice(workers, key=f"p{i}".encode()) for i in range(64))
    assert set(picks) == {"a", "b"}


def test_router_local_pending_work_counts_until_reported() -> None:
    # Two routed-but-unreported prefills on "a" make it lose a cold request to "b".
    workers = [
        WorkerView("a", load=load(), pending_prefill_tokens=2 * PROMPT, pending_requests=2),
        WorkerView("b", load=load()),
    ]
    assert choice(workers, key=b"x") == "b"
    assert choice(workers, key=b"y") == "b"


def test_load_only_fallback_uses_serve_queue_length() -> None:
    workers = [
        WorkerView("a", queue_len=5),
        WorkerView("b", queue_len=1),
        WorkerView("c", queue_len=9),
    ]
    assert [s.key for s in rank(PROMPT, workers, CFG)] == ["b", "a", "c"]


def test_ties_are_deterministic_spread_over_prefixes_and_order_independent() -> None:
    workers = [WorkerView(f"w{i}", load=load(running=2)) for i in range(4)]
    picks = Counter()
    for i in range(200):
        key = f"prefix-{i}".encode()
        first = choice(workers, key=key)
        assert choice(list(reversed(workers)), key=key) == first
        assert choice(workers, key=key) == first
        picks[first] += 1
    assert set(picks) == {"w0", "w1", "w2", "w3"}
    assert min(picks.values()) > 20  # roughly even, not always the same worker


def test_tie_tolerance_absorbs_load_noise_but_not_real_differences() -> None:
    key = next(f"k{i}".encode() for i in range(100) if rendezvous(f"k{i}".encode(), "a") >
               rendezvous(f"k{i}".encode(), "b"))
    # "a" wins the hash; one extra running sequence on "a" (1 ms) is noise ...
    noisy = [WorkerView("a", load=load(running=1)), WorkerView("b", load=load(running=0))]
    assert choice(noisy, key=key) == "a"
    # ... a real backlog is not.
    busy = [WorkerView("a", load=load(queued=2000)), WorkerView("b", load=load())]
    assert choice(busy, key=key) == "b"


def test_ties_go_to_the_least_busy_worker_then_the_hash() -> None:
    key = next(f"k{i}".encode() for i in range(100) if rendezvous(f"k{i}".encode(), "a") >
               rendezvous(f"k{i}".encode(), "b"))
    idle = [WorkerView(k, load=WorkerLoad(busy_share=s)) for k, s in (("a", 0.6), ("b", 0.2))]
    assert choice(idle, key=key) == "b"  # "a" wins the hash but has worked more lately
    idle = [WorkerView(k, load=WorkerLoad(busy_share=s)) for k, s in (("a", 0.2), ("b", 0.6))]
    assert choice(idle, key=key) == "a"
    # a deeper match still comes first, and a real cost difference is no tie
    deeper = [WorkerView("a", 3, 3, WorkerLoad(busy_share=0.9)),
              WorkerView("b", 2, 2, WorkerLoad(busy_share=0.0))]
    assert choice(deeper, prompt=24, key=key) == "a"
    queued = [WorkerView("a", load=WorkerLoad(busy_share=0.0, queued_prefill_tokens=400)),
              WorkerView("b", load=WorkerLoad(busy_share=0.9))]
    assert choice(queued, key=key) == "b"


@pytest.mark.parametrize("backlog", [
    {"load": WorkerLoad(busy_share=0.2, num_waiting=1)},
    {"load": WorkerLoad(busy_share=0.2, queued_prefill_tokens=1)},
    {"load": WorkerLoad(busy_share=0.2), "pending_requests": 1},
    {},  # no load known
])
def test_busy_share_orders_only_ties_between_workers_with_nothing_waiting(backlog) -> None:
    # Where work waits, the queues decide (a saturated worker's share says nothing more):
    # "b" counts as fully busy and the tie falls to the idle "a" although "a" worked more.
    config = PolicyConfig(block_size=16, tie_tolerance_s=10.0)
    workers = [WorkerView("a", load=WorkerLoad(busy_share=0.6)), WorkerView("b", **backlog)]
    key = next(f"k{i}".encode() for i in range(100) if rendezvous(f"k{i}".encode(), "b") >
               rendezvous(f"k{i}".encode(), "a"))
    assert rank(PROMPT, workers, config, key)[0].key == "a"
    idle = [workers[0], WorkerView("b", load=WorkerLoad(busy_share=0.2))]
    assert rank(PROMPT, idle, config, key)[0].key == "b"
    # a waiting queue counts as fully busy, no more: against a fully busy idle worker (a share
    # is at most 1, whatever a report says) the hash decides
    full = [WorkerView("a", load=WorkerLoad(busy_share=3.0)), WorkerView("b", **backlog)]
    assert rank(PROMPT, full, config, key)[0].key == "b"
    other = next(f"k{i}".encode() for i in range(100) if rendezvous(f"k{i}".encode(), "a") >
                 rendezvous(f"k{i}".encode(), "b"))
    assert rank(PROMPT, full, config, other)[0].key == "a"


def test_rank_rejects_empty_prompt_and_handles_no_workers() -> None:
    assert list(rank(10, [], CFG)) == []
    with pytest.raises(ValueError):
        rank(0, [WorkerView("a")], CFG)
    with pytest.raises(ValueError):
        PolicyConfig(predicted_credit=1.5)


def test_a_prefix_is_priced_by_the_tier_that_holds_it() -> None:
    """Three workers at equal load: one holds the prefix in its pool, one on disk, one not at
    all. The pool's copy is free, the disk's costs its load at the worker's measured rate,
    recomputing costs the weighted prefill: the ranking follows those costs."""
    disk_rate = 8000.0  # tokens a second, as the worker measured its loads
    workers = [
        WorkerView("none", load=load(running=2)),
        WorkerView("disk", confirmed_depth=20, lower_blocks=(0, 20),
                   load=replace(load(running=2), disk_load_tokens_per_s=disk_rate)),
        WorkerView("pool", confirmed_depth=20, load=load(running=2)),
    ]
    ranking = rank(PROMPT, workers, CFG, b"k")
    assert [s.key for s in ranking] == ["pool", "disk", "none"]
    cost = {s.key: s.cost_s for s in ranking}
    assert cost["disk"] - cost["pool"] == pytest.approx(320 / disk_rate)
    assert cost["none"] - cost["pool"] == pytest.approx(
        CFG.uncached_weight * 320 / 4000.0 + CFG.eviction_weight * 320 / 4000.0)
    # the disk worker's cached tokens are still cached: its prefill is the question only
    assert ranking[1].cached_tokens == 320 and ranking[1].uncached_tokens == PROMPT - 320


def test_host_blocks_load_at_the_host_rate_and_unmeasured_rates_default() -> None:
    half = WorkerView("half", confirmed_depth=20, lower_blocks=(5, 5), load=load())
    pool = WorkerView("pool", confirmed_depth=20, load=load())
    cost = {s.key: s.cost_s for s in rank(PROMPT, [half, pool], CFG, b"k")}
    assert cost["half"] - cost["pool"] == pytest.approx(
        80 / CFG.default_host_load_tokens_per_s + 80 / CFG.default_disk_load_tokens_per_s)
    # blocks below the pool past the cached tokens (the last prompt token is computed) do not
    # cost: a 3-block prompt caches 2 blocks, both on disk here
    short = WorkerView("short", confirmed_depth=3, lower_blocks=(0, 3), load=load())
    (s,) = rank(48, [short], CFG, b"k")
    assert s.cached_tokens == 47
    bare = rank(48, [WorkerView("short", confirmed_depth=3, load=load())], CFG, b"k")[0]
    assert s.cost_s - bare.cost_s == pytest.approx(47 / CFG.default_disk_load_tokens_per_s)


def test_measured_load_rates_price_each_tier_and_the_cap_falls_on_the_disk_tail() -> None:
    # measured rates, even below one token a second, are the worker's own (0 means unmeasured)
    slow = replace(load(), host_load_tokens_per_s=0.5, disk_load_tokens_per_s=0.25)
    # 2 host blocks then 3 disk blocks, but a 70-token prompt caches 69 tokens: the host's 32
    # and 37 of the disk's 48
    capped = WorkerView("capped", confirmed_depth=5, lower_blocks=(2, 3), load=slow)
    bare = WorkerView("capped", confirmed_depth=5, load=slow)
    (s,) = rank(70, [capped], CFG, b"k")
    (b,) = rank(70, [bare], CFG, b"k")
    assert s.cached_tokens == b.cached_tokens == 69
    assert s.cost_s - b.cost_s == pytest.approx(32 / 0.5 + 37 / 0.25)
    measured = replace(load(), host_load_tokens_per_s=100_000.0)
    on_host = WorkerView("host", confirmed_depth=5, lower_blocks=(5, 0), load=measured)
    (h,) = rank(70, [on_host], CFG, b"k")
    (p,) = rank(70, [WorkerView("host", confirmed_depth=5, load=measured)], CFG, b"k")
    assert h.cost_s - p.cost_s == pytest.approx(69 / 100_000.0)
