"""What the prefix-aware request router knows and decides, without Ray and without I/O.

:class:`RouterState` holds one router's bookkeeping: each pending request's hashed chain, what
it routed and where (:mod:`router.in_flight`), its own recent decisions
(:mod:`router.predictions`), the last loads it saw, which LoRA adapters each worker holds
(:mod:`router.adapter_slots`) and whether the index may be used (:mod:`router.index_gate`).
From that and an index lookup it builds the fleet's columns (:class:`router.policy.Fleet`)
and ranks them. :mod:`router.request_router` only adapts Serve's
calls to it and does the index I/O, so every decision here is testable on plain values.
"""

from __future__ import annotations

import hashlib
import logging
import struct
from collections.abc import (
    Awaitable,
    Callable,
    Mapping,
    Sequence,
)
from itertools import repeat

import numpy as np

from prefixserve.router.adapter_slots import AdapterSlots
from prefixserve.router.adapters import adapter_fingerprint
from prefixserve.router.blocks import Chain, ChainMemo, namespace
from prefixserve.router.candidate_loads import CandidateLoads, CandidateRows
from prefixserve.router.chains import goes_past
from prefixserve.router.decision_types import (
    Candidate,
    Outcome,
    Prediction,
    RequestContext,
    tie_key,
)
from prefixserve.router.in_flight import InFlight, Routed
from prefixserve.router.index import IndexSettings, LookupResult
from prefixserve.router.index_gate import IndexGate
from prefixserve.router.policy import Fleet, Ranking, rank
from prefixserve.router.predictions import LocalPredictions
from prefixserve.router.request import Expected
from prefixserve.router.router_settings import RouterSettings

logger = logging.getLogger("ray.serve")

_MAX_CONTEXTS = 4096  # past this, contexts of requests cancelled before routing are dropped
_CONTEXT_MAX_AGE_S = 60.0
# A decision hashes the prompt's remembered blocks and this many tokens more at first (extend()
# adds more where some worker may hold them all): a long prompt no one holds costs little.
_FIRST_HASH_TOKENS = 1024
_MAX_ROUTED = 10_000  # past this, records of requests Serve never sent are dropped
_ROUTED_MAX_AGE_S = 600.0


class RouterState:
    """One router's bookkeeping and decisions; requests are keyed by a caller-chosen int."""

    def __init__(self, settings: RouterSettings, index: IndexSettings | None = None) -> None:
        self.settings = settings
        self.gate = IndexGate(settings)  # compatibility and fail-open backoff
        self.local = LocalPredictions((index or IndexSettings()).predict_ttl_s)
        self.contexts: dict[int, RequestContext] = {}
        self.routed = InFlight()
        self.loads = CandidateLoads(settings.load_max_age_s)  # what the ranking reads
        self._keys: list[str] = []  # the last candidates' keys, and each one's index
        self._at: Mapping[str, int] = {}
        self.worker_ids: Mapping[str, int] = {}  # replica -> index worker id (the lookup's)
        self.adapters = AdapterSlots()  # which LoRA adapters each worker holds in its slots
        run_tokens = settings.block_size * ChainMemo.RUN_BLOCKS
        self.memo = ChainMemo(settings.block_size, settings.hash_memo_tokens // run_tokens)
        self._first_blocks = max(1, _FIRST_HASH_TOKENS // settings.block_size)

    # -------------------------------------------------------------------------- requests

    def context(
        self, key: int, tokens: Sequence[int], cache_salt: str | None, now: float,
        adapter: str | None = None,
    ) -> RequestContext:
        """The request's context, made (and its chain hashed, under its LoRA adapter's
        fingerprint when it has one) on first use."""
        ctx = self.contexts.get(key)
        if ctx is not None:
            return ctx
        chain = Chain()
        matched: Sequence[int] = ()
        limit = self.settings.max_match_tokens
        ns = b""
        if self.settings.prefix_routing and self.gate.fingerprint is not None:
            matched = tokens
            ns = namespace(adapter_fingerprint(self.gate.fingerprint, adapter), cache_salt)
            chain = self.memo.chain(matched, ns, budget=self._first_blocks, limit=limit)
        spread = b""  # a chain's tie key depends on the lookup (see tie_key())
        if not chain:  # shorter than a block (or no fingerprint yet): nothing cacheable, spread
            spread = hashlib.blake2b(
                struct.pack(f"<{min(len(tokens), 64)}I", *tokens[:64]), digest_size=16
            ).digest()
        full = min(len(matched), limit) // self.settings.block_size
        ctx = RequestContext(chain, spread, max(1, len(tokens)), now, matched, ns,
                             len(chain) == full, adapter=adapter)
        self.contexts[key] = ctx
        if len(self.contexts) > _MAX_CONTEXTS:
            for stale in [k for k, c in self.contexts.items()
                          if now - c.created_at > _CONTEXT_MAX_AGE_S]:
                del self.contexts[stale]
        return ctx

    def extend(self, ctx: RequestContext, result: LookupResult | None, now: float) -> bool:
        """Hash more of the prompt when some worker may hold every block hashed so far (the
        index's matches, this router's recent decisions, its requests in flight): True means
        the chain grew and the lookup must be made again. Ranking a chain that ends before
        every match does would miss what the deeper matches save."""
        chain = ctx.chain
        n = len(chain)
        if ctx.complete or not n:
            return False
        reached = result is not None and result.matches.deepest >= n
        reached = reached or any(goes_past(chain, sent) for sent in self.local.chains(now))
        reached = reached or any(goes_past(chain, r.chain) for r in self.routed.values())
        if not reached:
            return False
        limit = self.settings.max_match_tokens
        chain.extend(self.memo.chain(ctx.tokens, ctx.namespace, budget=4 * n, known=chain,
                                     limit=limit)[n:])
        ctx.complete = len(chain) == min(len(ctx.tokens), limit) // self.settings.block_size
        return len(chain) > n

    async def match(
        self, ctx: RequestContext, lookup: Callable[[Chain], Awaitable[LookupResult | None]],
        now: float,
    ) -> LookupResult | None:
        """``lookup`` of the chain, hashed further and looked up again while some worker may hold
        all of it (:meth:`extend`). The caller brings the I/O: the request router and the
        simulator make the same lookups this way."""
        result = await lookup(ctx.chain)
        while self.extend(ctx, result, now):
            if result is not None:  # None: no index answer to refine, the chain grows anyway
                result = await lookup(ctx.chain)
        return result

    def finish(self, ctx: RequestContext) -> None:
        """The rest of the chain, after the decision: the predicted entries and this router's
        later decisions cover the whole prompt."""
        if not ctx.complete:
            ctx.chain.extend(self.memo.chain(
                ctx.tokens, ctx.namespace, known=ctx.chain, limit=self.settings.max_match_tokens,
            )[len(ctx.chain):])
            ctx.complete = True

    def rank(
        self,
        key: int,
        ctx: RequestContext,
        candidates: Sequence[Candidate],
        result: LookupResult | None,
        now: float,
    ) -> Ranking:
        """All candidates, best first, from the lookup (None: by load only), this router's own
        recent decisions and the work it sent that the reported loads do not cover yet."""
        keys, at = self._roster(candidates)
        confirmed, predicted = np.zeros(len(keys), np.int64), np.zeros(len(keys), np.int64)
        lower: list[tuple[int, int]] = []  # (host, disk) blocks per candidate, where any are
        overrides = []  # a match's load that is not the lookup's map's
        if result is not None:
            self.loads.take(result.loads, now)
            m = result.matches
            ctx.confirmed = dict(zip(m.names, m.confirmed, strict=True))
            where = np.fromiter(map(at.get, m.names, repeat(-1)), np.intp, len(m.names))
            known = where >= 0
            confirmed[where[known]] = np.asarray(m.confirmed, dtype=np.int64)[known]
            predicted[where[known]] = np.asarray(m.predicted, dtype=np.int64)[known]
            for worker, blocks in m.lower.items():
                if (i := at.get(worker)) is not None and blocks != (0, 0):
                    lower = lower or [(0, 0)] * len(keys)
                    lower[i] = blocks
            if m.loads is not result.loads:  # loads of their own (else the map's)
                overrides = [(w, load) for w in m.names if w in at and (
                    load := m.loads.get(w)) is not None and load is not result.loads.get(w)]
        for worker, depth in (self.local.depths(ctx.chain, now) if ctx.chain else {}).items():
            if (i := at.get(worker)) is not None:
                predicted[i] = max(predicted[i], depth)
        loads = self.loads.read(candidates, keys, now)
        for worker, load in overrides:
            loads.put(at[worker], worker, load)
        tokens, count = self.backlog(key, ctx.chain, at, loads)
        adapter_s = () if ctx.adapter is None else self.adapters.prices(
            ctx.adapter, [(c.key, c.routing_stats) for c in candidates], now,
            self.settings.weights.adapter_miss_s)
        fleet = Fleet(keys, confirmed, predicted, (), tokens, count,
                      [c.queue_len or 0 for c in candidates], adapter_s, loads.rows, lower, at)
        deepest = int(max(confirmed.max(initial=0), predicted.max(initial=0)))
        ctx.ranking = rank(ctx.num_prompt_tokens, fleet, self.settings.weights,
                           tie_key(ctx, deepest))
        return ctx.ranking

    def _roster(self, candidates: Sequence[Candidate]) -> tuple[list[str], Mapping[str, int]]:
        """The candidates' keys and each one's index, the map kept while they stay the same
        replicas in the same order (a decision's work per candidate is a list slot)."""
        keys = [c.key for c in candidates]
        if keys != self._keys:
            self._keys, self._at = keys, {k: i for i, k in enumerate(keys)}
        return self._keys, self._at

    def backlog(self, key: int, chain: Chain, at: Mapping[str, int],
                 loads: CandidateRows) -> tuple[list[int], list[int]]:
        """Per candidate (``at``: its index), the prefill tokens and the requests this router
        sent there after its load was reported, except request ``key`` itself."""
        tokens, count = [0] * len(loads.rows), [0] * len(loads.rows)
        for worker, in_flight in self.routed.by_worker():
            if (i := at.get(worker)) is None:
                continue
            load = loads.of(worker)
            since = load.timestamp if load is not None else 0.0
            for other, routed in in_flight.items():
                if routed.routed_at > since and other != key:
                    tokens[i] += routed.unshared_tokens(chain, self.settings.block_size)
                    count[i] += 1
        return tokens, count

    def note_routed(
        self, key: int, worker: str, ctx: RequestContext, internal_id: str, now: float
    ) -> None:
        """The request goes (or went) to ``worker``: count its prefill there until reported."""
        if ctx.chain:
            self.local.record(ctx.chain, worker, now)
        if ctx.adapter is not None:
            self.adapters.note(worker, ctx.adapter, now)
        self._track(key, worker, ctx, internal_id, now)

    def _track(
        self, key: int, worker: str, ctx: RequestContext, internal_id: str, now: float
    ) -> None:
        self.routed.add(key, Routed(worker, now, ctx.new_tokens(worker), ctx.chain,
                                    ctx.depth(worker), internal_id))
        if len(self.routed) > _MAX_ROUTED:
            for stale in [k for k in self.routed
                          if now - self.routed[k].routed_at > _ROUTED_MAX_AGE_S]:
                self.routed.pop(stale)

    def outcome(self, key: int, worker: str) -> Outcome | None:
        """How a request Serve is sending to ``worker`` fares against its deepest cached prefix
        (call before :meth:`sent`); None for a request this router never ranked."""
        ctx = self.contexts.get(key)
        if ctx is None:
            return None
        depth = ctx.depth(worker)
        deepest = ctx.ranking.deepest if ctx.ranking is not None else 0
        spill = None
        if depth < deepest:
            routed = self.routed.get(key)  # this router's first choice (note_routed)
            first = routed.worker if routed is not None else worker
            spill = "serve" if ctx.depth(first) >= deepest else "cost"
        return Outcome(depth, spill)

    def expected(self, key: int, worker: str) -> Expected | None:
        """What request ``key`` should find on ``worker``, where Serve is sending it (call
        before :meth:`sent`); None for a request this router never ranked."""
        ctx = self.contexts.get(key)
        if ctx is None:
            return None
        first = self.routed.get(key)
        reason = "failopen" if ctx.failopen else "partial" if worker in ctx.unknown else None
        if reason is None and first is not None and first.worker != worker:
            reason = "serve"
        return Expected(ctx.depth(worker), reason)

    def sent(self, key: int, worker: str, internal_id: str, now: float) -> Prediction | None:
        """Serve sent the request to ``worker`` (maybe not the first choice): record the truth;
        returns the predicted entry to announce, if any."""
        ctx = self.contexts.pop(key, None)
        if ctx is None:
            return None
        self.finish(ctx)
        first = self.routed.get(key)
        if first is not None and first.worker == worker:  # its local prediction is recorded
            self._track(key, worker, ctx, internal_id, now)
        else:
            self.note_routed(key, worker, ctx, internal_id, now)
        worker_id = self.worker_ids.get(worker)
        confirmed = ctx.confirmed.get(worker, 0)
        if len(ctx.chain) > confirmed and worker_id is not None and self.gate.usable(now):
            return Prediction(ctx.chain, worker_id, confirmed)
        return None

    def completed(self, worker: str, internal_id: str) -> None:
        for key, routed in self.routed.on(worker).items():
            if routed.internal_id == internal_id:
                self.routed.pop(key)
                return

    # ----------------------------------------------------------------------------- index

    def looked_up(self, result: LookupResult) -> None:
        """Take every live worker's id (not only the matched ones'): a prefix no worker holds
        yet must still be announced as predicted on the worker it is sent to."""
        self.worker_ids = result.worker_ids
