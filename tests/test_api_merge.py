"""`cluster.api._merge`: interleaving worker streams, and re-sending a prompt whose worker died
before it produced anything. Plain async iterators stand in for Serve's response generators;
the cluster-level behaviour is in tests/test_faults_cluster.py (a replica killed under load)."""

from __future__ import annotations

import pytest
from ray.exceptions import ActorDiedError

from cluster.api import MAX_WORKER_RETRIES, _merge


class Stream:
    """Yields ``items``; raises ActorDiedError after ``die_after`` of them (None: never)."""

    def __init__(self, items: list[str], die_after: int | None = None) -> None:
        self.items = list(items)
        self.die_after = die_after
        self.sent = 0
        self.cancelled = False

    def __aiter__(self) -> Stream:
        return self

    async def __anext__(self) -> str:
        if self.die_after is not None and self.sent == self.die_after:
            raise ActorDiedError()
        if self.sent == len(self.items):
            raise StopAsyncIteration
        self.sent += 1
        return self.items[self.sent - 1]

    def cancel(self) -> None:
        self.cancelled = True


def starter(plans: dict[int, list[Stream]]):
    """start(i) hands out prompt i's streams in order: first attempt, then retries."""
    started: dict[int, int] = {i: 0 for i in plans}

    def start(i: int) -> Stream:
        started[i] += 1
        return plans[i][started[i] - 1]

    return start, started


async def collect(start, count: int) -> list[tuple[int, str]]:
    return [x async for x in _merge(start, count, lambda _: False)]


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
        async for item in _merge(start, 1, lambda _: False):
            got.append(item)
    assert got == [(0, "a1")] and started == {0: 1}  # the client saw a1: no silent restart


async def test_retries_are_bounded() -> None:
    dead = [Stream([], die_after=0) for _ in range(MAX_WORKER_RETRIES + 2)]
    start, started = starter({0: dead})
    with pytest.raises(ActorDiedError):
        await collect(start, 1)
    assert started == {0: MAX_WORKER_RETRIES + 1}


async def test_a_consumer_that_stops_cancels_the_unfinished_streams() -> None:
    a, b = Stream(["a1", "a2", "a3"]), Stream(["b1", "b2", "b3"])
    start, _ = starter({0: [a], 1: [b]})
    merged = _merge(start, 2, lambda _: False)
    await merged.__anext__()
    await merged.aclose()
    assert a.cancelled and b.cancelled
