"""`RoundRobinRequestRouter`: the cache-blind baseline the prefix-aware router is measured against.

Each generate call takes the next replica in a fixed order (sorted by replica id, so the order
survives replica-set updates); the others follow as fallbacks in the same rotation, so Serve moves
on to the next one when the first is full. Calls aimed at one replica and other calls are routed
as every policy routes them (:mod:`router.call_routing`); pending calls are fulfilled by identity.
"""

from __future__ import annotations

import itertools

from prefixserve.router.call_routing import TARGET_WAIT_S, Tiers, route_call
from prefixserve.router.request import GenerateRequest
from prefixserve.router.serve_compat import (
    PendingRequest,
    RunningReplica,
    ServeRequestRouter,
    replica_key,
)


class RoundRobinRequestRouter(ServeRequestRouter):
    def initialize_state(self, target_wait_s: float = TARGET_WAIT_S) -> None:
        self._turn = itertools.count()
        self._target_wait_s = target_wait_s

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> Tiers:
        return await route_call(self, candidate_replicas, pending_request, self._rotate,
                                target_wait_s=self._target_wait_s)

    async def _rotate(self, candidates: list[RunningReplica], pending: PendingRequest,
                      request: GenerateRequest) -> Tiers:
        ordered = sorted(candidates, key=replica_key)
        start = next(self._turn) % len(ordered)
        rotation = ordered[start:] + ordered[:start]
        return [[rotation[0]], rotation[1:]] if len(rotation) > 1 else [rotation]
