"""What every routing policy does with a handle call before its own choice, in one place.

A call aimed at one replica (``target_worker=<replica id>``: per-worker ``stats``,
``cached_block_hashes``, ``reset_prefix_cache``) goes to that replica only, and fails with
:class:`NoSuchReplica` once none by that id has run for ``target_wait_s`` (Serve itself would
retry it for ever). A call without a ``GenerateRequest`` goes to any replica. A generate call is
the policy's to rank, among the replicas not marked stalled (:mod:`router.worker_watch`) while
any such remains; a ranking that raises falls back to a random order, so that a bug there never
strands a request. Policies built on these helpers fulfil pending calls by identity
(:class:`router.serve_compat.ServeRequestRouter`), so a chosen replica reaches the very call it
was chosen for.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from prefixserve.router.request import GenerateRequest
from prefixserve.router.serve_compat import (
    PendingRequest,
    RunningReplica,
    ServeRequestRouter,
    call_arguments,
    call_option,
    created_at,
    replica_key,
)
from prefixserve.router.worker_watch import WATCH

logger = logging.getLogger("ray.serve")

TARGET_WAIT_S = 10.0  # how long a call for one named replica waits for it to appear (default)

Tiers = list[list[RunningReplica]]
Rank = Callable[[list[RunningReplica], PendingRequest, GenerateRequest], Awaitable[Tiers]]


class NoSuchReplica(LookupError):
    """A ``target_worker`` call named a replica that is not running (dead, or never was)."""


async def route_call(
    router: ServeRequestRouter,
    candidates: list[RunningReplica],
    pending: PendingRequest | None,
    rank: Rank,
    *,
    target_wait_s: float = TARGET_WAIT_S,
    on_error: Callable[[], None] | None = None,
) -> Tiers:
    """The replicas to try for one call, in tiers (Serve's ``choose_replicas`` contract)."""
    if not candidates:
        return []
    target = call_option(pending, "target_worker")
    if pending is not None and target is not None:
        return _route_to_target(router, candidates, pending, target, target_wait_s)
    request = generate_request(pending)
    if pending is None or request is None:  # not a generate call: any replica
        return [random.sample(candidates, len(candidates))]
    candidates = WATCH.usable(candidates, replica_key)
    try:
        return await rank(candidates, pending, request)
    except Exception:
        logger.exception("%s failed to rank replicas; routing in a random order instead",
                         type(router).__name__)
        if on_error is not None:
            on_error()
        return [random.sample(candidates, len(candidates))]


def ranked_tiers(candidates: Sequence[RunningReplica], order: Sequence[str]) -> Tiers:
    """``[[first], [the rest in order]]`` from replica keys, best first."""
    by_key = {replica_key(r): r for r in candidates}
    tiers = [[by_key[order[0]]]]
    if len(order) > 1:
        tiers.append([by_key[k] for k in order[1:]])
    return tiers


def generate_request(pending: PendingRequest | None) -> GenerateRequest | None:
    """The call's ``GenerateRequest`` argument, if it has one."""
    if pending is None:
        return None
    for arg in call_arguments(pending):
        if isinstance(arg, GenerateRequest):
            return arg
    return None


def _route_to_target(router: ServeRequestRouter, candidates: list[RunningReplica],
                     pending: PendingRequest, target: str, wait_s: float) -> Tiers:
    chosen = [r for r in candidates if replica_key(r) == target]
    if chosen or time.time() - created_at(pending) < wait_s:
        return [chosen]
    router.fail_pending(pending, NoSuchReplica(
        f"no running replica {target!r} in {router.deployment_name} "
        f"(running: {sorted(replica_key(r) for r in candidates)})"
    ))
    return [candidates]  # Serve's routing loop sees the call done and drops it


class ServeRanked(ServeRequestRouter):
    """A policy whose generate calls a Serve router class after this one in the MRO ranks
    (``class P(ServeRanked, PowerOfTwoChoicesRequestRouter)``); every other call is routed
    here, as under every policy."""

    def initialize_state(self, target_wait_s: float = TARGET_WAIT_S, **kwargs: Any) -> None:
        """`target_wait_s` is the router section's; the rest is the Serve router's own."""
        self._target_wait_s = target_wait_s
        super().initialize_state(**kwargs)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> Tiers:
        return await route_call(self, candidate_replicas, pending_request, self._serve_ranks,
                                target_wait_s=self._target_wait_s)

    async def _serve_ranks(self, candidates: list[RunningReplica], pending: PendingRequest,
                           request: GenerateRequest) -> Tiers:
        return await super().choose_replicas(candidates, pending)
