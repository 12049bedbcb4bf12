"""`WorkerWatch`: the calls' replicas and the stalled replicas, and how every routing policy
leaves stalled replicas out (`route_call`) while calls aimed at one still reach it."""

from __future__ import annotations

from types import SimpleNamespace

from ray.serve._private.common import DeploymentID

from prefixserve.router.call_routing import route_call
from prefixserve.router.request import GenerateRequest
from prefixserve.router.serve_compat import PendingRequest, ReplicaID, RequestMetadata, replica_key
from prefixserve.router.worker_watch import WATCH, WorkerWatch


def test_sent_calls_are_remembered_boundedly_and_forgotten() -> None:
    watch = WorkerWatch(max_sent=2)
    assert watch.running() == frozenset() and watch.stalled() == frozenset()
    watch.sent("r1", "a")
    watch.sent("r2", "a")
    assert (watch.replica_of("r1"), watch.replica_of("r2")) == ("a", "a")  # two fit
    watch.sent("r1", "b")  # a retry's record replaces the first, and is the newest now
    watch.sent("r3", "a")
    assert watch.replica_of("r2") is None  # the oldest aged out
    assert (watch.replica_of("r1"), watch.replica_of("r3")) == ("b", "a")
    watch.forget("r3")
    watch.forget("never sent")  # the ingress forgets every call, sent or not
    assert (watch.replica_of("r3"), watch.replica_of("r1")) == (None, "b")


def test_stalled_replicas_are_left_out_unless_none_would_remain() -> None:
    watch = WorkerWatch()
    assert watch.stall("a") and not watch.stall("a")  # True only when newly stalled
    assert watch.usable(["a", "b"], str) == ["b"]
    assert watch.usable(["a"], str) == ["a"]  # a stalled one may yet answer; none fails
    watch.answered("a")
    assert watch.usable(["a", "b"], str) == ["a", "b"] and watch.stalled() == frozenset()


def test_a_replica_that_leaves_takes_its_stalled_mark_along() -> None:
    watch = WorkerWatch()
    watch.set_running(["a", "b"])
    watch.stall("a")
    watch.set_running(["b", "c"])  # Serve replaced a
    assert watch.stalled() == frozenset() and watch.running() == {"b", "c"}


def _replica(key: str) -> SimpleNamespace:
    return SimpleNamespace(replica_id=ReplicaID(key, DeploymentID("LLMWorker", "app")))


async def test_route_call_ranks_only_replicas_not_stalled() -> None:
    replicas = [_replica("a"), _replica("b")]
    ranked: list[list[str]] = []

    async def rank(candidates, pending, request):
        ranked.append([replica_key(c) for c in candidates])
        return [candidates]

    generate = PendingRequest([GenerateRequest("x", [1])], {}, RequestMetadata("r", "i"),
                              future=None)
    target = PendingRequest([], {"target_worker": "a"}, RequestMetadata("s", "j"), future=None)
    WATCH.stall("a")
    try:
        await route_call(None, replicas, generate, rank)
        assert ranked == [["b"]]
        tiers = await route_call(None, replicas, target, rank)  # a probe still reaches it
        assert [[replica_key(r) for r in tier] for tier in tiers] == [["a"]]
    finally:
        WATCH.answered("a")
    await route_call(None, replicas, generate, rank)
    assert ranked[-1] == ["a", "b"]
