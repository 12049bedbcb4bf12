"""The request router's pure state: contexts, bookkeeping, ranking inputs, fail-open, checks."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from prefixserve.router.blocks import Chain, hash_chain, namespace
from prefixserve.router.candidate_loads import CandidateRows
from prefixserve.router.chains import common_blocks, goes_past, shares_block
from prefixserve.router.decision_types import Candidate, Prediction, tie_key
from prefixserve.router.events import WorkerLoad
from prefixserve.router.in_flight import Routed
from prefixserve.router.index import LookupResult, WorkerInfo, WorkerMatch
from prefixserve.router.load_table import load_rows
from prefixserve.router.policy import PolicyConfig, WorkerView, rank, rendezvous
from prefixserve.router.predictions import LocalPredictions
from prefixserve.router.router_settings import RouterSettings
from prefixserve.router.router_state import RouterState

NS = namespace("fp")
TOKENS_A = list(range(16 * 6))
A = Chain.of(hash_chain(TOKENS_A, 16, NS))  # 6 blocks
B = Chain.of(hash_chain(list(range(16 * 4)) + [999] * 32, 16, NS))  # shares A's first 4 blocks
C = Chain.of(hash_chain([7] * 64, 16, NS))  # shares nothing
ONE = Chain.of(hash_chain(list(range(16)) + [7] * 48, 16, NS))  # shares A's first block only
ABC = [Candidate("a"), Candidate("b"), Candidate("c")]


def state(**kw) -> RouterState:
    settings = {"fingerprint": "fp", "block_size": 16}
    return RouterState(RouterSettings(**{**settings, **kw}))


def compatible_state(**kw) -> RouterState:
    st = state(**kw)
    st.gate.check_workers([WorkerInfo(1, "a", 1, 16, "fp", "")], [], now=0.0)
    assert st.gate.compatible
    return st


def lookup(**depths: int) -> LookupResult:
    ids = {"a": 1, "b": 2, "c": 3}
    return LookupResult({k: WorkerMatch(ids[k], k, d, d, None) for k, d in depths.items()},
                        worker_ids={k: ids[k] for k in depths})


def test_common_blocks() -> None:
    assert common_blocks(A, A) == 6
    assert common_blocks(A, B) == common_blocks(B, A) == 4
    assert common_blocks(A, C) == 0
    assert common_blocks(A, Chain()) == 0
    assert common_blocks(A, A[:3]) == 3
    assert common_blocks(A, B, lo=2) == 4  # lo: known equal before it, the search starts there
    assert common_blocks(A, A, lo=6) == 6


def test_goes_past() -> None:
    assert goes_past(A[:3], A) and goes_past(A[:1], B) and goes_past(A[:4], B)
    assert not goes_past(A, A) and not goes_past(A, A[:3])  # as long, or longer: not past
    assert not goes_past(A[:5], B) and not goes_past(C[:1], A)  # another block at its end
    assert not goes_past(Chain(), A)  # nothing to go past


def test_shares_block() -> None:
    assert shares_block(A, B, 3) and not shares_block(A, B, 4)
    assert shares_block(A, A, 5) and not shares_block(A, A, 6)  # past both ends
    assert not shares_block(A, A[:3], 3) and not shares_block(A[:3], A, 3)
    assert not shares_block(A, C, 0)


def test_local_depth_is_the_deepest_of_a_workers_chains_in_any_order() -> None:
    """Each worker's deepest chain counts, recorded before or after its shallower ones (a
    chain is passed over only when it cannot beat the depth found so far)."""
    cases = [([A, B[:5], A[:2]], 6), ([A[:2], B[:5], A], 6), ([B[:5], A[:2], A[:5]], 5)]
    for order, deepest in cases:
        local = LocalPredictions(ttl_s=2.0)
        for chain in order:
            local.record(chain, "w", now=0.0)
        local.record(B[:3], "v", now=0.0)
        local.record(ONE, "u", now=0.0)  # block 0 alone in common
        assert local.depths(A, now=1.0) == {"w": deepest, "v": 3, "u": 1}
        assert local.depths(B, now=1.0) == {"w": 5, "v": 3, "u": 1}


def test_local_predictions_give_consecutive_depth_and_expire() -> None:
    local = LocalPredictions(ttl_s=2.0)
    local.record(A, "w1", now=100.0)
    local.record(B[:5], "w2", now=100.5)
    assert local.depths(A, now=101.0) == {"w1": 6, "w2": 4}
    assert local.depths(B, now=101.0) == {"w1": 4, "w2": 5}
    assert local.depths(C, now=101.0) == {}
    assert local.depths(A, now=102.2) == {"w2": 4}  # w1's entries expired
    assert local.depths(A, now=103.0) == {}


def test_local_predictions_are_bounded() -> None:
    local = LocalPredictions(ttl_s=10.0, max_blocks=5)
    local.record(A[:3], "w1", now=0.0)
    local.record(C[:2], "w2", now=0.0)
    assert local.depths(A, now=1.0) == {"w1": 3} and local.num_blocks == 5
    local.record(B[:2], "w3", now=0.5)  # 7 blocks: the oldest chain goes
    assert local.depths(A, now=1.0) == {"w3": 2} and local.num_blocks == 4
    local.record(A, "w1", now=0.6)  # longer than the bound on its own: not kept
    assert local.depths(A, now=1.0) == {} and local.num_blocks == 0


def test_pending_work_shared_with_the_request_is_not_a_backlog() -> None:
    leader = Routed("w", 0.0, new_tokens=6 * 16 + 3, chain=A, start_block=0, internal_id="r")
    follower = Routed("w", 0.0, new_tokens=3, chain=A, start_block=6, internal_id="r")
    other = Routed("w", 0.0, new_tokens=64, chain=C, start_block=0, internal_id="r")
    # A request with A's prefix waits only for the leader's unshared tail.
    assert leader.unshared_tokens(A, 16) == 3
    assert follower.unshared_tokens(A, 16) == 3
    assert other.unshared_tokens(A, 16) == 64
    # B shares 4 of the leader's blocks: the other 2 blocks + tail are a real backlog.
    assert leader.unshared_tokens(B, 16) == 2 * 16 + 3
    # Shared only up to where a request starts: all of its prefill is a backlog.
    late = Routed("w", 0.0, new_tokens=35, chain=A, start_block=4, internal_id="r")
    assert late.unshared_tokens(B, 16) == 35
    assert late.unshared_tokens(A, 16) == 35 - 2 * 16
    earlier = Routed("w", 0.0, new_tokens=35, chain=A, start_block=3, internal_id="r")
    assert earlier.unshared_tokens(B, 16) == 35 - 16  # one block shared past its start
    assert Routed("w", 0.0, 7, A[:2], 5, "r").unshared_tokens(A, 16) == 7  # starts past its end


def test_context_hashes_once_with_the_tenant_namespace() -> None:
    st = state()
    ctx = st.context(1, TOKENS_A, None, now=0.0)
    assert ctx.chain == A and ctx.tie_key == b"" and ctx.num_prompt_tokens == 96
    assert st.context(1, [5] * 64, None, now=1.0) is ctx  # a retry: not hashed again
    salted = st.context(2, TOKENS_A, "tenant", now=0.0)
    assert salted.chain == hash_chain(TOKENS_A, 16, namespace("fp", "tenant")) != A


@pytest.mark.parametrize("kw", [{"fingerprint": None}, {"prefix_routing": False}])
def test_no_chain_without_fingerprint_or_prefix_routing(kw: dict) -> None:
    st = state(**kw)
    ctx = st.context(1, TOKENS_A, None, now=0.0)
    other = st.context(2, [1] * 96, None, now=0.0)
    assert ctx.chain == [] and len(ctx.tie_key) == 16
    assert ctx.tie_key != other.tie_key  # short or unhashed prompts still spread by content
    assert st.context(3, [], None, now=0.0).num_prompt_tokens == 1


def test_matching_stops_at_max_match_tokens() -> None:
    st = state(max_match_tokens=40)  # two and a half blocks: two are matched
    ctx = st.context(1, TOKENS_A, None, now=0.0)
    assert ctx.chain == A[:2] and ctx.num_prompt_tokens == 96  # the cost counts every token
    ranking = st.rank(1, ctx, ABC, lookup(a=2, b=0), now=0.0)
    assert ranking[0].key == "a" and ranking[0].uncached_tokens == 96 - 32
    assert state().settings.max_match_tokens == 131072
    with pytest.raises(ValueError):
        RouterSettings(max_match_tokens=0)
    capped = state(block_size=4, max_match_tokens=4 * 1000 + 3)  # 1,000 blocks of a longer one
    prompt = [(13 * i) % 9973 for i in range(4 * 3000)]
    whole = hash_chain(prompt[: 4 * 1000], 4, NS)
    first = capped.context(1, prompt, None, now=0.0)
    assert first.chain == whole[:256] and not first.complete  # the first hashing's budget
    capped.finish(first)
    assert first.chain == whole and first.complete  # the rest, up to the cap
    grown = capped.context(2, prompt[:-1], None, now=0.0)
    grown.chain = grown.chain[:300]  # as if hashed to 300 blocks, and held whole by some worker
    grown.complete = False
    assert capped.extend(grown, lookup(a=300), now=0.0)
    assert grown.chain == whole and grown.complete  # four times as many, but not past the cap


def test_contexts_hash_through_the_memo() -> None:
    st = state(block_size=4)
    assert st.memo.max_runs == 33_554_432 // (4 * 16) and st.memo.block_size == 4
    first = list(range(4 * 40))  # two runs of 16 blocks and 8 blocks more
    assert st.context(1, first, None, now=0.0).chain == hash_chain(first, 4, NS)
    nxt = first + [7] * 100  # a chat's next turn: the two runs are not hashed again
    assert st.context(2, nxt, None, now=0.0).chain == hash_chain(nxt, 4, NS)
    assert st.memo.hit_blocks == 32
    salted = st.context(3, nxt, "tenant", now=0.0).chain  # another namespace: no reuse
    assert salted == hash_chain(nxt, 4, namespace("fp", "tenant"))
    assert st.memo.hit_blocks == 32
    decided = st.context(4, nxt + [9] * 4 * 600, None, now=0.0)  # past the first hashing
    assert len(decided.chain) == 64 + 256 and not decided.complete  # 4 runs remembered, 256 new
    hits = st.memo.hit_blocks
    st.finish(decided)  # the rest resumes after the chain's whole runs: none is looked up
    assert decided.chain == hash_chain(nxt + [9] * 4 * 600, 4, NS)
    assert st.memo.hit_blocks == hits
    off = state(hash_memo_tokens=0)
    assert off.memo.max_runs == 0
    assert off.context(1, TOKENS_A, None, now=0.0).chain == A
    with pytest.raises(ValueError):
        RouterSettings(hash_memo_tokens=-1)


LONG = [(13 * i) % 9973 for i in range(4 * 12000)]  # 12,000 blocks of 4: past the first hashing
LONG_CHAIN = hash_chain(LONG, 4, NS)


def small_blocks_state() -> RouterState:
    st = state(block_size=4)
    st.gate.check_workers([WorkerInfo(1, "a", 1, 4, "fp", "")], [], now=0.0)
    return st


def test_a_long_prompt_is_hashed_as_far_as_a_match_may_reach() -> None:
    st = small_blocks_state()
    first = 1024 // 4  # _FIRST_HASH_TOKENS at 4-token blocks
    ctx = st.context(1, LONG, None, now=0.0)
    chain = ctx.chain
    assert chain == LONG_CHAIN[:first] and not ctx.complete
    assert not st.extend(ctx, None, now=0.0)  # nothing known reaches its end
    assert not st.extend(ctx, lookup(a=first - 1), now=0.0)
    assert st.extend(ctx, lookup(a=first), now=0.0)  # a worker holds all of it: hash 4x more
    assert ctx.chain is chain and chain == LONG_CHAIN[: 5 * first] and not ctx.complete
    assert st.extend(ctx, lookup(b=5 * first), now=0.0)
    assert chain == LONG_CHAIN[: 25 * first] and not ctx.complete
    assert st.extend(ctx, lookup(b=25 * first), now=0.0)
    assert chain == LONG_CHAIN and ctx.complete  # the rest, 12,000 blocks in all
    assert not st.extend(ctx, lookup(b=12000), now=0.0)  # complete: nothing more to hash


def test_match_looks_up_again_while_a_worker_holds_all_that_was_hashed() -> None:
    st = small_blocks_state()
    seen: list[int] = []

    async def holds_everything(chain: list[bytes]) -> LookupResult:
        seen.append(len(chain))
        return lookup(a=len(chain))

    ctx = st.context(1, LONG, None, now=0.0)
    result = asyncio.run(st.match(ctx, holds_everything, now=0.0))
    assert seen == [256, 1280, 6400, 12000] and ctx.complete  # 4x more each time, then the rest
    assert result is not None and result.matches["a"].confirmed_depth == 12000

    async def holds_the_first_half(chain: list[bytes]) -> LookupResult:
        seen.append(len(chain))
        return lookup(a=len(chain) // 2)

    seen.clear()
    st = small_blocks_state()  # a memo that has not seen LONG
    ctx = st.context(2, LONG, None, now=0.0)
    asyncio.run(st.match(ctx, holds_the_first_half, now=0.0))
    assert seen == [256] and not ctx.complete  # nobody reaches the end: one lookup

    async def unavailable(chain: list[bytes]) -> None:
        seen.append(len(chain))

    seen.clear()
    st = small_blocks_state()
    ctx = st.context(3, LONG, None, now=0.0)
    assert asyncio.run(st.match(ctx, unavailable, now=0.0)) is None
    assert seen == [256] and len(ctx.chain) == 256  # no answer: nothing to hash further for


def test_the_rest_is_hashed_after_the_decision_in_place() -> None:
    st = small_blocks_state()
    ctx = st.context(1, LONG, None, now=0.0)
    chain = ctx.chain
    st.looked_up(lookup(a=0))
    st.rank(1, ctx, ABC, lookup(a=0), now=0.0)
    st.note_routed(1, "a", ctx, "r1", now=0.0)
    assert st.local.num_blocks == len(chain) == 256
    prediction = st.sent(1, "a", "r1", now=0.0)
    assert chain == LONG_CHAIN and prediction == Prediction(LONG_CHAIN, 1, 0)
    assert st.routed[1].chain is chain  # what later requests share with it: all of it
    assert st.local.chains(now=0.0) == [LONG_CHAIN]
    st.local.chains(now=1e9)  # expired: the count it was recorded with comes off
    assert st.local.num_blocks == 0


@pytest.mark.parametrize("source", ["decided", "in flight"])
def test_this_routers_own_longer_chains_ask_for_more(source: str) -> None:
    st = small_blocks_state()
    first = st.context(1, LONG, None, now=0.0)
    st.rank(1, first, ABC, None, now=0.0)
    st.note_routed(1, "a", first, "r1", now=0.0)
    st.finish(first)
    if source == "in flight":
        st.local.chains(now=1e9)  # its local prediction expired; the request is still pending
        assert st.routed[1].chain == LONG_CHAIN
    else:
        st.completed("a", "r1")  # done: only this router's recent decision remembers it
        assert not st.routed and st.local.chains(now=0.0) == [LONG_CHAIN]
    again = st.context(2, LONG, None, now=0.0)
    assert again.chain == LONG_CHAIN  # the memo remembers what request 1 hashed
    other = st.context(3, LONG[:4 * 1100] + [1] * 4 * 3000, None, now=0.0)
    assert len(other.chain) < 4100 and not other.complete
    assert not st.extend(other, None, now=0.0)  # request 1's chain leaves it before its end
    cut = st.context(4, LONG[: 4 * 2000] + [5] * 4, None, now=0.0)
    cut.chain = cut.chain[:1100]  # as hashed at first: a prefix of request 1's chain
    cut.complete = False
    assert st.extend(cut, None, now=0.0)  # request 1's chain goes past it: more
    assert cut.chain == hash_chain(LONG[: 4 * 2000] + [5] * 4, 4, NS)


def test_stale_contexts_are_dropped_once_there_are_many() -> None:
    st = state()
    for key in range(4096):
        st.context(key, [1, 2], None, now=0.0)
    st.context(5000, [1, 2], None, now=30.0)
    assert len(st.contexts) == 4097  # nothing old enough yet
    st.context(5001, [1, 2], None, now=61.0)
    assert set(st.contexts) == {5000, 5001}


def test_rank_credits_the_index_and_records_the_depths() -> None:
    st = state()
    ctx = st.context(1, [*TOKENS_A, 1, 2, 3], None, now=0.0)
    ranking = st.rank(1, ctx, ABC, lookup(a=0, b=6, c=2), now=0.0)
    assert [s.key for s in ranking] == ["b", "c", "a"]
    assert ctx.confirmed == {"a": 0, "b": 6, "c": 2}
    assert {k: ctx.depth(k) for k in "abcz"} == {"a": 0, "b": 6, "c": 2, "z": 0}
    assert {k: ctx.new_tokens(k) for k in "abcz"} == {"a": 99, "b": 3, "c": 99 - 32, "z": 99}


def test_rank_prices_the_blocks_a_lookup_finds_below_a_pool() -> None:
    """Two workers hold the prefix; the lookup says one holds it on disk: the other goes
    first, and it flips when the lookup says the other's copy is the lower one."""
    st = state()
    for key, on_disk in enumerate(("b", "a")):
        ctx = st.context(key, [*TOKENS_A, 1, 2, 3], None, now=0.0)
        matches = dict(lookup(a=6, b=6).matches.items())
        matches[on_disk] = replace(matches[on_disk], lower_blocks=(0, 6))
        result = LookupResult(matches)
        ranking = st.rank(key, ctx, ABC, result, now=0.0)
        assert ranking[0].key == ("a" if on_disk == "b" else "b")
        assert ranking[0].cost_s < ranking[1].cost_s and ranking[1].key == on_disk


def test_ties_break_on_the_first_block_no_worker_holds() -> None:
    # Every worker holds a 2-block system prompt; what follows differs per conversation.
    system = list(range(32))
    views = [WorkerView(k, confirmed_depth=2) for k in "abc"]
    picks = set()
    for i in range(24):
        tokens = system + [1000 + i] * 32
        ctx = RouterState(RouterSettings(fingerprint="fp")).context(i, tokens, None, 0.0)
        assert tie_key(ctx, 2) == ctx.chain[2]  # past the shared prompt
        picks.add(rank(len(tokens), views, PolicyConfig(), tie_key(ctx, 2))[0].key)
    assert picks == {"a", "b", "c"}  # conversations spread instead of following block 0
    # nothing held: block 0 (a burst with one new prefix converges in every router)
    ctx = state().context(99, TOKENS_A, None, 0.0)
    assert tie_key(ctx, 0) == A[0]
    assert tie_key(ctx, 3) == A[3]
    assert tie_key(ctx, 6) == A[5]  # the whole chain held: its last block
    short = state().context(7, [1, 2, 3], None, 0.0)  # no chain: the token hash
    assert tie_key(short, 3) == short.tie_key


@pytest.mark.parametrize(("confirmed", "predicted", "deepest"), [(1, 3, 3), (4, 2, 4)])
def test_the_tie_key_is_the_block_past_the_deepest_match(confirmed: int, predicted: int,
                                                         deepest: int) -> None:
    st = state()
    ctx = st.context(1, TOKENS_A, None, now=0.0)
    others = [f"w{i}" for i in range(8)]
    result = LookupResult({"a": WorkerMatch(1, "a", confirmed, predicted, None)})
    ranking = st.rank(1, ctx, [Candidate(k) for k in ["a", *others]], result, now=0.0)
    # "a" holds the most; the rest tie, ordered by the hash of the first block no one holds
    assert ranking.keys == ["a", *sorted(others, key=lambda k: -rendezvous(A[deepest], k))]
    assert {k: ctx.depth(k) for k in ranking.keys} == {"a": deepest, **dict.fromkeys(others, 0)}
    assert {k: ctx.new_tokens(k) for k in ranking.keys} == {
        "a": 96 - 16 * deepest, **dict.fromkeys(others, 96)}


def test_own_decisions_count_until_the_index_knows() -> None:
    st = state()
    first = st.context(1, TOKENS_A, None, now=0.0)
    st.rank(1, first, ABC, None, now=0.0)
    st.note_routed(1, "c", first, "r1", now=0.0)
    second = st.context(2, TOKENS_A, None, now=0.1)
    ranking = st.rank(2, second, ABC, None, now=0.1)
    assert ranking[0].key == "c" and ranking[0].matched_blocks == 6  # the local prediction
    assert second.depth("c") == 6 and second.confirmed == {}
    later = st.context(3, TOKENS_A, None, now=5.0)
    assert st.rank(3, later, ABC, None, now=5.0)[0].matched_blocks == 0  # expired


def test_backlog_counts_only_requests_sent_after_the_reported_load() -> None:
    st = state()
    for key, at in ((1, 1.0), (2, 3.0)):
        ctx = st.context(key, [key] * 2000, None, now=at)
        st.note_routed(key, "a", ctx, f"r{key}", now=at)
    load = WorkerLoad(timestamp=2.0, prefill_tokens_per_s=4000.0)
    result = LookupResult({"a": WorkerMatch(1, "a", 0, 0, load)})
    ctx = st.context(9, [9] * 20, None, now=3.5)
    ranking = st.rank(9, ctx, [Candidate("a"), Candidate("b")], result, now=3.5)
    assert ranking[0].key == "b"  # a has request 2 (sent after its load) queued
    assert [r.internal_id for r in st.routed.on("a").values()] == ["r1", "r2"]
    assert not st.routed.on("b")
    late = st.context(3, [3] * 2000, None, now=2.0)
    st.note_routed(3, "a", late, "r3", now=2.0)  # as old as the load: the load covers it
    loads = CandidateRows(load_rows([load, None]), {"a": load})
    tokens, count = st.backlog(9, ctx.chain, {"a": 0, "b": 1}, loads)
    assert count == [1, 0] and tokens == [2000, 0]  # request 2 alone
    assert st.backlog(2, ctx.chain, {"a": 0, "b": 1}, loads) == ([0, 0], [0, 0])
    assert st.backlog(9, ctx.chain, {"b": 0}, loads) == ([0, 0], [0, 0])  # a is no candidate
    unknown = CandidateRows(load_rows([None]), {})  # no load: everything sent counts
    assert st.backlog(9, ctx.chain, {"a": 0}, unknown)[1] == [3]


def test_the_deeper_of_the_index_and_own_decisions_counts() -> None:
    st = state()
    for key, worker, tokens in ((1, "a", TOKENS_A[:48]), (2, "b", TOKENS_A)):
        sent = st.context(key, tokens, None, now=0.0)
        st.rank(key, sent, ABC, None, now=0.0)
        st.note_routed(key, worker, sent, f"r{key}", now=0.0)
    ctx = st.context(3, TOKENS_A, None, now=0.1)
    index = LookupResult({"a": WorkerMatch(1, "a", 1, 5, None),
                          "b": WorkerMatch(2, "b", 1, 2, None)})
    st.rank(3, ctx, ABC, index, now=0.1)
    # a: the index's 5 over its own 3; b: its own 6
    assert [ctx.depth(k) for k in "abc"] == [5, 6, 0]


def test_sent_records_the_truth_and_asks_for_a_prediction() -> None:
    st = compatible_state()
    ctx = st.context(1, TOKENS_A, None, now=0.0)
    st.looked_up(lookup(a=2, b=0))
    st.rank(1, ctx, ABC, lookup(a=2, b=0), now=0.0)
    st.note_routed(1, "a", ctx, "r1", now=0.0)
    # Serve sent it to b (a was full): the record moves, b gets the predicted entry.
    assert st.sent(1, "b", "r1", now=0.1) == Prediction(A, 2, 0)
    assert st.routed[1].worker == "b" and st.routed[1].start_block == 0
    assert st.local.depths(A, now=0.1) == {"a": 6, "b": 6}
    assert 1 not in st.contexts
    assert st.sent(1, "b", "r1", now=0.2) is None  # already handled


def test_a_cold_prefix_sent_to_a_non_holder_is_predicted_there() -> None:
    # A lookup matches only the chain's holders (none here) but names every live worker, so
    # the chosen worker's predicted entry is written and other routers follow it.
    st = compatible_state()
    load = WorkerLoad(num_running=5)
    result = LookupResult({}, 1, {"b": load}, {"a": 1, "b": 2})
    st.looked_up(result)
    ctx = st.context(1, TOKENS_A, None, now=0.0)
    ranking = st.rank(1, ctx, [Candidate("a"), Candidate("b")], result, now=0.0)
    assert ranking[0].key == "a"  # b's load comes from the lookup although b matched nothing
    assert st.loads.read([Candidate("b")], ["b"], now=1.0).of("b") == load  # and kept
    st.note_routed(1, "a", ctx, "r1", now=0.0)
    assert st.sent(1, "a", "r1", now=0.0) == Prediction(A, 1, 0)


def test_sent_to_the_first_choice_keeps_its_prediction_and_restamps_the_record() -> None:
    st = compatible_state()
    ctx = st.context(1, TOKENS_A, None, now=0.0)
    st.rank(1, ctx, ABC, lookup(a=2), now=0.0)
    st.note_routed(1, "a", ctx, "r1", now=0.0)
    assert st.sent(1, "a", "r1", now=0.5) is None  # a's worker id was never looked up
    assert st.routed[1].worker == "a" and st.routed[1].routed_at == 0.5
    assert st.routed[1].start_block == 2 and st.routed[1].new_tokens == 96 - 32
    assert st.local.depths(A, now=1.9) == {"a": 6}  # recorded once, at routing time


def test_no_prediction_when_unusable_unknown_or_fully_confirmed() -> None:
    st = compatible_state()
    st.looked_up(lookup(a=6))
    ctx = st.context(1, TOKENS_A, None, now=0.0)
    ctx.confirmed = {"a": 6}
    assert st.sent(1, "a", "r", now=0.0) is None  # the worker holds it all
    st.context(2, TOKENS_A, None, now=0.0)
    assert st.sent(2, "c", "r", now=0.0) is None  # no index worker id for c
    st.context(3, TOKENS_A, None, now=0.0)
    st.gate.lookup_failed(now=0.0)
    assert st.sent(3, "a", "r", now=0.5) is None  # in fail-open backoff


def test_completed_drops_only_the_matching_record() -> None:
    st = state()
    ctx = st.context(1, TOKENS_A, None, now=0.0)
    st.note_routed(1, "a", ctx, "shared", now=0.0)
    st.note_routed(2, "b", ctx, "shared", now=0.0)
    st.completed("b", "shared")
    assert set(st.routed) == {1}
    st.completed("b", "shared")
    st.completed("a", "other")
    assert set(st.routed) == {1}


def test_fail_open_gate_and_backoff() -> None:
    st = state(failopen_backoff_s=1.0)
    assert st.gate.lookup_blocked(0.0) == "unchecked" and not st.gate.usable(0.0)
    st.gate.check_workers([WorkerInfo(1, "a", 1, 32, "fp", "")], [], now=0.0)
    assert st.gate.lookup_blocked(0.0) == "incompatible"
    st.gate.check_workers([WorkerInfo(1, "a", 1, 16, "fp", "")], [], now=0.0)
    assert st.gate.lookup_blocked(0.0) is None and st.gate.usable(0.0)
    st.gate.lookup_failed(now=10.0)
    assert st.gate.lookup_blocked(10.9) == "backoff" and not st.gate.usable(10.9)
    assert st.gate.lookup_blocked(11.0) is None and st.gate.usable(11.0)
    assert not state(prefix_routing=False).gate.usable(0.0)


def test_check_adopts_the_fingerprint_and_reads_routing_stats() -> None:
    st = state(fingerprint=None)
    st.gate.check_workers([], [Candidate("a", {"block_size": 16, "fingerprint": "fp2"})], now=0.0)
    assert st.gate.fingerprint == "fp2" and st.gate.compatible
    st.gate.check_workers([], [Candidate("b", {"block_size": 8, "fingerprint": "fp2"})], now=1.0)
    assert st.gate.compatible is False  # a worker with another block size turns prefix routing off


def test_check_is_not_adopting_among_several_fingerprints() -> None:
    st = state(fingerprint=None)
    workers = [WorkerInfo(1, "a", 1, 16, "x", ""), WorkerInfo(2, "b", 1, 16, "y", "")]
    st.gate.check_workers(workers, [], now=0.0)
    assert st.gate.fingerprint is None and st.gate.compatible is False


def test_check_schedule() -> None:
    st = state(check_interval_s=30.0, failopen_backoff_s=1.0)
    assert st.gate.check_due(0.0) and not st.gate.check_due(29.9) and st.gate.check_due(30.0)
    st.gate.check_workers([], [], now=40.0)  # nobody registered yet: soon again
    assert st.gate.compatible is None and st.gate.next_check == 41.0
    st.gate.check_postponed(now=50.0)
    assert not st.gate.check_due(50.5) and st.gate.check_due(51.0)


def test_a_replica_offered_twice_is_ranked_twice() -> None:
    """Serve offers each replica once; twice, the ranking still covers every entry."""
    st = state()
    ctx = st.context(1, TOKENS_A, None, now=0.0)
    twice = [Candidate("a"), Candidate("b"), Candidate("a")]
    ranking = st.rank(1, ctx, twice, lookup(a=2), now=0.0)
    assert len(ranking) == 3 and ranking[0].key == "a"
