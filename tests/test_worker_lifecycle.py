"""LLMWorker without Ray: fair admission across tenants, the stall health check, and the drain
of in-flight streams on shutdown."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import replace

import pytest
from test_worker_replica import GREEDY, PROMPT, collect, make_worker

from prefixserve.router.request import GenerateRequest, TokenDelta
from prefixserve.workers.deployment import LLMWorker
from prefixserve.workers.scheduler import SchedulerOutput


def wrap_execute(worker: LLMWorker, before: Callable[[], None]) -> None:
    """Run ``before`` on the engine thread ahead of every forward pass."""
    runner = worker.engine.runner
    real = runner.execute

    def execute(sched: SchedulerOutput, adapters=None):
        before()
        return real(sched, adapters)

    runner.execute = execute


def slow_steps(worker: LLMWorker, seconds: float) -> None:
    wrap_execute(worker, lambda: time.sleep(seconds))


def text(deltas: list[TokenDelta]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


async def test_a_late_tenant_is_served_before_a_flood_ahead_of_it() -> None:
    w = await make_worker()  # max_num_seqs=8
    try:
        slow_steps(w, 0.005)
        order: list[str] = []

        async def run(request: GenerateRequest) -> None:
            await collect(w, request)
            order.append(request.request_id)

        flood = [GenerateRequest(f"a{i}", PROMPT, GREEDY, tenant="A") for i in range(40)]
        tasks = [asyncio.create_task(run(r)) for r in flood]
        await asyncio.sleep(0.05)  # A's flood is queued in the worker first
        tasks.append(asyncio.create_task(run(GenerateRequest("b", PROMPT, GREEDY, tenant="B"))))
        await asyncio.gather(*tasks)
        # FIFO would finish "b" last; fair admission gives it the first slot that frees
        assert order.index("b") < 20, order
    finally:
        await w.shutdown()


async def test_health_fails_while_a_step_is_stuck_and_recovers() -> None:
    w = await make_worker(stall_timeout_s=0.5)
    gate = threading.Event()
    try:
        await asyncio.sleep(1.0)  # idle for longer than the limit is healthy
        await w.check_health()
        wrap_execute(w, lambda: gate.wait(10))
        task = asyncio.create_task(collect(w, GenerateRequest("s", PROMPT, GREEDY)))
        await asyncio.sleep(0.1)
        await w.check_health()  # stuck, but not for long yet
        await asyncio.sleep(0.6)
        with pytest.raises(RuntimeError, match="engine loop stuck for"):
            await w.check_health()
        gate.set()
        deltas = await asyncio.wait_for(task, 10)
        assert deltas[-1].finish_reason == "length"
        await w.check_health()
    finally:
        gate.set()
        await w.shutdown()


async def test_shutdown_lets_a_stream_finish_within_the_drain_timeout() -> None:
    w = await make_worker()
    slow_steps(w, 0.02)
    request = GenerateRequest("d", PROMPT, replace(GREEDY, max_tokens=20))
    task = asyncio.create_task(collect(w, request))
    await asyncio.sleep(0.1)
    started = time.monotonic()
    await w.shutdown(timeout_s=30)
    assert time.monotonic() - started < 5  # returns when the stream ends, not at the timeout
    deltas = task.result()
    assert len(text(deltas)) == 20 and deltas[-1].finish_reason == "length"
    with pytest.raises(RuntimeError):  # stopped: nothing new is taken
        await collect(w, GenerateRequest("late", PROMPT, GREEDY))


async def test_shutdown_aborts_streams_that_outlast_the_drain_timeout() -> None:
    w = await make_worker(drain_timeout_s=0.3)
    slow_steps(w, 0.02)
    long = GenerateRequest("long", PROMPT, replace(GREEDY, max_tokens=500))
    task = asyncio.create_task(collect(w, long))
    await asyncio.sleep(0.2)
    assert w.engine.kv.num_free_blocks < w.engine.kv.num_total_blocks
    started = time.monotonic()
    await w.__del__()  # Serve's graceful-shutdown hook: the configured drain timeout
    assert 0.25 < time.monotonic() - started < 3
    deltas = await asyncio.wait_for(task, 5)
    assert deltas[-1].finished and deltas[-1].finish_reason == "abort"
    assert 0 < len(text(deltas)) < 500
    assert not w._loop_thread.is_alive()
    assert w.engine.kv.num_free_blocks == w.engine.kv.num_total_blocks
    assert not w.engine.has_unfinished()
