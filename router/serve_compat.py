"""Everything the request routers touch of Ray Serve, in one place.

Serve's request-router API is young (``ray.serve.request_router`` is marked developer API) and
the prefix-aware router also needs a few of its private parts: pending requests' fields,
replica ids, the queue-length cache, the pending-request bookkeeping. When a Ray upgrade moves
any of them, this module is the one to change; the routers and the pure
:mod:`router.router_state` do not import Serve otherwise.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from ray.serve._private.common import RequestMetadata
from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from prefixserve.router.request import GenerateRequest
from prefixserve.router.worker_watch import WATCH

__all__ = [
    "PendingRequest",
    "PowerOfTwoChoicesRequestRouter",
    "ReplicaID",
    "RequestMetadata",
    "RequestRouter",
    "RunningReplica",
    "ServeRequestRouter",
    "call_arguments",
    "call_option",
    "internal_request_id",
    "replica_key",
    "routing_stats",
]


def replica_key(replica: RunningReplica | ReplicaID) -> str:
    """The replica's unique id: the key of every per-worker record (and of the index's)."""
    replica_id = replica if isinstance(replica, ReplicaID) else replica.replica_id
    return replica_id.unique_id


def routing_stats(replica: RunningReplica) -> dict[str, Any]:
    """What the replica's ``record_routing_stats`` last reported (empty before the first)."""
    return replica.routing_stats or {}


def call_arguments(pr: PendingRequest) -> tuple[Any, ...]:
    """The handle call's positional and keyword argument values, in order."""
    return (*pr.args, *pr.kwargs.values())


def call_option(pr: PendingRequest | None, name: str) -> Any:
    """One keyword argument of the handle call (None when absent or there is no call)."""
    return pr.kwargs.get(name) if pr is not None else None


def internal_request_id(pr: PendingRequest) -> str:
    """Serve's id of the request; handle calls made while serving one request share it."""
    return pr.metadata.internal_request_id


def created_at(pr: PendingRequest) -> float:
    """When the handle call was made (``time.time()``)."""
    return pr.created_at


class ServeRequestRouter(RequestRouter):
    """Serve's ``RequestRouter`` with its private parts behind stable, named methods, and the
    pending requests fulfilled by identity instead of by request id."""

    @property
    def deployment_name(self) -> str:
        return self._deployment_id.name

    def queue_len(self, replica: RunningReplica) -> int | None:
        """Serve's cached count of the replica's ongoing requests (None when unknown)."""
        return self._replica_queue_len_cache.get(replica.replica_id)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
        """A task on the router's event loop (the handle's, not the caller's)."""
        return self._event_loop.create_task(coro)

    def fail_pending(self, pr: PendingRequest, exc: Exception) -> None:
        """Fail the call with ``exc`` and stop routing it (Serve would retry it for ever)."""
        if not pr.future.done():
            pr.future.set_exception(exc)
            self._remove_pending_request_from_indices(pr)

    async def _choose_replica_for_request(self, pending_request: PendingRequest, *,
                                          is_retry: bool = False) -> RunningReplica:
        """Serve's choice, noted in the process's :data:`WATCH` before the call is sent (a
        replica that never answers is known by it too)."""
        replica = await super()._choose_replica_for_request(pending_request, is_retry=is_retry)
        for arg in call_arguments(pending_request):
            if isinstance(arg, GenerateRequest):
                WATCH.sent(arg.request_id, replica_key(replica))
                self.on_replica_chosen(pending_request, arg, replica_key(replica))
        return replica

    def on_replica_chosen(self, pending_request: PendingRequest, request: GenerateRequest,
                          replica: str) -> None:
        """Serve chose ``replica`` for ``request``, which has not left yet: a router may still
        write what travels with it."""

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Serve's new replica set, noted in :data:`WATCH` too."""
        super().update_replicas(replicas)
        WATCH.set_running(replica_key(r) for r in replicas)

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
