"""`PrefixAwareRequestRouter`: the Ray Serve request router for the worker deployment.

It runs inside every deployment handle (each ingress replica has its own), on the handle's
router event loop. Per request it:

1. hashes the prompt's block chain once (``router.blocks``, namespace = model fingerprint,
   under the request's LoRA adapter if any (``router.adapters``), + the request's
   ``cache_salt``), from ``pending_request.args[0]``, a ``GenerateRequest``;
2. looks the chain up: in process, from this router's copy of the index, while it follows the
   index's event log (``IndexSettings.event_log``, :mod:`router.index_follower`); else in the
   prefix index within ``lookup_deadline_s`` (fail-open: when the index is slow, down or unset
   it ranks by load alone, and stops asking for ``failopen_backoff_s``);
3. ranks the candidate replicas with the pure ``router.policy``, using engine-reported loads from
   the index (all routers see the same), corrected by what this router sent since each load was
   reported, with Serve's queue lengths and the replicas' routing stats as the fallback;
4. returns ``[[chosen], [the rest]]`` and, once Serve has actually sent the request, writes a
   short-TTL predicted entry to the index (fire-and-forget) so that other routers see the
   decision before the worker's KV events arrive. Its own decisions are remembered locally for
   the same TTL, which covers the write lag within this router.

On first use (and every ``check_interval_s``, in the background) it checks that the registered
workers use its block size and model fingerprint; on a mismatch it logs an error and routes by
load only.

Each decision is :class:`router.decision.RoutingCore`'s (the simulator's router makes its
decisions with the same object); this class adapts Serve's calls to it, opens the index, writes
the predictions and counts the metrics. Serve's internals are reached only through
:mod:`router.serve_compat`.

Configure with ``RequestRouterConfig(request_router_class=PrefixAwareRequestRouter,
request_router_kwargs={...})``; the kwargs are those of :meth:`initialize_state`.
Calls aimed at one replica (``target_worker=``) and calls without a ``GenerateRequest`` are
routed as under every policy (:mod:`router.call_routing`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections.abc import Coroutine
from typing import Any

import ray
from ray.util import metrics

from prefixserve.router.call_routing import ranked_tiers, route_call
from prefixserve.router.decision import LookupSource, RoutingCore
from prefixserve.router.decision_types import Candidate, Prediction
from prefixserve.router.index import REDIS_URL_ENV, IndexSettings, PrefixIndex
from prefixserve.router.index_follower import IndexFollower, event_logs
from prefixserve.router.index_stores import open_index
from prefixserve.router.request import GenerateRequest
from prefixserve.router.router_settings import RouterSettings
from prefixserve.router.router_state import RouterState
from prefixserve.router.secret_refs import SecretNotFound, resolve
from prefixserve.router.serve_compat import (
    PendingRequest,
    ReplicaID,
    RunningReplica,
    ServeRequestRouter,
    internal_request_id,
    replica_key,
    routing_stats,
)

logger = logging.getLogger("ray.serve")

_LATENCY_BUCKETS_S = [0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1,
                      0.25]
_DEPTH_BUCKETS = [0.5, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
_LAG_BUCKETS_S = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]


class PrefixAwareRequestRouter(ServeRequestRouter):
    """Ranks replicas by estimated TTFT with prefix-cache credit from the shared prefix index."""

    def initialize_state(
        self,
        redis_url: str | None = None,
        settings: dict[str, Any] | None = None,
        index: dict[str, Any] | None = None,
    ) -> None:
        """Called by Serve with ``request_router_kwargs``.

        Args:
            redis_url: the prefix index (``redis://`` / ``rediss://``) or a reference to it
                (``env:NAME``, ``file:/path``: how a password-bearing URL travels, see
                ``router.secret_refs``); None falls back to ``$PREFIXSERVE_REDIS_URL``. Without
                either, or when the reference cannot be resolved here, it routes by load only.
            settings: the router section of the cluster config
                (``router.router_settings.RouterSettings`` fields, model and block size included).
            index: the index section (``router.index.IndexSettings`` fields).
        """
        self._index_url = _index_url(redis_url)
        self._index_settings = IndexSettings.model_validate(index or {})
        self._state = RouterState(RouterSettings.model_validate(settings or {}),
                                  self._index_settings)
        # the index and its follower are opened on first use (_get_index) and live here
        self._source = LookupSource(self._state, None, None,
                                    self._state.settings.lookup_deadline_s)
        self._core = RoutingCore(self._state, self._source)
        self._background: set[asyncio.Task] = set()
        self._check_task: asyncio.Task | None = None

        tags = {"deployment": self.deployment_name, "application": self.app_name}
        keys = ("deployment", "application")
        # Ray exports these as ray_<name> (counters ray_<name>_total); see README "Metrics".
        self._latency = metrics.Histogram(
            "prefixserve_router_latency_seconds",
            description="Time to rank replicas for one request (hashing, index lookup, policy).",
            boundaries=_LATENCY_BUCKETS_S,
            tag_keys=keys,
        ).set_default_tags(tags)
        self._matched = metrics.Histogram(
            "prefixserve_router_matched_blocks",
            description="Matched prefix depth (blocks) of the replica a request was sent to.",
            boundaries=_DEPTH_BUCKETS,
            tag_keys=keys,
        ).set_default_tags(tags)
        self._spill = metrics.Counter(
            "prefixserve_router_spill",
            description="Requests sent to a replica other than the one with the deepest "
            "matched prefix, by reason (cost: the ranking preferred a less loaded one; serve: "
            "Serve sent it past the first choice).",
            tag_keys=(*keys, "reason"),
        ).set_default_tags(tags)
        self._lookups = metrics.Counter(
            "prefixserve_router_lookups",
            description="Index lookups by where they were asked: local (this router's copy, "
            "following the index's event log) or index (a round trip, which may fail open).",
            tag_keys=(*keys, "source"),
        ).set_default_tags(tags)
        self._follower_lag = metrics.Histogram(
            "prefixserve_router_follower_lag_seconds",
            description="How long KV events waited in the index's event log before this "
            "router's copy applied them (per read, its oldest entry).",
            boundaries=_LAG_BUCKETS_S,
            tag_keys=keys,
        ).set_default_tags(tags)
        self._partial = metrics.Counter(
            "prefixserve_router_partial_lookups",
            description="Index lookups answered without the part of one or more shards of a "
            "sharded index (down, or slower than the deadline): those shards' workers were "
            "ranked as matching nothing.",
            tag_keys=keys,
        ).set_default_tags(tags)
        self._failopen = metrics.Counter(
            "prefixserve_router_index_failopen",
            description="Requests ranked by load only because the index was unset, slow "
            "(timeout), down (unavailable), backing off, not yet checked or incompatible, or "
            "the ranking failed (error).",
            tag_keys=(*keys, "reason"),
        ).set_default_tags(tags)

    # ----------------------------------------------------------------------------- routing

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        return await route_call(
            self, candidate_replicas, pending_request, self._rank_replicas,
            target_wait_s=self._state.settings.target_wait_s,
            on_error=lambda: self._failopen.inc(tags={"reason": "error"}))

    async def _rank_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest,
        request: GenerateRequest,
    ) -> list[list[RunningReplica]]:
        start = time.perf_counter()
        now = time.time()
        if self._state.settings.prefix_routing:
            self._get_index()
            await self._maybe_check_workers(candidate_replicas, now)
        decision = await self._core.decide(
            _request_key(pending_request), request.prompt_token_ids, request.cache_salt,
            self._candidates(candidate_replicas), internal_request_id(pending_request), now,
            request.lora)
        for attempt in decision.lookups:
            if attempt.source is not None:
                self._lookups.inc(tags={"source": attempt.source})
            if attempt.failopen is not None:
                self._failopen.inc(tags={"reason": attempt.failopen})
            if attempt.unknown_shards:
                self._partial.inc()
        self._latency.observe(time.perf_counter() - start)
        return ranked_tiers(candidate_replicas, decision.ranking.keys)

    def _candidates(self, replicas: list[RunningReplica]) -> list[Candidate]:
        return [Candidate(replica_key(r), routing_stats(r), self.queue_len(r)) for r in replicas]

    def on_replica_chosen(self, pending_request: PendingRequest, request: GenerateRequest,
                          replica: str) -> None:
        """The depth this router credited there travels with the request: the worker compares
        it with what it finds (workers/index_truth.py)."""
        request.expected = self._state.expected(_request_key(pending_request), replica)

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        """Serve sent it (possibly not to our first choice): count, record and announce the
        truth."""
        outcome, prediction = self._core.sent(
            _request_key(pending_request), replica_key(replica_id),
            internal_request_id(pending_request), time.time())
        if outcome is not None:
            self._matched.observe(outcome.matched_blocks)
            if outcome.spill is not None:
                self._spill.inc(tags={"reason": outcome.spill})
        if prediction is not None and self._source.index is not None:
            self._spawn(self._predict(self._source.index, prediction))

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._core.completed(replica_key(replica_id), internal_request_id)

    # ------------------------------------------------------------------------------- index

    def _get_index(self) -> PrefixIndex | None:
        """The index, opened on first use (with its follower); it lives in the lookup source."""
        source = self._source
        if source.index is None and self._index_url:
            settings = self._state.settings
            source.index = index = open_index(
                self._index_url,
                settings.model,
                deadline_s=settings.lookup_deadline_s,
                settings=self._index_settings,
            )
            logs = event_logs(index) if self._index_settings.event_log else None
            if logs is not None:
                source.follower = IndexFollower(index, logs,
                                                log_entries=self._index_settings.event_log,
                                                on_lag=self._follower_lag.observe)
                self._spawn(_follow_while_ray_runs(source.follower))
        return source.index

    async def _predict(self, index: PrefixIndex, prediction: Prediction) -> None:
        """Only the blocks the worker does not hold yet; other routers see them at once."""
        try:
            await asyncio.wait_for(
                index.predict(prediction.chain, prediction.worker_id,
                              from_block=prediction.from_block),
                timeout=self._source.wait_s,
            )
        except Exception as exc:  # advisory only
            logger.debug("predicted entry not written: %r", exc)

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = self.spawn(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _maybe_check_workers(self, replicas: list[RunningReplica], now: float) -> None:
        """Start a check when due; before the first one has an answer, every request waits for
        it (a burst at start-up must not be routed blind), later ones run in the background."""
        task = self._check_task
        if (task is None or task.done()) and self._state.gate.check_due(now):
            task = self._check_task = self.spawn(self._check_workers(replicas))
            task.add_done_callback(_log_failure)
        if self._state.gate.compatible is None and task is not None and not task.done():
            await asyncio.shield(task)

    async def _check_workers(self, replicas: list[RunningReplica]) -> None:
        index = self._get_index()
        if index is None:
            return
        now = time.time()
        try:
            workers = await asyncio.wait_for(index.live_workers(), timeout=0.5)
        except Exception as exc:
            logger.debug("worker check postponed, index unavailable: %r", exc)
            self._state.gate.check_postponed(now)
            return
        self._state.gate.check_workers(workers, self._candidates(replicas), now)


async def _follow_while_ray_runs(follower: IndexFollower) -> None:
    """Follow the index while this process is connected to Ray. A handle's router outlives its
    Serve app where the handle is kept (a test module, a notebook): once Ray is shut down, its
    loop must go quiet (a follower's work there outlived Ray and made Ray's core worker end
    the process)."""
    task = asyncio.ensure_future(follower.run())
    try:
        while not task.done() and ray.is_initialized():
            await asyncio.wait({task}, timeout=1.0)
    finally:
        task.cancel()


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


def _index_url(configured: str | None) -> str | None:
    """The index URL in this process; an unresolvable reference turns prefix routing off."""
    try:
        return resolve(configured) if configured else os.environ.get(REDIS_URL_ENV) or None
    except SecretNotFound as exc:
        logger.error("prefix index off: redis_url %s: %s", configured, exc)
        return None
