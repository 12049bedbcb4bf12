"""Which worker each generate call went to, and which workers stopped answering.

The ingress and its handle's request router share one process (Serve runs a handle's router in
the process that holds the handle), so they share this record. The router notes the replica it
sends each generate call to; the ingress, whose progress deadline saw a call go silent, marks
that replica stalled and probes it; every routing policy leaves stalled replicas out while any
other remains (:func:`router.call_routing.route_call`), until the replica answers a probe.
The router also notes the replicas Serve lists as running, which the ingress's readiness check
asks in turn. The two run on different threads, hence the lock.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

T = TypeVar("T")
MAX_SENT = 100_000  # calls remembered; a call the ingress never forgot ages out past this


class WorkerWatch:
    """Calls' replicas by request id, and the stalled replicas."""

    def __init__(self, max_sent: int = MAX_SENT) -> None:
        self._lock = threading.Lock()
        self._sent: OrderedDict[str, str] = OrderedDict()
        self._max_sent = max_sent
        self._stalled: set[str] = set()
        self._running: frozenset[str] = frozenset()

    def set_running(self, replicas: Iterable[str]) -> None:
        """The replicas Serve routes to now; a stalled mark ends with its replica."""
        with self._lock:
            self._running = frozenset(replicas)
            self._stalled &= self._running

    def running(self) -> frozenset[str]:
        with self._lock:
            return self._running

    def sent(self, request_id: str, replica: str) -> None:
        """The call `request_id` went to `replica` (a retry's record replaces the last)."""
        with self._lock:
            self._sent.pop(request_id, None)
            self._sent[request_id] = replica
            if len(self._sent) > self._max_sent:
                self._sent.popitem(last=False)

    def replica_of(self, request_id: str) -> str | None:
        with self._lock:
            return self._sent.get(request_id)

    def forget(self, request_id: str) -> None:
        with self._lock:
            self._sent.pop(request_id, None)

    def stall(self, replica: str) -> bool:
        """Mark `replica` stalled; False if it already was."""
        with self._lock:
            fresh = replica not in self._stalled
            self._stalled.add(replica)
            return fresh

    def answered(self, replica: str) -> None:
        """`replica` answered again: routable."""
        with self._lock:
            self._stalled.discard(replica)

    def stalled(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._stalled)

    def usable(self, candidates: Sequence[T], key: Callable[[T], str]) -> list[T]:
        """`candidates` without the stalled ones, unless that leaves none (a stalled replica
        may yet answer; no replica at all would fail the call)."""
        stalled = self.stalled()
        if not stalled:
            return list(candidates)
        live = [c for c in candidates if key(c) not in stalled]
        return live or list(candidates)


WATCH = WorkerWatch()  # this process's
