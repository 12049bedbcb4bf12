"""One routing decision, made the same way by the Serve request router and by the simulator.

A decision is :meth:`RoutingCore.decide`: the request's context (its hashed chain), the match
through a :class:`LookupSource` (this router's follower copy of the index while it is caught up,
else the index within the deadline, else a fail-open reason), the ranking, and the record of
where it goes. Once Serve has sent the request, :meth:`RoutingCore.sent` gives the outcome for the
metrics and the prediction to announce. Callers bring the candidates and the clock, and do the
metrics and the prediction's write; nothing here knows Serve.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from prefixserve.router.blocks import Chain
from prefixserve.router.decision_types import Candidate, Outcome, Prediction
from prefixserve.router.index import LookupResult, PrefixIndex, within
from prefixserve.router.index_follower import IndexFollower
from prefixserve.router.policy import Ranking
from prefixserve.router.router_state import RouterState

logger = logging.getLogger("ray.serve")

# A decision waits this many index-client deadlines for a round-trip lookup before it fails open.
LOOKUP_WAIT_DEADLINES = 4


@dataclass(frozen=True)
class LookupAttempt:
    """One lookup a decision made: where it was asked (``local``: the follower copy, ``index``:
    a round trip; None: nowhere), why it failed open (None: it was answered), how long it
    took when answered, and how many shards of a sharded index left their part unknown."""

    source: str | None
    failopen: str | None
    seconds: float = 0.0
    unknown_shards: int = 0


@dataclass
class Decision:
    """The ranking of one request's candidates (best first) and how it was reached."""

    key: int
    ranking: Ranking
    lookups: list[LookupAttempt] = field(default_factory=list)
    # by the core's clock: hashing the chain it starts with, the match (its lookups and any
    # further hashing), the ranking
    hash_s: float = 0.0
    match_s: float = 0.0
    rank_s: float = 0.0

    @property
    def best(self) -> str:
        return self.ranking[0].key


class LookupSource:
    """Where a decision's lookups are answered: the follower copy while it is ready, else the
    index within :data:`LOOKUP_WAIT_DEADLINES` of its client's ``deadline_s``; a slow or
    failing index fails open and backs off (the gate). ``index`` and ``follower`` may be set
    later, when the caller opens them."""

    def __init__(self, state: RouterState, index: PrefixIndex | None,
                 follower: IndexFollower | None, deadline_s: float,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.state = state
        self.index = index
        self.follower = follower
        self.wait_s = LOOKUP_WAIT_DEADLINES * deadline_s
        self.clock = clock  # times the answered lookups

    async def lookup(self, chain: Chain, now: float) -> tuple[LookupResult | None,
                                                              LookupAttempt]:
        state = self.state
        if not state.settings.prefix_routing:
            return None, LookupAttempt(None, None)
        if self.index is None:
            return None, LookupAttempt(None, "unset")
        reason = state.gate.lookup_blocked(now)
        if reason is not None:
            return None, LookupAttempt(None, reason)
        start = self.clock()
        follower = self.follower
        if follower is not None and follower.ready:
            result = follower.lookup(chain)
            source = "local"
        else:
            source = "index"
            try:
                result = await within(self.index.lookup(chain), self.wait_s)
            except Exception as exc:  # a timeout, IndexUnavailable, anything: serving goes on
                logger.debug("prefix index lookup failed: %r", exc)
                state.gate.lookup_failed(now)
                timeout = isinstance(exc, (asyncio.TimeoutError, TimeoutError))
                return None, LookupAttempt(source, "timeout" if timeout else "unavailable")
        state.looked_up(result)
        return result, LookupAttempt(source, None, self.clock() - start, result.unknown_shards)


class RoutingCore:
    """A router's decisions: :class:`RouterState`'s steps in their one order. ``clock`` times
    the steps (the wall clock; a benchmark of the router's own work may pass a CPU clock)."""

    def __init__(self, state: RouterState, source: LookupSource,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.state = state
        self.source = source
        self.clock = clock

    async def decide(self, key: int, tokens: Sequence[int], cache_salt: str | None,
                     candidates: Sequence[Candidate], internal_id: str, now: float,
                     adapter: str | None = None) -> Decision:
        """Rank ``candidates`` for request ``key`` (under LoRA adapter ``adapter``, its
        identity) and record the first as where it goes."""
        state, clock = self.state, self.clock
        start = clock()
        ctx = state.context(key, tokens, cache_salt, now, adapter)
        hashed = clock()
        attempts: list[LookupAttempt] = []

        async def lookup(chain: Chain) -> LookupResult | None:
            result, attempt = await self.source.lookup(chain, now)
            attempts.append(attempt)
            if result is not None and result.unknown:
                ctx.unknown |= result.unknown
            return result

        result = await state.match(ctx, lookup, now)
        ctx.failopen = next((a.failopen for a in attempts if a.failopen), None)
        matched = clock()
        ranking = state.rank(key, ctx, candidates, result, now)
        ranked = clock()
        state.note_routed(key, ranking[0].key, ctx, internal_id, now)
        return Decision(key, ranking, attempts, hashed - start, matched - hashed, ranked - matched)

    def sent(self, key: int, worker: str, internal_id: str,
             now: float) -> tuple[Outcome | None, Prediction | None]:
        """Serve sent request ``key`` to ``worker`` (maybe not the first choice): how it fares
        against its deepest match, and the predicted entry to announce, if any."""
        outcome = self.state.outcome(key, worker)
        return outcome, self.state.sent(key, worker, internal_id, now)

    def completed(self, worker: str, internal_id: str) -> None:
        self.state.completed(worker, internal_id)
