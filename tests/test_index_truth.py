"""How true the index was, judged by the worker a request reached: the router's expected depth
travels with the request (set as Serve chooses the replica), and the worker compares it with
the prefix its engine found, naming the cause when it is off by more than a block."""

from __future__ import annotations

import pytest

from prefixserve.router.blocks import hash_chain, namespace
from prefixserve.router.decision_types import Candidate
from prefixserve.router.events import AllBlocksCleared, BlockRemoved
from prefixserve.router.index import LookupResult, WorkerMatch
from prefixserve.router.request import Expected, GenerateRequest
from prefixserve.router.router_settings import RouterSettings
from prefixserve.router.router_state import RouterState
from prefixserve.workers.index_truth import IndexTruth

BS = 16
TOKENS = list(range(10 * BS + 3))  # 10 whole blocks and 3 tokens


def request(blocks: int, reason: str | None = None, salt: str | None = None,
            lora: str | None = None) -> GenerateRequest:
    req = GenerateRequest("r", TOKENS, cache_salt=salt, lora=lora)
    req.expected = Expected(blocks, reason)
    return req


@pytest.mark.parametrize(("expected", "found", "diff", "cause"), [
    (6, 6 * BS, 0, None),
    (6, 5 * BS, -1, None),  # one block off: within tolerance
    (6, 7 * BS + 5, 1, None),
    (6, 2 * BS, -4, "never_stored"),
    (2, 9 * BS, 7, "not_indexed"),  # the index had not seen them yet
    (6, 4 * BS, -2, "never_stored"),  # two blocks off: counted
    (40, 10 * BS, 0, None),  # capped at the blocks before the last token
])
def test_the_difference_and_its_cause(expected: int, found: int, diff: int,
                                      cause: str | None) -> None:
    truth = IndexTruth("fp", BS)
    assert truth.judge(request(expected), found) == (diff, cause)
    assert truth.judge(request(expected), found) == (diff, cause)
    assert truth.judged == 2
    assert sum(truth.off.values()) == 2 * (cause is not None)


@pytest.mark.parametrize(("length", "cap"), [(10 * BS, 9), (10 * BS + 1, 10), (10 * BS + 2, 10)])
def test_the_expectation_stops_before_the_block_of_the_last_token(length: int, cap: int) -> None:
    req = GenerateRequest("r", list(range(length)))
    req.expected = Expected(40)
    assert IndexTruth("fp", BS).judge(req, cap * BS) == (0, None)


def test_a_block_removed_here_is_evicted_in_the_namespace_of_its_salt_and_adapter() -> None:
    truth = IndexTruth("fp", BS)
    chain = hash_chain(TOKENS, BS, namespace("fp+lora:a@1", "t"))
    truth.on_events([BlockRemoved((chain[3],))])
    assert truth.judge(request(8, salt="t", lora="a@1"), 3 * BS) == (-5, "evicted")
    assert truth.judge(request(8, salt="t"), 3 * BS) == (-5, "never_stored")  # other namespace
    assert truth.judge(request(8, salt="t", lora="a@1"), 2 * BS) == (-6, "never_stored")
    assert truth.off == {"failopen": 0, "partial": 0, "serve": 0, "evicted": 1,
                         "never_stored": 2, "not_indexed": 0}


def test_the_routers_reason_comes_first_and_a_cleared_cache_evicted_everything() -> None:
    truth = IndexTruth("fp", BS, window=4)
    assert truth.judge(request(8, "failopen"), 0) == (-8, "failopen")
    assert truth.judge(request(0, "serve"), 8 * BS) == (8, "serve")
    assert truth.judge(request(0, "partial"), 4 * BS) == (4, "partial")
    digests = [bytes([i]) * 16 for i in range(6)]
    truth.on_events([BlockRemoved(tuple(digests[:3]))])
    truth.on_events([AllBlocksCleared()])
    assert truth.judge(request(8), 0) == (-8, "evicted")
    truth.on_events([BlockRemoved(tuple(digests[3:6]))])  # 3 removals since the clear
    assert truth.judge(request(8), 0) == (-8, "evicted")
    assert list(truth._removed) == digests[2:6]  # the window keeps the newest 4
    truth.on_events([BlockRemoved((b"\xff" * 16,))])  # a window's removals since the clear
    assert list(truth._removed) == [*digests[3:6], b"\xff" * 16]
    assert truth.judge(request(8), 0) == (-8, "never_stored")


def test_the_router_expects_its_credited_depth_and_says_why_it_may_be_off() -> None:
    st = RouterState(RouterSettings(fingerprint="fp", block_size=BS))
    ctx = st.context(1, TOKENS, None, 0.0)
    chain = ctx.chain
    matches = {"a": WorkerMatch(1, "a", 6, 6, None), "b": WorkerMatch(2, "b", 2, 2, None)}
    ranking = st.rank(1, ctx, [Candidate("a"), Candidate("b")],
                      LookupResult(matches, worker_ids={"a": 1, "b": 2}), 0.0)
    st.note_routed(1, ranking[0].key, ctx, "i1", 0.0)
    assert len(chain) == 10
    assert st.expected(1, "a") == Expected(6, None)
    assert st.expected(1, "b") == Expected(2, "serve")  # past the first choice
    ctx.unknown = frozenset({"b"})  # b's shard did not answer: its depth is a guess
    assert st.expected(1, "b") == Expected(2, "partial")
    assert st.expected(1, "a") == Expected(6, None)
    ctx.failopen = "timeout"
    assert st.expected(1, "a") == Expected(6, "failopen")
    st.sent(1, "a", "i1", 0.0)
    assert st.expected(1, "a") is None  # sent: its context is gone
