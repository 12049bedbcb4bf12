"""`PowerOfTwoRequestRouter`: Ray Serve's power-of-two-choices router, the load-only baseline.

Generate calls are ranked by Serve's own ``PowerOfTwoChoicesRequestRouter`` (two random
replicas, the shorter queue); calls aimed at one replica and calls that generate nothing are
routed as under every policy (:mod:`router.call_routing`), and pending calls are fulfilled by
identity, so a replica chosen for a call reaches that call.
"""

from __future__ import annotations

from prefixserve.router.call_routing import Tiers, route_call
from prefixserve.router.request import GenerateRequest
from prefixserve.router.serve_compat import (
    PendingRequest,
    PowerOfTwoChoicesRequestRouter,
    RunningReplica,
    ServeRequestRouter,
)


class PowerOfTwoRequestRouter(ServeRequestRouter, PowerOfTwoChoicesRequestRouter):
    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> Tiers:
        return await route_call(self, candidate_replicas, pending_request, self._two_choices)

    async def _two_choices(self, candidates: list[RunningReplica], pending: PendingRequest,
                           request: GenerateRequest) -> Tiers:
        return await super().choose_replicas(candidates, pending)
