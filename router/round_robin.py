"""`RoundRobinRequestRouter`: the cache-blind baseline the prefix-aware router is measured against.

Each routing decision takes the next replica in a fixed order (sorted by replica id, so the order
survives replica-set updates); the others follow as fallbacks in the same rotation, so Serve moves
on to the next one when the first is full. FIFOMixin: Serve gives all handle calls made while
serving one request the parent's internal request id, so exact-id matching would leave all but
the first of concurrent calls (a batch of prompts) unrouted; FIFO fulfilment does not care.
"""

from __future__ import annotations

import itertools

from prefixserve.router.serve_compat import (
    FIFOMixin,
    PendingRequest,
    RequestRouter,
    RunningReplica,
    replica_key,
)


class RoundRobinRequestRouter(FIFOMixin, RequestRouter):
    def initialize_state(self) -> None:
        self._turn = itertools.count()

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        ordered = sorted(candidate_replicas, key=replica_key)
        start = next(self._turn) % len(ordered)
        rotation = ordered[start:] + ordered[:start]
        return [[rotation[0]], rotation[1:]] if len(rotation) > 1 else [rotation]
