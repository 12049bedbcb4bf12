"""bench/micro/round_trip.py against a real redis-server: both kinds of round trip, the spin between
them, the bounds and the printed line."""

from __future__ import annotations

import time

import pytest
import redis

from prefixserve.bench.micro.round_trip import RoundTrips, measure, spin, timed_pings

pytestmark = pytest.mark.cluster


def test_spin_keeps_busy_for_at_least_the_time_asked() -> None:
    start = time.perf_counter()
    spin(0.02)
    assert time.perf_counter() - start >= 0.02


def test_timed_pings_spin_before_each_ping(redis_server) -> None:
    client = redis.Redis.from_url(redis_server.url)
    before = client.info("commandstats").get("cmdstat_ping", {}).get("calls", 0)
    start = time.perf_counter()
    times = timed_pings(client, 5, 0.01)
    elapsed = time.perf_counter() - start
    after = client.info("commandstats")["cmdstat_ping"]["calls"]
    client.close()
    assert len(times) == 5 and all(t > 0 for t in times)
    assert after - before == 5
    assert elapsed >= 5 * 0.01 + sum(times)


def test_measure_reports_both_kinds_in_ms(redis_server) -> None:
    client = redis.Redis.from_url(redis_server.url)
    before = client.info("commandstats").get("cmdstat_ping", {}).get("calls", 0)
    trips = measure(redis_server.url, rounds=60, work_s=0.002)
    after = client.info("commandstats")["cmdstat_ping"]["calls"]
    client.close()
    assert after - before == 1 + 2 * 60  # a connecting PING, then 60 of each kind
    assert trips.work_ms == 2.0
    assert 0 < trips.back_to_back_p50_ms <= trips.back_to_back_p99_ms < 1000
    assert 0 < trips.after_work_p50_ms <= trips.after_work_p99_ms < 1000


@pytest.mark.parametrize(("rounds", "work_s"), [(0, 0.001), (10, 0.0), (10, -0.001)])
def test_measure_refuses_nothing_to_measure(rounds: int, work_s: float) -> None:
    with pytest.raises(ValueError, match="rounds must be >= 1 and work_s > 0"):
        measure("redis://127.0.0.1:1/0", rounds, work_s)


def test_line_names_each_figure() -> None:
    trips = RoundTrips(3.0, 0.1234, 0.5, 0.4, 1.25)
    assert trips.line() == ("redis PING round trip, ms: back to back p50 0.123 p99 0.500; "
                            "after 3 ms of work p50 0.400 p99 1.250")
