"""LLMWorker without Ray: streaming, cancellation, errors, n > 1, and publishing to the index."""

from __future__ import annotations

import asyncio
import time

import pytest

from prefixserve.cluster.local_redis import LocalRedis, free_port
from prefixserve.router.blocks import hash_chain, namespace
from prefixserve.router.index_stores import open_index
from prefixserve.router.request import GenerateRequest, TokenDelta, TokenLogprob
from prefixserve.router.sampling_params import SamplingParams
from prefixserve.workers.builtin import ensure_builtin_model
from prefixserve.workers.deployment import LLMWorker
from prefixserve.workers.engine_loop import to_deltas
from prefixserve.workers.engine_types import RequestOutput
from prefixserve.workers.errors import InvalidRequestError

ENGINE = {"num_blocks": 64, "block_size": 16, "max_num_seqs": 8}
PROMPT = [(i * 7) % 250 for i in range(40)]
GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


async def make_worker(redis_url: str | None = None, **kwargs) -> LLMWorker:
    worker = LLMWorker.__new__(LLMWorker)
    await worker.__init__(str(ensure_builtin_model()), ENGINE, redis_url, "tiny",
                          **{"stream_interval": 1, "drain_timeout_s": 5.0, **kwargs})
    return worker


async def collect(worker: LLMWorker, request: GenerateRequest) -> list[TokenDelta]:
    return [d async for d in worker.generate(request)]


async def wait_idle(worker: LLMWorker, timeout_s: float = 5.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = await worker.stats()
        if stats["num_free_blocks"] == stats["num_total_blocks"] or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.02)


@pytest.fixture
async def worker():
    w = await make_worker()
    yield w
    await w.shutdown()


async def test_streams_deltas_and_reuses_the_prefix(worker: LLMWorker) -> None:
    first = await collect(worker, GenerateRequest("a", PROMPT, GREEDY))
    assert sum(len(d.token_ids) for d in first) == 4
    assert first[-1].finished and first[-1].finish_reason == "length"
    assert not any(d.finished for d in first[:-1])
    assert {d.worker for d in first} == {worker.replica_id}
    assert first[0].num_prompt_tokens == 40 and first[0].num_cached_tokens == 0
    second = await collect(worker, GenerateRequest("a", PROMPT, GREEDY))  # same id is fine
    assert second[0].num_cached_tokens == 32  # two full blocks
    assert [t for d in second for t in d.token_ids] == [t for d in first for t in d.token_ids]
    stats = await wait_idle(worker)
    assert stats["prompt_tokens_hit"] == 32 and stats["prompt_tokens_queried"] == 80


async def test_closing_the_stream_aborts_and_frees_blocks(worker: LLMWorker) -> None:
    request = GenerateRequest("long", PROMPT, SamplingParams(max_tokens=500, ignore_eos=True))
    stream = worker.generate(request)
    got = [await stream.__anext__() for _ in range(2)]
    assert all(not d.finished for d in got)
    busy = await worker.stats()
    assert busy["num_free_blocks"] < busy["num_total_blocks"]
    await stream.aclose()
    stats = await wait_idle(worker)
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert stats["num_running"] == 0


async def test_a_cancelled_consumer_task_aborts_too(worker: LLMWorker) -> None:
    request = GenerateRequest("c", PROMPT, SamplingParams(max_tokens=500, ignore_eos=True))
    task = asyncio.create_task(collect(worker, request))
    await asyncio.sleep(0.3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    stats = await wait_idle(worker)
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


async def test_bad_requests_fail_alone_and_the_loop_keeps_serving(worker: LLMWorker) -> None:
    with pytest.raises(InvalidRequestError, match="sampling must be a SamplingParams"):
        await collect(worker, GenerateRequest("x", PROMPT, {"max_tokens": 4}))  # type: ignore
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        await collect(worker, GenerateRequest("x", PROMPT, SamplingParams(max_tokens=0)))
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        await collect(worker, GenerateRequest("x", [1, 2, 10**6], GREEDY))
    with pytest.raises(InvalidRequestError, match="empty"):
        await collect(worker, GenerateRequest("x", [], GREEDY))
    ok = await collect(worker, GenerateRequest("y", PROMPT, GREEDY))
    assert ok[-1].finished
    await worker.check_health()


async def test_n_samples_each_finish(worker: LLMWorker) -> None:
    deltas = await collect(
        worker, GenerateRequest("n", PROMPT, SamplingParams(max_tokens=3, n=2, ignore_eos=True))
    )
    finished = {d.index: d.finish_reason for d in deltas if d.finished}
    assert finished == {0: "length", 1: "length"}
    assert sum(len(d.token_ids) for d in deltas if d.index == 1) == 3


async def test_routing_stats_describe_the_worker(worker: LLMWorker) -> None:
    stats = worker.record_routing_stats()
    assert stats["block_size"] == 16 and stats["fingerprint"] == worker.fingerprint
    assert stats["load"]["num_running"] == 0
    snapshot, _ = worker._loop_thread.snapshot
    assert stats["load"]["kv_empty_blocks"] == snapshot.num_empty_blocks > 0
    assert stats["load"]["kv_total_blocks"] == snapshot.num_total_blocks > 0
    assert stats["worker"] == worker.replica_id


@pytest.mark.cluster
async def test_publishes_blocks_and_deregisters(redis_server: LocalRedis) -> None:
    w = await make_worker(redis_url=redis_server.url, heartbeat_interval_s=0.2)
    index = open_index(redis_server.url, "tiny", deadline_s=1.0)
    try:
        await collect(w, GenerateRequest("p", PROMPT, GREEDY))
        assert await w._publisher.wait_synced(5.0)
        chain = hash_chain(PROMPT, 16, namespace(w.fingerprint))
        match = (await index.lookup(chain)).matches[w.replica_id]
        assert match.confirmed_depth == 2
        assert match.worker_id == w._publisher.worker_id
        # the heartbeat carries the engine's load
        deadline = time.monotonic() + 3
        while match.load is None and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            match = (await index.lookup(chain)).matches[w.replica_id]
        assert match.load is not None and match.load.timestamp > 0
        await w.shutdown()
        assert w.replica_id not in (await index.lookup(chain)).matches
        with pytest.raises(RuntimeError, match="not running"):
            await w.check_health()  # a stopped replica is unhealthy ...
        with pytest.raises(RuntimeError, match="not running"):
            await collect(w, GenerateRequest("late", PROMPT, GREEDY))  # ... and fails fast
    finally:
        await w.shutdown()
        await index.close()


async def test_serves_and_stays_healthy_while_redis_is_unreachable() -> None:
    w = await make_worker(redis_url=f"redis://127.0.0.1:{free_port()}/0")
    try:
        deltas = await collect(w, GenerateRequest("r", PROMPT, GREEDY))
        assert deltas[-1].finished
        await w.check_health()
        stats = await w.stats()
        assert stats["worker_id"] is None and not stats["index_synced"]
    finally:
        await w.shutdown()


def _out(index: int, tokens: list[int], finished: bool = False, logprobs: bool = False):
    lps = [TokenLogprob(t, -0.5, []) for t in tokens] if logprobs else None
    return RequestOutput("r", index, tokens, lps, finished, "length" if finished else None,
                         num_prompt_tokens=40, num_cached_tokens=16)


def test_to_deltas_joins_each_samples_tokens_in_order() -> None:
    steps = [[_out(0, [1], logprobs=True), _out(1, [5], logprobs=True)],
             [_out(0, [2], logprobs=True)],
             [_out(1, [6, 7], finished=True, logprobs=True), _out(0, [3], logprobs=True)]]
    merged = {o.index: o for o in to_deltas(steps, "w1")}
    assert merged[0].token_ids == [1, 2, 3] and not merged[0].finished
    assert merged[1].token_ids == [5, 6, 7] and merged[1].finish_reason == "length"
    assert [lp.token_id for lp in merged[1].logprobs] == [5, 6, 7]
    assert (merged[1].num_prompt_tokens, merged[1].num_cached_tokens) == (40, 16)
    assert {d.worker for d in merged.values()} == {"w1"}
    assert to_deltas([[_out(0, [9])]], "w1")[0].logprobs is None
    assert steps[0][0].new_token_ids == [1]  # the inputs are not changed


async def test_a_slow_consumer_gets_the_backlog_in_fewer_deltas(worker: LLMWorker) -> None:
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    fast = await collect(worker, GenerateRequest("fast", PROMPT, params))
    assert sum(len(d.token_ids) for d in fast) == 40
    stream = worker.generate(GenerateRequest("slow", PROMPT, params))
    slow = [await stream.__anext__()]
    await asyncio.sleep(1.0)  # the engine runs ahead; its steps queue up
    slow += [d async for d in stream]
    assert len(slow) < 40  # without merging: one delta per engine step, 40
    assert [t for d in slow for t in d.token_ids] == [t for d in fast for t in d.token_ids]
    assert slow[-1].finished and not any(d.finished for d in slow[:-1])


async def test_a_reader_that_wakes_late_gets_the_first_token_alone(worker: LLMWorker) -> None:
    """The event loop held while the engine steps on: the first token still goes out alone, the
    steps queued behind it in the next delta."""
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    stream = worker.generate(GenerateRequest("late", PROMPT, params))
    first = asyncio.ensure_future(stream.__anext__())
    for _ in range(3):
        await asyncio.sleep(0)  # the request is queued; its reader waits for the first step
    time.sleep(1.0)  # the loop is held: the engine's steps pile up in the stream's queue
    deltas = [await first] + [d async for d in stream]
    assert len(deltas[0].token_ids) == 1 and len(deltas[1].token_ids) > 1
    assert sum(len(d.token_ids) for d in deltas) == 20 and deltas[-1].finished


async def test_stream_interval_sends_the_first_token_alone_then_every_k_steps() -> None:
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    plain = await make_worker()
    spaced = await make_worker(stream_interval=4)
    try:
        every = await collect(plain, GenerateRequest("every", PROMPT, params))
        grouped = await collect(spaced, GenerateRequest("grouped", PROMPT, params))
    finally:
        await plain.shutdown()
        await spaced.shutdown()
    # TTFT is not delayed: the first token goes out alone, not held for the interval nor merged
    # with the steps queued behind it when the reader wakes late
    assert len(grouped[0].token_ids) == 1 and len(every[0].token_ids) == 1
    assert len(grouped) <= 1 + 39 // 4 + 1 and all(len(d.token_ids) >= 4 for d in grouped[1:-1])
    assert [t for d in grouped for t in d.token_ids] == [t for d in every for t in d.token_ids]
    assert grouped[-1].finished and grouped[-1].finish_reason == "length"
    with pytest.raises(ValueError, match="stream_interval"):
        await make_worker(stream_interval=0)
