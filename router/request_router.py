"""`PrefixAwareRequestRouter`: the Ray Serve request router for the worker deployment.

It runs inside every deployment handle (each ingress replica has its own), on the handle's
router event loop. Per request it:

1. hashes the prompt's block chain once (``router.blocks``, namespace = model fingerprint +
   the request's ``cache_salt``), from ``pending_request.args[0]``, a ``GenerateRequest``;
2. looks the chain up in the Redis index within ``lookup_deadline_s`` (fail-open: when Redis
   is slow, down or unset it ranks by load alone, and stops asking for ``failopen_backoff_s``);
3. ranks the candidate replicas with the pure ``router.policy``, using engine-reported loads from
   the index (all routers see the same), corrected by what this router sent since each load was
   reported, with Serve's queue lengths and the replicas' routing stats as the fallback;
4. returns ``[[chosen], [the rest]]`` and, once Serve has actually sent the request, writes a
   short-TTL predicted entry to the index (fire-and-forget) so that other routers see the
   decision before the worker's KV events arrive. Its own decisions are remembered locally for
   the same TTL, which covers the write lag within this router.

On first use (and every ``check_interval_s``, in the background) it checks that the registered
workers use its block size and model fingerprint; on a mismatch it logs an error and routes by
load only, because a chain hashed differently would never match and would silently pin traffic
by accident.

Configure with ``RequestRouterConfig(request_router_class=PrefixAwareRequestRouter,
request_router_kwargs={...})``; the kwargs are those of :meth:`initialize_state`.
A call with a ``target_worker=<replica id>`` keyword goes to that replica only (per-worker
``stats`` / ``reset_prefix_cache``); when no running replica has that id within
``target_wait_s`` it fails with :class:`NoSuchReplica` (Serve itself would retry it for ever).
Calls without a ``GenerateRequest`` go to any replica.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import os
import random
import struct
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from ray.serve._private.common import ReplicaID, RequestMetadata
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica
from ray.util import metrics

from router.blocks import DEFAULT_BLOCK_SIZE, hash_chain, namespace
from router.events import WorkerLoad
from router.index import REDIS_URL_ENV, LookupResult, PrefixIndex, WorkerMatch
from router.policy import PolicyConfig, WorkerView, rank
from router.request import GenerateRequest

logger = logging.getLogger("ray.serve")

_LATENCY_BUCKETS_MS = [0.1, 0.25, 0.5, 1, 2, 5, 10, 25, 50, 100, 250]
_DEPTH_BUCKETS = [0.5, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
_LOAD_FIELDS = {f.name for f in fields(WorkerLoad)}


class NoSuchReplica(LookupError):
    """A ``target_worker`` call named a replica that is not running (dead, or never was)."""


class LocalPredictions:
    """This router's own recent decisions, block by block, each expiring after ``ttl_s``."""

    def __init__(self, ttl_s: float, max_blocks: int = 200_000) -> None:
        self.ttl_s = ttl_s
        self.max_blocks = max_blocks
        self._blocks: OrderedDict[bytes, dict[str, float]] = OrderedDict()

    def record(self, chain: Sequence[bytes], worker: str, now: float) -> None:
        expiry = now + self.ttl_s
        for h in chain:
            self._blocks.setdefault(h, {})[worker] = expiry
            self._blocks.move_to_end(h)
        while len(self._blocks) > self.max_blocks:
            self._blocks.popitem(last=False)

    def depths(self, chain: Sequence[bytes], now: float) -> dict[str, int]:
        """Consecutive predicted depth from block 0, per worker."""
        depth: dict[str, int] = {}
        alive: set[str] | None = None
        for i, h in enumerate(chain):
            entry = self._blocks.get(h)
            if not entry:
                break
            here = {w for w, expiry in entry.items() if expiry > now}
            alive = here if alive is None else alive & here
            if not alive:
                break
            for w in alive:
                depth[w] = i + 1
        return depth


@dataclass
class _Routed:
    """A request this router sent, until the worker's reported load covers it."""

    worker: str
    routed_at: float
    new_tokens: int  # prompt tokens it will prefill there
    chain: list[bytes]
    start_block: int  # its prefill starts here (the depth it was credited with)
    internal_id: str  # Serve's, for on_request_completed (shared by sibling handle calls)

    def unshared_tokens(self, chain: list[bytes], block_size: int) -> int:
        """Its prefill work that is not the prefix ``chain`` shares with it.

        A request that follows another with the same prefix needs that work done anyway (here
        or, twice over, elsewhere), so it must not count as a backlog that pushes it away.
        """
        shared = _common_blocks(self.chain, chain)
        overlap = max(0, shared - self.start_block) * block_size
        return max(0, self.new_tokens - overlap)


@dataclass
class _Context:
    """Per pending request, so retries never re-hash the prompt."""

    chain: list[bytes]
    tie_key: bytes
    num_prompt_tokens: int
    created_at: float
    new_tokens: dict[str, int] = field(default_factory=dict)  # replica -> prefill if sent there
    depth: dict[str, int] = field(default_factory=dict)  # replica -> credited depth (blocks)
    confirmed: dict[str, int] = field(default_factory=dict)  # replica -> depth at lookup


class PrefixAwareRequestRouter(RequestRouter):
    """Ranks replicas by estimated TTFT with prefix-cache credit from the shared Redis index."""

    def initialize_state(
        self,
        redis_url: str | None = None,
        model: str = "",
        block_size: int = DEFAULT_BLOCK_SIZE,
        fingerprint: str | None = None,
        lookup_deadline_s: float = 0.02,
        predict_ttl_s: float = 2.0,
        failopen_backoff_s: float = 1.0,
        load_max_age_s: float = 10.0,
        check_interval_s: float = 30.0,
        target_wait_s: float = 10.0,
        prefix_routing: bool = True,
        policy: dict[str, Any] | None = None,
    ) -> None:
        """Called by Serve with ``request_router_kwargs``.

        Args:
            redis_url: the prefix index (``redis://`` / ``rediss://``, password in the URL);
                None falls back to ``$PREFIXSERVE_REDIS_URL`` (how Serve config files and
                KubeRay pass a password-bearing URL), and routes by load only without either.
            model: served model name (the index keyspace).
            block_size: tokens per hashed block; must equal the workers'.
            fingerprint: model fingerprint; None adopts the one the registered workers report.
            lookup_deadline_s: budget for the index lookup before failing open.
            predict_ttl_s: lifetime of predicted entries (index and local).
            failopen_backoff_s: after a failed lookup, route by load only for this long.
            load_max_age_s: a load record older than this is not used.
            check_interval_s: how often to re-check workers' block size and fingerprint.
            target_wait_s: how long a ``target_worker`` call waits for that replica to show
                up among the running ones (a replica that just started) before it fails.
            prefix_routing: False ranks by load only (the "no index" baseline).
            policy: ``router.policy.PolicyConfig`` fields (``block_size`` is set from above).
        """
        self._redis_url = redis_url or os.environ.get(REDIS_URL_ENV) or None
        self._model = model
        self._block_size = block_size
        self._fingerprint = fingerprint
        self._deadline_s = lookup_deadline_s
        self._predict_ttl_s = predict_ttl_s
        self._failopen_backoff_s = failopen_backoff_s
        self._load_max_age_s = load_max_age_s
        self._check_interval_s = check_interval_s
        self._target_wait_s = target_wait_s
        self._prefix_routing = prefix_routing
        self._policy = PolicyConfig(**{**(policy or {}), "block_size": block_size})

        self._index: PrefixIndex | None = None
        self._index_down_until = 0.0
        self._next_check = 0.0
        self._compatible: bool | None = None  # None until the start-up check could run
        self._local = LocalPredictions(predict_ttl_s)
        # Keyed by _request_key: handle calls made while serving one request (an ingress
        # fanning out a batch) share an internal_request_id, so that id is not a request key.
        self._contexts: dict[int, _Context] = {}
        self._routed: dict[int, _Routed] = {}
        self._loads: dict[str, tuple[WorkerLoad, float]] = {}  # replica -> (load, received)
        self._worker_ids: dict[str, int] = {}  # replica -> index worker id
        self._background: set[asyncio.Task] = set()
        self._check_task: asyncio.Task | None = None

        tags = {"deployment": self._deployment_id.name, "application": self.app_name}
        keys = ("deployment", "application")
        self._latency = metrics.Histogram(
            "prefixserve_router_latency_ms",
            description="Time to rank replicas for one request (hashing, index lookup, policy).",
            boundaries=_LATENCY_BUCKETS_MS,
            tag_keys=keys,
        ).set_default_tags(tags)
        self._matched = metrics.Histogram(
            "prefixserve_router_matched_blocks",
            description="Matched prefix depth (blocks) of the chosen replica.",
            boundaries=_DEPTH_BUCKETS,
            tag_keys=keys,
        ).set_default_tags(tags)
        self._failopen = metrics.Counter(
            "prefixserve_router_index_failopen",
            description="Requests ranked by load only because the index was unset, slow, "
            "down, not yet checked or incompatible.",
            tag_keys=(*keys, "reason"),
        ).set_default_tags(tags)

    # ----------------------------------------------------------------------------- routing

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        target = pending_request.kwargs.get("target_worker") if pending_request else None
        if target is not None:  # a call aimed at one replica (stats, cache reset)
            return self._route_to_target(candidate_replicas, pending_request, target)
        request = _generate_request(pending_request)
        if pending_request is None or request is None:
            # Not a generate call (stats, ...): any replica, the least busy of a random order.
            return [random.sample(candidate_replicas, len(candidate_replicas))]
        try:
            return await self._rank_replicas(candidate_replicas, pending_request, request)
        except Exception:  # a bug here must not strand the request: Serve would retry forever
            logger.exception("prefix-aware ranking failed; routing by queue length instead")
            self._failopen.inc(tags={"reason": "error"})
            return [random.sample(candidate_replicas, len(candidate_replicas))]

    async def _rank_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest,
        request: GenerateRequest,
    ) -> list[list[RunningReplica]]:
        start = time.perf_counter()
        now = time.time()
        if self._prefix_routing:
            await self._maybe_check_workers(candidate_replicas, now)
        ctx = self._context(pending_request, request, now)
        result = await self._lookup(ctx.chain, now)
        if result is not None:
            ctx.confirmed = {k: m.confirmed_depth for k, m in result.matches.items()}

        local = self._local.depths(ctx.chain, now) if ctx.chain else {}
        pending = self._pending_by_worker(exclude=_request_key(pending_request))
        views = []
        for replica in candidate_replicas:
            key = replica.replica_id.unique_id
            match = result.matches.get(key) if result is not None else None
            load = self._load_for(replica, match, now)
            tokens, count = 0.0, 0
            since = load.timestamp if load is not None else 0.0
            for routed in pending.get(key, ()):
                if routed.routed_at > since:
                    tokens += routed.unshared_tokens(ctx.chain, self._block_size)
                    count += 1
            views.append(
                WorkerView(
                    key=key,
                    confirmed_depth=match.confirmed_depth if match else 0,
                    predicted_depth=max(match.predicted_depth if match else 0, local.get(key, 0)),
                    load=load,
                    pending_prefill_tokens=int(tokens),
                    pending_requests=count,
                    queue_len=self._replica_queue_len_cache.get(replica.replica_id),
                )
            )
        ranking = rank(ctx.num_prompt_tokens, views, self._policy, ctx.tie_key)
        by_key = {r.replica_id.unique_id: r for r in candidate_replicas}
        best = ranking[0]
        ctx.new_tokens = {s.key: s.new_tokens for s in ranking}
        ctx.depth = {s.key: s.matched_blocks for s in ranking}
        self._note_routed(pending_request, best.key, ctx, now)

        self._latency.observe((time.perf_counter() - start) * 1000)
        self._matched.observe(best.matched_blocks)
        tiers = [[by_key[best.key]]]
        if len(ranking) > 1:
            tiers.append([by_key[s.key] for s in ranking[1:]])
        return tiers

    def _route_to_target(
        self, candidates: list[RunningReplica], pr: PendingRequest, target: str
    ) -> list[list[RunningReplica]]:
        """That replica only; fail the call once it has been missing for ``target_wait_s``."""
        chosen = [r for r in candidates if r.replica_id.unique_id == target]
        if chosen or time.time() - pr.created_at < self._target_wait_s:
            return [chosen]
        if not pr.future.done():
            pr.future.set_exception(NoSuchReplica(
                f"no running replica {target!r} in {self._deployment_id.name} "
                f"(running: {sorted(r.replica_id.unique_id for r in candidates)})"
            ))
            self._remove_pending_request_from_indices(pr)
        return [candidates]  # Serve's routing loop sees the call done and drops it

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        """Serve sent it (possibly not to our first choice): record and announce the truth."""
        ctx = self._contexts.pop(_request_key(pending_request), None)
        if ctx is None:
            return
        key = replica_id.unique_id
        now = time.time()
        self._note_routed(pending_request, key, ctx, now)
        worker_id = self._worker_ids.get(key)
        confirmed = ctx.confirmed.get(key, 0)
        if (
            len(ctx.chain) > confirmed
            and worker_id is not None
            and self._index is not None
            and self._usable(now)
        ):
            self._spawn(self._predict(ctx.chain, worker_id, confirmed))

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        key = replica_id.unique_id
        for pr_id, routed in self._routed.items():
            if routed.internal_id == internal_request_id and routed.worker == key:
                del self._routed[pr_id]
                return

    def _fulfill_next_pending_request(
        self, replica: RunningReplica, request_metadata: RequestMetadata | None = None
    ) -> None:
        """Give the replica to the very request it was ranked for.

        Serve's default matches on ``internal_request_id``, which handle calls made while
        serving one request share: the second call of such a pair would never be fulfilled
        (and FIFO order would hand one prefix's choice to another prefix's request).
        """
        if request_metadata is not None:
            for pr in self._pending_requests_to_fulfill:
                if pr.metadata is request_metadata:
                    if not pr.future.done():
                        self._cancel_routing_task_for_pending_request(pr)
                        self._record_queue_wait_time(pr)
                        pr.future.set_result(replica)
                        self._remove_pending_request_from_indices(pr)
                    return
        super()._fulfill_next_pending_request(replica, request_metadata)

    # ------------------------------------------------------------------------------ helpers

    def _context(self, pr: PendingRequest, request: GenerateRequest, now: float) -> _Context:
        ctx = self._contexts.get(_request_key(pr))
        if ctx is not None:
            return ctx
        tokens = request.prompt_token_ids
        chain: list[bytes] = []
        if self._prefix_routing and self._fingerprint is not None:
            ns = namespace(self._fingerprint, request.cache_salt)
            chain = hash_chain(tokens, self._block_size, ns)
        if chain:
            tie_key = chain[0]
        else:  # shorter than a block (or no fingerprint yet): nothing cacheable, just spread
            tie_key = hashlib.blake2b(
                struct.pack(f"<{min(len(tokens), 64)}I", *tokens[:64]), digest_size=16
            ).digest()
        ctx = _Context(chain, tie_key, max(1, len(tokens)), now)
        self._contexts[_request_key(pr)] = ctx
        if len(self._contexts) > 4096:  # requests cancelled before routing leave contexts
            for stale in [k for k, c in self._contexts.items() if now - c.created_at > 60]:
                del self._contexts[stale]
        return ctx

    def _note_routed(self, pr: PendingRequest, key: str, ctx: _Context, now: float) -> None:
        if ctx.chain:
            self._local.record(ctx.chain, key, now)
        tokens = ctx.new_tokens.get(key, ctx.num_prompt_tokens)
        routed = _Routed(key, now, tokens, ctx.chain, ctx.depth.get(key, 0),
                         pr.metadata.internal_request_id)
        self._routed[_request_key(pr)] = routed
        if len(self._routed) > 10_000:  # requests cancelled before Serve sent them never complete
            for stale in [k for k, r in self._routed.items() if now - r.routed_at > 600]:
                del self._routed[stale]

    def _pending_by_worker(self, exclude: int) -> dict[str, list[_Routed]]:
        """In-flight requests per worker, except the one being (re)routed."""
        out: dict[str, list[_Routed]] = {}
        for pr_id, routed in self._routed.items():
            if pr_id != exclude:
                out.setdefault(routed.worker, []).append(routed)
        return out

    def _load_for(
        self, replica: RunningReplica, match: WorkerMatch | None, now: float
    ) -> WorkerLoad | None:
        key = replica.replica_id.unique_id
        if match is not None and match.load is not None:
            self._loads[key] = (match.load, now)
            return match.load
        cached = self._loads.get(key)
        if cached is not None and now - cached[1] <= self._load_max_age_s:
            return cached[0]
        stats = replica.routing_stats or {}
        raw = stats.get("load")
        if isinstance(raw, dict):
            try:
                return WorkerLoad(**{k: v for k, v in raw.items() if k in _LOAD_FIELDS})
            except TypeError:
                return None
        return None

    def _usable(self, now: float) -> bool:
        return bool(self._prefix_routing and self._compatible and now >= self._index_down_until)

    def _get_index(self) -> PrefixIndex | None:
        if self._index is None and self._redis_url:
            self._index = PrefixIndex(
                self._redis_url,
                self._model,
                deadline_s=self._deadline_s,
                predict_ttl_s=self._predict_ttl_s,
            )
        return self._index

    def _fail_open(self, reason: str, now: float, backoff: bool = True) -> None:
        self._failopen.inc(tags={"reason": reason})
        if backoff:
            self._index_down_until = now + self._failopen_backoff_s

    async def _lookup(self, chain: list[bytes], now: float) -> LookupResult | None:
        """One index round trip within the deadline, or None (load-only ranking)."""
        if not self._prefix_routing:
            return None
        index = self._get_index()
        if index is None:
            self._fail_open("unset", now, backoff=False)
            return None
        if not self._compatible:
            reason = "unchecked" if self._compatible is None else "incompatible"
            self._fail_open(reason, now, backoff=False)
            return None
        if now < self._index_down_until:
            self._fail_open("backoff", now, backoff=False)
            return None
        try:
            result = await asyncio.wait_for(index.lookup(chain), timeout=4 * self._deadline_s)
        except (asyncio.TimeoutError, TimeoutError):
            self._fail_open("timeout", now)
            return None
        except Exception as exc:  # IndexUnavailable and anything else: serving goes on
            logger.debug("prefix index lookup failed: %r", exc)
            self._fail_open("unavailable", now)
            return None
        for key, match in result.matches.items():
            self._worker_ids[key] = match.worker_id
        return result

    async def _predict(self, chain: list[bytes], worker_id: int, confirmed: int) -> None:
        """Only the blocks the worker does not hold yet; other routers see them at once."""
        assert self._index is not None
        try:
            await asyncio.wait_for(
                self._index.predict(chain, worker_id, from_block=confirmed),
                timeout=4 * self._deadline_s,
            )
        except Exception as exc:  # advisory only
            logger.debug("predicted entry not written: %r", exc)

    def _spawn(self, coro: Any) -> None:
        task = self._event_loop.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _maybe_check_workers(self, replicas: list[RunningReplica], now: float) -> None:
        """Start a check when due; before the first one has an answer, every request waits for
        it (a burst at start-up must not be routed blind), later ones run in the background."""
        task = self._check_task
        if now >= self._next_check and (task is None or task.done()):
            self._next_check = now + self._check_interval_s
            task = self._check_task = self._event_loop.create_task(self._check_workers(replicas))
            task.add_done_callback(_log_failure)
        if self._compatible is None and task is not None and not task.done():
            await asyncio.shield(task)

    async def _check_workers(self, replicas: list[RunningReplica]) -> None:
        """Block size and fingerprint must match the workers', or prefix routing is off."""
        index = self._get_index()
        if index is None:
            return
        now = time.time()
        try:
            workers = await asyncio.wait_for(index.live_workers(), timeout=0.5)
        except Exception as exc:
            logger.debug("worker check postponed, index unavailable: %r", exc)
            self._next_check = now + self._failopen_backoff_s
            return
        reported = {(w.replica_id, w.block_size, w.fingerprint) for w in workers}
        for replica in replicas:
            stats = replica.routing_stats or {}
            if "block_size" in stats and "fingerprint" in stats:
                reported.add(
                    (replica.replica_id.unique_id, stats["block_size"], stats["fingerprint"])
                )
        if not reported:  # no worker registered yet: ask again soon
            self._next_check = now + self._failopen_backoff_s
            return
        if self._fingerprint is None:
            fingerprints = {fp for _, _, fp in reported}
            if len(fingerprints) == 1:
                self._fingerprint = fingerprints.pop()
        bad = [
            r for r in reported if r[1] != self._block_size or r[2] != self._fingerprint
        ]
        if bad:
            logger.error(
                "PREFIX ROUTING DISABLED for model %r: router uses block_size=%d "
                "fingerprint=%r but workers report %s. Fix the configuration so both agree.",
                self._model, self._block_size, self._fingerprint, sorted(bad),
            )
            self._compatible = False
            return
        if not self._compatible:
            logger.info(
                "prefix routing on for model %r: block_size=%d fingerprint=%s (%d workers)",
                self._model, self._block_size, self._fingerprint, len({r[0] for r in reported}),
            )
        self._compatible = True


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("worker compatibility check failed", exc_info=task.exception())


_REQUEST_KEY = "_prefixserve_key"
_request_keys = itertools.count()


def _request_key(pr: PendingRequest) -> int:
    """A key no other pending request of this process ever gets, kept on the request itself.

    ``id(pr)`` is not one: once a request is gone its address is reused, and a new request
    would inherit the old one's hash chain (a context left by a call cancelled before routing)
    or overwrite its in-flight record.
    """
    key = getattr(pr, _REQUEST_KEY, None)
    if key is None:
        key = next(_request_keys)
        setattr(pr, _REQUEST_KEY, key)
    return key


def _common_blocks(a: list[bytes], b: list[bytes]) -> int:
    """Length of the common prefix of two chains (a chained hash equal at i is equal before)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:  # binary search: the first differing block
        mid = (lo + hi) // 2
        if a[mid] == b[mid]:
            lo = mid + 1
        else:
            hi = mid
    return lo


def _generate_request(pr: PendingRequest | None) -> GenerateRequest | None:
    if pr is None:
        return None
    for arg in (*pr.args, *pr.kwargs.values()):
        if isinstance(arg, GenerateRequest):
            return arg
    return None
