"""What the prefix-aware request router knows and decides, without Ray and without I/O.

:class:`RouterState` holds one router's bookkeeping: each pending request's hashed chain, what
it routed and where (until the worker's reported load covers it), its own recent decisions
(:class:`LocalPredictions`), the last loads it saw, whether the workers are compatible and
whether the index is in fail-open backoff. From that and an index lookup it builds the fleet's
columns (:class:`router.policy.Fleet`) and ranks them. :mod:`router.request_router` only
adapts Serve's calls to it and does the index I/O, so every decision here is testable on plain
values.
"""

from __future__ import annotations

import hashlib
import logging
import struct
from collections import deque
from collections.abc import (
    Awaitable,
    Callable,
    ItemsView,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from dataclasses import asdict, dataclass, field, fields
from types import MappingProxyType
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from prefixserve.router.blocks import DEFAULT_BLOCK_SIZE, DIGEST_BYTES, Chain, ChainMemo, namespace
from prefixserve.router.events import WorkerLoad
from prefixserve.router.index import IndexSettings, LookupResult, WorkerInfo
from prefixserve.router.policy import Fleet, PolicyConfig, Ranking, rank

logger = logging.getLogger("ray.serve")

_LOAD_FIELDS = {f.name for f in fields(WorkerLoad)}
_MAX_CONTEXTS = 4096  # past this, contexts of requests cancelled before routing are dropped
_CONTEXT_MAX_AGE_S = 60.0
# A decision hashes the prompt's remembered blocks and this many tokens more at first (extend()
# adds more where some worker may hold them all): a long prompt no one holds costs little.
_FIRST_HASH_TOKENS = 1024
_MAX_ROUTED = 10_000  # past this, records of requests Serve never sent are dropped
_ROUTED_MAX_AGE_S = 600.0


class LocalPredictions:
    """This router's own recent decisions: the chains it sent to each worker, each expiring
    after ``ttl_s``, at most ``max_blocks`` blocks in all (the oldest go first).

    A worker's predicted depth for a chain is its longest common prefix with a chain recently
    sent there: chained hashes make a block equal only when everything before it is, so that is
    the consecutive run from block 0. Recording is O(1); a query compares one block per recent
    chain and binary-searches only a chain that goes deeper than its worker's depth found so far
    (with a shared system prompt, a few per worker rather than every recent request), so a long
    prompt costs no per-block work here.
    """

    def __init__(self, ttl_s: float, max_blocks: int = 200_000) -> None:
        self.ttl_s = ttl_s
        self.max_blocks = max_blocks
        # (expiry, worker, chain, its length when recorded), in expiry order
        self._sent: deque[tuple[float, str, Chain, int]] = deque()
        self.num_blocks = 0

    def record(self, chain: Chain, worker: str, now: float) -> None:
        self._sent.append((now + self.ttl_s, worker, chain, len(chain)))
        self.num_blocks += len(chain)
        self._expire(now)

    def _expire(self, now: float) -> None:
        sent = self._sent
        while sent and (sent[0][0] <= now or self.num_blocks > self.max_blocks):
            self.num_blocks -= sent.popleft()[3]  # as recorded: a chain may grow after

    def depths(self, chain: Chain, now: float) -> dict[str, int]:
        """Consecutive predicted depth from block 0, per worker."""
        self._expire(now)
        depth: dict[str, int] = {}
        if not chain:
            return depth
        for _, worker, sent, _ in self._sent:
            best = depth.get(worker, 0)
            # one comparison rules out a chain that cannot go deeper (at a high request rate
            # most share only a system prompt): no binary search per recent chain
            if shares_block(chain, sent, best):
                depth[worker] = common_blocks(chain, sent, best + 1)
        return depth

    def chains(self, now: float) -> list[Chain]:
        """The chains sent in the last ``ttl_s``."""
        self._expire(now)
        return [sent for _, _, sent, _ in self._sent]


# These read the chains' packed bytes directly: a decision compares its chain with every recent
# one, and a Python-level index per digest cost a quarter of the ranking at 120 recent chains.
def goes_past(chain: Chain, other: Chain) -> bool:
    """Whether ``other`` holds all of ``chain`` and more (chained: equal last blocks suffice)."""
    a, b = chain.packed, other.packed
    n = len(a)
    return 0 < n < len(b) and a[n - DIGEST_BYTES :] == b[n - DIGEST_BYTES : n]


def shares_block(a: Chain, b: Chain, i: int) -> bool:
    """Whether two chains both hold block ``i`` and it is the same: then, chained, so is every
    block before it."""
    pa, pb = a.packed, b.packed
    at, end = i * DIGEST_BYTES, (i + 1) * DIGEST_BYTES
    return end <= len(pa) and end <= len(pb) and pa[at:end] == pb[at:end]


def common_blocks(a: Chain, b: Chain, lo: int = 0) -> int:
    """Length of the common prefix of two chains (a chained hash equal at i is equal before),
    known to be at least ``lo``."""
    pa, pb = a.packed, b.packed
    hi = min(len(pa), len(pb)) // DIGEST_BYTES
    while lo < hi:  # binary search: the first differing block
        mid = (lo + hi) // 2
        at = mid * DIGEST_BYTES
        if pa[at : at + DIGEST_BYTES] == pb[at : at + DIGEST_BYTES]:
            lo = mid + 1
        else:
            hi = mid
    return lo


@dataclass
class Routed:
    """A request this router sent, until the worker's reported load covers it."""

    worker: str
    routed_at: float
    new_tokens: int  # prompt tokens it will prefill there
    chain: Chain
    start_block: int  # its prefill starts here (the depth it was credited with)
    internal_id: str  # Serve's, for on_request_completed (shared by sibling handle calls)

    def unshared_tokens(self, chain: Chain, block_size: int) -> int:
        """Its prefill work that is not the prefix ``chain`` shares with it.

        A request that follows another with the same prefix needs that work done anyway (here
        or, twice over, elsewhere), so it must not count as a backlog that pushes it away.
        """
        start = self.start_block
        if not shares_block(self.chain, chain, start):  # nothing shared past its start: O(1)
            return self.new_tokens
        overlap = (common_blocks(self.chain, chain, start + 1) - start) * block_size
        return max(0, self.new_tokens - overlap)


class InFlight:
    """The requests this router sent, by key and by replica: a decision reads only its
    candidates' own (a pass over every request in flight cost ~2 ms a decision at 1,000
    replicas). Both maps hold the same records; only these methods change them."""

    def __init__(self) -> None:
        self._by_key: dict[int, Routed] = {}
        self._by_worker: dict[str, dict[int, Routed]] = {}

    def __len__(self) -> int:
        return len(self._by_key)

    def __iter__(self) -> Iterator[int]:
        return iter(self._by_key)

    def __getitem__(self, key: int) -> Routed:
        return self._by_key[key]

    def get(self, key: int) -> Routed | None:
        return self._by_key.get(key)

    def values(self) -> Iterable[Routed]:
        return self._by_key.values()

    def on(self, worker: str) -> Mapping[int, Routed]:
        """The requests in flight on ``worker``, by key (do not mutate)."""
        return self._by_worker.get(worker, _NONE_ROUTED)

    def by_worker(self) -> ItemsView[str, dict[int, Routed]]:
        """(replica, its requests in flight by key) for every replica with some (do not
        mutate)."""
        return self._by_worker.items()

    def add(self, key: int, routed: Routed) -> None:
        self.pop(key)
        self._by_key[key] = routed
        self._by_worker.setdefault(routed.worker, {})[key] = routed

    def pop(self, key: int) -> Routed | None:
        routed = self._by_key.pop(key, None)
        if routed is not None:
            on = self._by_worker[routed.worker]
            del on[key]
            if not on:
                del self._by_worker[routed.worker]
        return routed


_NONE_ROUTED: Mapping[int, Routed] = MappingProxyType({})


@dataclass
class RequestContext:
    """Per pending request, so retries never re-hash the prompt."""

    chain: Chain  # the prompt's first blocks, as many as the decision needs (extend())
    tie_key: bytes  # orders tied workers when the chain is empty (see tie_key()); else b""
    num_prompt_tokens: int
    created_at: float
    tokens: Sequence[int] = ()  # the prompt (matched up to max_match_tokens): the chain's rest
    namespace: bytes = b""
    complete: bool = True  # the chain holds every full block of ``tokens``
    new_tokens: dict[str, int] = field(default_factory=dict)  # replica -> prefill if sent there
    depth: dict[str, int] = field(default_factory=dict)  # replica -> credited depth (blocks)
    confirmed: dict[str, int] = field(default_factory=dict)  # replica -> depth at lookup


def tie_key(ctx: RequestContext, deepest: int) -> bytes:
    """The key that orders tied workers: the chain's first block no worker holds (its last
    block when some worker holds it all), given the ``deepest`` match (blocks) of any worker.

    Requests that share their new content up to there break ties alike in every router, so a
    burst with one new prefix converges on one worker; requests that differ right after a
    prefix every worker holds (a common system prompt) spread, instead of all following the
    system prompt's hash to one worker.
    """
    if not ctx.chain:
        return ctx.tie_key
    return ctx.chain[min(deepest, len(ctx.chain) - 1)]


@dataclass(slots=True)  # one per replica per decision: not frozen, which costs 2.5x to make
class Candidate:
    """A replica Serve offers for one request, as the ranking sees it."""

    key: str  # the replica's unique id
    routing_stats: Mapping[str, Any] = field(default_factory=dict)  # its record_routing_stats
    queue_len: int | None = None  # Serve's cached count of its ongoing requests


@dataclass(frozen=True)
class Prediction:
    """A predicted entry to write to the index once Serve has sent a request."""

    chain: Chain
    worker_id: int
    from_block: int  # the blocks before it are confirmed there already


@dataclass(frozen=True)
class Outcome:
    """Where a request went, as the routing metrics count it."""

    matched_blocks: int  # credited prefix depth (blocks) on the replica it went to
    # Why it did not go to the replica with the deepest match: "cost" (the ranking put a
    # shallower, less loaded replica first), "serve" (Serve sent it past the first choice,
    # e.g. a full queue); None when it did (or nothing matched anywhere).
    spill: str | None


_INTERNAL = {"internal": True}  # set by the app from other sections, not by users


class RouterSettings(BaseModel):
    """The router section of the cluster config, passed whole as the request router's kwargs
    (``PrefixAwareRequestRouter.initialize_state``); the internal fields the app fills in."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    lookup_deadline_s: float = Field(
        0.02, gt=0.0, description="Index lookup deadline; past it routing uses load only")
    failopen_backoff_s: float = Field(
        1.0, ge=0.0, description="After a failed index lookup, route by load only this long")
    load_max_age_s: float = Field(
        10.0, gt=0.0, description="A worker's reported load older than this is not used")
    check_interval_s: float = Field(
        30.0, gt=0.0, description="How often a router re-checks the workers' block size and "
        "model fingerprint")
    target_wait_s: float = Field(
        10.0, gt=0.0, description="How long a call for one named worker waits for that replica "
        "to appear")
    max_match_tokens: int = Field(
        131072, ge=1, description="Routing matches at most this many leading prompt tokens "
        "(past it every worker counts as uncached)")
    hash_memo_tokens: int = Field(
        33_554_432, ge=0, description="Prompt tokens whose block digests a router remembers (two "
        "generations of this many, ~1.4 bytes a token), so a prompt that starts like a recent one "
        "(a chat's next turn, a shared system prompt) hashes only what is new; 0 turns it off")
    weights: PolicyConfig = Field(
        default_factory=PolicyConfig, description="The routing cost model (router.policy)")
    model: str = Field("", description="Served model name: the index keyspace",
                       json_schema_extra=_INTERNAL)
    block_size: int = Field(DEFAULT_BLOCK_SIZE, ge=1, description="The workers' block size",
                            json_schema_extra=_INTERNAL)
    fingerprint: str | None = Field(
        None, description="Model fingerprint; None adopts the registered workers'",
        json_schema_extra=_INTERNAL)
    prefix_routing: bool = Field(
        True, description="False ranks by load only (the no-index baseline)",
        json_schema_extra=_INTERNAL)

    @model_validator(mode="before")
    @classmethod
    def _weights_count_our_blocks(cls, data: Any) -> Any:
        """The cost model counts blocks of the workers' size: one block size for both."""
        if not isinstance(data, dict) or "block_size" not in data:
            return data
        weights = data.get("weights") or {}
        if isinstance(weights, PolicyConfig):
            weights = asdict(weights)
        return {**data, "weights": {**weights, "block_size": data["block_size"]}}


class RouterState:
    """One router's bookkeeping and decisions; requests are keyed by a caller-chosen int."""

    def __init__(self, settings: RouterSettings, index: IndexSettings | None = None) -> None:
        self.settings = settings
        self.fingerprint = settings.fingerprint  # None until adopted from the workers
        self.compatible: bool | None = None  # None until the first check could run
        self.index_down_until = 0.0
        self.next_check = 0.0
        self.local = LocalPredictions((index or IndexSettings()).predict_ttl_s)
        self.contexts: dict[int, RequestContext] = {}
        self.routed = InFlight()
        self.loads: dict[str, tuple[WorkerLoad, float]] = {}  # replica -> (load, received)
        self.worker_ids: Mapping[str, int] = {}  # replica -> index worker id (the lookup's)
        run_tokens = settings.block_size * ChainMemo.RUN_BLOCKS
        self.memo = ChainMemo(settings.block_size, settings.hash_memo_tokens // run_tokens)
        self._first_blocks = max(1, _FIRST_HASH_TOKENS // settings.block_size)

    # -------------------------------------------------------------------------- requests

    def context(
        self, key: int, tokens: Sequence[int], cache_salt: str | None, now: float
    ) -> RequestContext:
        """The request's context, made (and its chain hashed) on first use."""
        ctx = self.contexts.get(key)
        if ctx is not None:
            return ctx
        chain = Chain()
        matched: Sequence[int] = ()
        limit = self.settings.max_match_tokens
        ns = b""
        if self.settings.prefix_routing and self.fingerprint is not None:
            matched = tokens
            ns = namespace(self.fingerprint, cache_salt)
            chain = self.memo.chain(matched, ns, budget=self._first_blocks, limit=limit)
        spread = b""  # a chain's tie key depends on the lookup (see tie_key())
        if not chain:  # shorter than a block (or no fingerprint yet): nothing cacheable, spread
            spread = hashlib.blake2b(
                struct.pack(f"<{min(len(tokens), 64)}I", *tokens[:64]), digest_size=16
            ).digest()
        full = min(len(matched), limit) // self.settings.block_size
        ctx = RequestContext(chain, spread, max(1, len(tokens)), now, matched, ns,
                             len(chain) == full)
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
        reached = result is not None and any(
            max(m.confirmed_depth, m.predicted_depth) >= n for m in result.matches.values())
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
        keys = [c.key for c in candidates]
        at = {k: i for i, k in enumerate(keys)}  # a decision's work per candidate is a list slot
        confirmed, predicted = [0] * len(keys), [0] * len(keys)
        if result is not None:
            ctx.confirmed = {k: m.confirmed_depth for k, m in result.matches.items()}
            for worker, match in result.matches.items():
                if (i := at.get(worker)) is not None:
                    confirmed[i], predicted[i] = match.confirmed_depth, match.predicted_depth
        for worker, depth in (self.local.depths(ctx.chain, now) if ctx.chain else {}).items():
            if (i := at.get(worker)) is not None:
                predicted[i] = max(predicted[i], depth)
        loads = self.loads_for(candidates, result, now)
        tokens, count = self.backlog(key, ctx.chain, at, loads)
        fleet = Fleet(keys, confirmed, predicted, loads, tokens, count,
                      [c.queue_len or 0 for c in candidates])
        deepest = max(max(confirmed, default=0), max(predicted, default=0))
        ranking = rank(ctx.num_prompt_tokens, fleet, self.settings.weights,
                       tie_key(ctx, deepest))
        ctx.new_tokens = dict(zip(ranking.keys, ranking.new_tokens, strict=True))
        ctx.depth = dict(zip(ranking.keys, ranking.depth, strict=True))
        return ranking

    def backlog(self, key: int, chain: Chain, at: Mapping[str, int],
                 loads: Sequence[WorkerLoad | None]) -> tuple[list[int], list[int]]:
        """Per candidate (``at``: its index), the prefill tokens and the requests this router
        sent there after its load was reported, except request ``key`` itself."""
        tokens, count = [0] * len(loads), [0] * len(loads)
        for worker, in_flight in self.routed.by_worker():
            if (i := at.get(worker)) is None:
                continue
            since = loads[i].timestamp if loads[i] is not None else 0.0
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
        self._track(key, worker, ctx, internal_id, now)

    def _track(
        self, key: int, worker: str, ctx: RequestContext, internal_id: str, now: float
    ) -> None:
        tokens = ctx.new_tokens.get(worker, ctx.num_prompt_tokens)
        self.routed.add(key, Routed(worker, now, tokens, ctx.chain, ctx.depth.get(worker, 0),
                                    internal_id))
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
        depth = ctx.depth.get(worker, 0)
        deepest = max(ctx.depth.values(), default=0)
        spill = None
        if depth < deepest:
            routed = self.routed.get(key)  # this router's first choice (note_routed)
            first = routed.worker if routed is not None else worker
            spill = "serve" if ctx.depth.get(first, 0) >= deepest else "cost"
        return Outcome(depth, spill)

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
        if len(ctx.chain) > confirmed and worker_id is not None and self.usable(now):
            return Prediction(ctx.chain, worker_id, confirmed)
        return None

    def completed(self, worker: str, internal_id: str) -> None:
        for key, routed in self.routed.on(worker).items():
            if routed.internal_id == internal_id:
                self.routed.pop(key)
                return

    def loads_for(self, candidates: Sequence[Candidate], result: LookupResult | None,
                  now: float) -> list[WorkerLoad | None]:
        """Each candidate's load: the index's (the match's, else the lookup's: a lookup carries
        every live worker's load but matches only the chain's holders), else the last one seen
        (while fresh), else the routing stats'."""
        matches = result.matches if result is not None else {}
        indexed = result.loads if result is not None else {}
        seen, out = self.loads, []
        for candidate in candidates:
            match = matches.get(candidate.key)
            fresh = match.load if match is not None and match.load is not None else (
                indexed.get(candidate.key))
            if fresh is None:
                out.append(self._last_load(candidate, now))
            else:
                seen[candidate.key] = (fresh, now)
                out.append(fresh)
        return out

    def _last_load(self, candidate: Candidate, now: float) -> WorkerLoad | None:
        cached = self.loads.get(candidate.key)
        if cached is not None and now - cached[1] <= self.settings.load_max_age_s:
            return cached[0]
        raw = candidate.routing_stats.get("load")
        if isinstance(raw, dict):
            try:
                return WorkerLoad(**{k: v for k, v in raw.items() if k in _LOAD_FIELDS})
            except TypeError:
                return None
        return None

    # ----------------------------------------------------------------------------- index

    def usable(self, now: float) -> bool:
        """Whether the index may be used now (on, compatible, not in fail-open backoff)."""
        return bool(self.settings.prefix_routing and self.compatible
                    and now >= self.index_down_until)

    def lookup_blocked(self, now: float) -> str | None:
        """Why a lookup must not be tried now (the fail-open reason), or None."""
        if not self.compatible:
            return "unchecked" if self.compatible is None else "incompatible"
        if now < self.index_down_until:
            return "backoff"
        return None

    def lookup_failed(self, now: float) -> None:
        """Route by load only for ``failopen_backoff_s``: a slow index is not asked again."""
        self.index_down_until = now + self.settings.failopen_backoff_s

    def looked_up(self, result: LookupResult) -> None:
        """Take every live worker's id (not only the matched ones'): a prefix no worker holds
        yet must still be announced as predicted on the worker it is sent to."""
        self.worker_ids = result.worker_ids

    # --------------------------------------------------------------------- compatibility

    def check_due(self, now: float) -> bool:
        """Whether a workers check is due; if so, the next one is scheduled from now."""
        if now < self.next_check:
            return False
        self.next_check = now + self.settings.check_interval_s
        return True

    def check_postponed(self, now: float) -> None:
        """The check could not run (index unavailable, no worker yet): try again soon."""
        self.next_check = now + self.settings.failopen_backoff_s

    def check_workers(
        self, workers: Sequence[WorkerInfo], candidates: Sequence[Candidate], now: float
    ) -> None:
        """Block size and fingerprint must match the workers', or prefix routing is off: a
        chain hashed differently would never match and would pin traffic by accident."""
        reported = {(w.replica_id, w.block_size, w.fingerprint) for w in workers}
        for candidate in candidates:
            stats = candidate.routing_stats
            if "block_size" in stats and "fingerprint" in stats:
                reported.add((candidate.key, stats["block_size"], stats["fingerprint"]))
        if not reported:  # no worker registered yet: ask again soon
            self.check_postponed(now)
            return
        if self.fingerprint is None:
            fingerprints = {fp for _, _, fp in reported}
            if len(fingerprints) == 1:
                self.fingerprint = fingerprints.pop()
        block_size, model = self.settings.block_size, self.settings.model
        bad = [r for r in reported if r[1] != block_size or r[2] != self.fingerprint]
        if bad:
            logger.error(
                "PREFIX ROUTING DISABLED for model %r: router uses block_size=%d "
                "fingerprint=%r but workers report %s. Fix the configuration so both agree.",
                model, block_size, self.fingerprint, sorted(bad),
            )
            self.compatible = False
            return
        if not self.compatible:
            logger.info(
                "prefix routing on for model %r: block_size=%d fingerprint=%s (%d workers)",
                model, block_size, self.fingerprint, len({r[0] for r in reported}),
            )
        self.compatible = True
