"""Worker streams at the ingress: `merge_streams` interleaves them and re-sends a prompt whose
worker died, or went silent past the progress deadline, before any of its output was passed on;
`to_api_error` maps worker failures. Plain async iterators stand in for Serve's response
generators; the cluster-level behaviour is in tests/test_faults_cluster.py (a replica killed
under load) and tests/test_worker_stall.py (a worker process stopped)."""

from __future__ import annotations

import asyncio

import pytest
from ray.exceptions import ActorDiedError, TaskCancelledError

from prefixserve.cluster.generation import (
    MAX_WORKER_RETRIES,
    WorkerStalled,
    merge_streams,
    to_api_error,
)
from prefixserve.router.request import TokenDelta

KEEPALIVE = "~"  # an item that stands for a keepalive delta


class Stream:
    """Yields ``items`` (as deltas named by ``worker``; KEEPALIVE: a keepalive), each after
    ``gap_s``; raises ActorDiedError after ``die_after`` of them, or goes silent for ever after
    ``silent_after`` (None: never)."""

    def __init__(self, items: list[str], die_after: int | None = None,
                 silent_after: int | None = None, gap_s: float = 0.0) -> None:
        self.items = list(items)
        self.die_after = die_after
        self.silent_after = silent_after
        self.gap_s = gap_s
        self.sent = 0
        self.cancelled = False

    def __aiter__(self) -> Stream:
        return self

    async def __anext__(self) -> TokenDelta:
        if self.die_after is not None and self.sent == self.die_after:
            raise ActorDiedError()
        if self.silent_after is not None and self.sent == self.silent_after:
            await asyncio.Event().wait()
        if self.sent == len(self.items):
            raise StopAsyncIteration
        await asyncio.sleep(self.gap_s)
        self.sent += 1
        item = self.items[self.sent - 1]
        if item == KEEPALIVE:
            return TokenDelta.alive("w")
        return TokenDelta(0, [], None, False, None, 0, 0, worker=item)

    def cancel(self) -> None:
        self.cancelled = True


def starter(plans: dict[int, list[Stream]]):
    """start(i) hands out prompt i's streams in order: first attempt, then retries."""
    started: dict[int, int] = {i: 0 for i in plans}

    def start(i: int) -> Stream:
        started[i] += 1
        return plans[i][started[i] - 1]

    return start, started


def merged(start, count: int):
    """As Generation uses it: a prompt may be re-sent until something of it was passed on."""
    shown: set[int] = set()

    async def gen():
        async for i, item in merge_streams(start, count, lambda _: False, lambda i: i not in shown):
            shown.add(i)
            yield i, item.worker

    return gen()


async def collect(start, count: int) -> list[tuple[int, str]]:
    return [x async for x in merged(start, count)]


async def test_a_stream_whose_worker_dies_before_output_is_sent_again() -> None:
    start, started = starter({0: [Stream(["a1", "a2"])],
                              1: [Stream(["x"], die_after=0), Stream(["b1", "b2"])]})
    got = await collect(start, 2)
    assert sorted(got) == [(0, "a1"), (0, "a2"), (1, "b1"), (1, "b2")]
    assert started == {0: 1, 1: 2}


async def test_a_stream_that_already_produced_output_is_not_sent_again() -> None:
    start, started = starter({0: [Stream(["a1", "a2", "a3"], die_after=1), Stream(["never"])]})
    got = []
    with pytest.raises(ActorDiedError):
        async for item in merged(start, 1):
            got.append(item)
    assert got == [(0, "a1")] and started == {0: 1}  # the client saw a1: no silent restart


async def test_output_not_passed_on_yet_does_not_stop_a_retry() -> None:
    """Tokens that decode to no text yet (a partial UTF-8 character) reach nobody."""
    first, again = Stream(["partial"], die_after=1), Stream(["whole"])
    start, started = starter({0: [first, again]})
    passed_on: list[str] = []
    async for _, item in merge_streams(start, 1, lambda _: False, lambda _: not passed_on):
        if item.worker != "partial":
            passed_on.append(item.worker)
    assert passed_on == ["whole"] and started == {0: 2}


async def test_retries_are_bounded() -> None:
    dead = [Stream([], die_after=0) for _ in range(MAX_WORKER_RETRIES + 2)]
    start, started = starter({0: dead})
    with pytest.raises(ActorDiedError):
        await collect(start, 1)
    assert started == {0: MAX_WORKER_RETRIES + 1}


async def test_a_consumer_that_stops_cancels_the_unfinished_streams() -> None:
    a, b = Stream(["a1", "a2", "a3"]), Stream(["b1", "b2", "b3"])
    start, _ = starter({0: [a], 1: [b]})
    stream = merge_streams(start, 2, lambda _: False, lambda _: True)
    await stream.__anext__()
    await stream.aclose()
    assert a.cancelled and b.cancelled


async def test_a_silent_stream_before_output_is_sent_again_and_reported() -> None:
    silent, again = Stream(["never"], silent_after=0), Stream(["b1", "b2"])
    start, started = starter({0: [Stream(["a1"])], 1: [silent, again]})
    stalled: list[int] = []
    got = [(i, item.worker) async for i, item in merge_streams(
        start, 2, lambda _: False, lambda _: True, deadline_s=0.2, on_stall=stalled.append)]
    assert sorted(got) == [(0, "a1"), (1, "b1"), (1, "b2")]
    assert stalled == [1] and started == {0: 1, 1: 2} and silent.cancelled


async def test_keepalives_hold_off_the_deadline_and_are_not_passed_on() -> None:
    slow = Stream([KEEPALIVE] * 8 + ["late"], gap_s=0.05)  # 0.45 s, never 0.2 s silent
    start, started = starter({0: [slow]})
    stalled: list[int] = []
    got = [item.worker async for _, item in merge_streams(
        start, 1, lambda _: False, lambda _: True, deadline_s=0.2, on_stall=stalled.append)]
    assert got == ["late"] and stalled == [] and started == {0: 1}


async def test_a_stream_silent_after_output_ends_with_worker_stalled() -> None:
    stream = Stream(["a1", "a2"], silent_after=1)
    start, started = starter({0: [stream, Stream(["never"])]})
    stalled: list[int] = []
    got = []
    with pytest.raises(WorkerStalled):
        async for _, item in merge_streams(start, 1, lambda _: False, lambda _: not got,
                                           deadline_s=0.2, on_stall=stalled.append):
            got.append(item.worker)
    assert got == ["a1"] and stalled == [0] and started == {0: 1} and stream.cancelled
    error = to_api_error(WorkerStalled("silent"))
    assert (error.status, error.body.error.code) == (503, "worker_stalled")


def test_worker_failures_map_to_statuses_without_an_internal_error() -> None:
    dead = to_api_error(ActorDiedError())
    assert dead.status == 503 and dead.body.error.code == "worker_unavailable"
    gone = to_api_error(TaskCancelledError())  # the client disconnected
    assert gone.status == 503 and gone.body.error.code == "cancelled"
    assert to_api_error(ValueError("bug")).status == 500
