"""bench/micro/decision_floor.py against a real redis-server: every decision finds the worker that
holds its prompt, with the held prompt's whole depth confirmed."""

from __future__ import annotations

import asyncio

import pytest

from prefixserve.bench.micro.decision_floor import measure, table

pytestmark = pytest.mark.cluster


def test_each_decision_finds_the_worker_holding_its_prompt(redis_server) -> None:
    floors = asyncio.run(measure(redis_server.url, [64, 1000], workers=5, prompts_per_length=3,
                                 rounds=2))
    assert [(f.tokens, f.decisions, f.found) for f in floors] == [(64, 3, 3), (1000, 3, 3)]
    for f in floors:
        assert all(0 < low <= high for low, high in zip(f.p50, f.p99, strict=True))
        assert f.p50[3] >= max(f.p50[:3])  # the whole decision holds each part
        assert len(f.p50) == len(f.p99) == 5
    lines = table(floors).splitlines()
    assert len(lines) == 3 and lines[1].split()[:3] == ["64", "3", "3"]
    assert lines[0].split()[:4] == ["tokens", "decisions", "found", "hashing"]
