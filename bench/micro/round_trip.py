"""What one round trip to Redis costs on this machine, back to back and after a stretch of work.

A router's decision is work (hashing, ranking) then one index lookup. On a virtual machine a
process that has waited a few milliseconds is descheduled, and waking it (Redis for the call,
then the router for the reply) can cost more than the lookup's own work: on the 2-vCPU VM this
project is developed on, a PING after 3 ms of work took several times as long as one sent back
to back. The simulator prints these figures next to its decision times, so a reader can tell
the router's cost from the machine's, and compare runs made on different machines.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import redis

from prefixserve.bench.percentile import percentile
from prefixserve.cluster.local_redis import LocalRedis


@dataclass(frozen=True)
class RoundTrips:
    """PING round trips in ms: sent back to back, and each after ``work_ms`` of busy work."""

    work_ms: float
    back_to_back_p50_ms: float
    back_to_back_p99_ms: float
    after_work_p50_ms: float
    after_work_p99_ms: float

    def line(self) -> str:
        return (f"redis PING round trip, ms: back to back p50 {self.back_to_back_p50_ms:.3f} "
                f"p99 {self.back_to_back_p99_ms:.3f}; after {self.work_ms:g} ms of work p50 "
                f"{self.after_work_p50_ms:.3f} p99 {self.after_work_p99_ms:.3f}")


def spin(seconds: float) -> None:
    """Keep this CPU busy (no sleep: a router computes between its lookups)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def timed_pings(client: redis.Redis, rounds: int, work_s: float) -> list[float]:
    """Seconds per PING, each after ``work_s`` of spinning."""
    out = []
    for _ in range(rounds):
        spin(work_s)
        start = time.perf_counter()
        client.ping()
        out.append(time.perf_counter() - start)
    return out


def measure(url: str, rounds: int = 200, work_s: float = 0.003) -> RoundTrips:
    """Both kinds of round trip on one connection, alternating in blocks so that a noisy moment
    of the machine falls on both."""
    if rounds < 1 or work_s <= 0:
        raise ValueError("rounds must be >= 1 and work_s > 0")
    client = redis.Redis.from_url(url)
    try:
        client.ping()  # connect outside the timed calls
        quick: list[float] = []
        slow: list[float] = []
        for block in range(0, rounds, 50):
            size = min(50, rounds - block)
            quick += timed_pings(client, size, 0.0)
            slow += timed_pings(client, size, work_s)
    finally:
        client.close()
    quick_ms, slow_ms = [t * 1000 for t in quick], [t * 1000 for t in slow]
    return RoundTrips(work_s * 1000, percentile(quick_ms, 50), percentile(quick_ms, 99),
                      percentile(slow_ms, 50), percentile(slow_ms, 99))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", default=None, help="default: a private redis-server")
    parser.add_argument("--rounds", type=int, default=1000)
    parser.add_argument("--work-ms", type=float, default=3.0)
    args = parser.parse_args(argv)
    if args.redis_url:
        trips = measure(args.redis_url, args.rounds, args.work_ms / 1000)
    else:
        server = LocalRedis().start()
        try:
            trips = measure(server.url, args.rounds, args.work_ms / 1000)
        finally:
            server.close()
    print(trips.line())
    print(asdict(trips))


if __name__ == "__main__":
    main()
