"""The routing core (router/decision.py): one decision's steps in one place, which the Serve
request router and the simulator both go through. Here without an index: the lookup source's
fail-open reasons, and a load-only decision end to end. With a real index, the simulator's
decisions equal a core's built as the Serve router builds it (test_simulate_cluster.py), and
Serve's decisions are the core's (test_routing_cluster.py)."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

from prefixserve.router.blocks import hash_chain, namespace
from prefixserve.router.decision import LookupAttempt, LookupSource, RoutingCore
from prefixserve.router.decision_types import Candidate
from prefixserve.router.index import WorkerInfo
from prefixserve.router.request import Expected
from prefixserve.router.router_settings import RouterSettings
from prefixserve.router.router_state import RouterState

ROOT = Path(__file__).resolve().parent.parent
# RouterState's steps of a decision: only the core calls them
STEPS = re.compile(r"\.(context|match|extend|rank|note_routed|outcome|sent|looked_up|"
                   r"lookup_failed)\(")


def core(prefix_routing: bool = True, compatible: bool = True) -> RoutingCore:
    state = RouterState(RouterSettings(fingerprint="fp", block_size=16,
                                       prefix_routing=prefix_routing))
    if compatible:
        state.gate.check_workers([WorkerInfo(1, "a", 1, 16, "fp", "")], [], now=0.0)
    return RoutingCore(state, LookupSource(state, None, None, deadline_s=0.02))


def test_the_serve_router_and_the_simulator_hold_no_copy_of_the_decision() -> None:
    for path in ("router/request_router.py", "bench/sim/router.py"):
        source = (ROOT / path).read_text()
        assert "RoutingCore(" in source and "LookupSource(" in source, path
        assert ".decide(" in source, path
        steps = [m.group(0) for m in STEPS.finditer(source) if "core." not in
                 source[max(0, m.start() - 12):m.start() + 1]]
        assert steps == [], f"{path} calls RouterState's steps itself: {steps}"


def test_the_lookup_source_says_why_it_fails_open() -> None:
    chain = hash_chain(list(range(32)), 16, namespace("fp"))
    assert asyncio.run(core().source.lookup(chain, 0.0)) == (None, LookupAttempt(None, "unset"))
    # prefix routing off: nothing asked and nothing counted
    assert asyncio.run(core(prefix_routing=False).source.lookup(chain, 0.0)) == (
        None, LookupAttempt(None, None))
    assert core().source.wait_s == 4 * 0.02


def test_a_load_only_decision_ranks_records_and_is_sent() -> None:
    c = core()
    tokens = list(range(64))
    candidates = [Candidate("a", queue_len=3), Candidate("b", queue_len=0)]
    decision = asyncio.run(c.decide(7, tokens, None, candidates, "r7", now=1.0))
    assert decision.key == 7 and decision.best == "b"  # the idle one, nothing cached anywhere
    assert decision.ranking.keys == ["b", "a"]
    assert decision.lookups == [LookupAttempt(None, "unset")]
    assert decision.hash_s > 0 and decision.rank_s > 0
    assert c.state.routed[7].worker == "b"  # recorded where it goes
    # what travels with it: the depth expected there, and that its lookup failed open
    assert c.state.expected(7, "a") == Expected(0, "failopen")
    # Serve sent it elsewhere: the outcome says so, and no index means no prediction
    outcome, prediction = c.sent(7, "a", "r7", now=1.1)
    assert outcome is not None and outcome.matched_blocks == 0 and outcome.spill is None
    assert prediction is None and c.state.routed[7].worker == "a"
    c.completed("a", "r7")
    assert 7 not in c.state.routed
