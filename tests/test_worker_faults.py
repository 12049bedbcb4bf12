"""LLMWorker without Ray: a failed engine step fails its request, and the Redis index is told to
forget the blocks that step never wrote, so no router sends a prefix to garbage KV."""

from __future__ import annotations

import pytest
from test_worker_replica import GREEDY, PROMPT, collect, make_worker, wait_idle

from prefixserve.cluster.local_redis import LocalRedis
from prefixserve.router.blocks import hash_chain, namespace
from prefixserve.router.index_stores import open_index
from prefixserve.router.request import GenerateRequest

pytestmark = pytest.mark.cluster


async def test_a_failed_step_fails_its_request_and_unpublishes_its_blocks(
    redis_server: LocalRedis,
) -> None:
    w = await make_worker(redis_url=redis_server.url)
    index = open_index(redis_server.url, "tiny", deadline_s=1.0)
    try:
        engine = w._loop_thread.engine
        real = engine.runner.execute

        def execute(sched, adapters=None):  # fault injection into this worker's own engine, once
            engine.runner.execute = real
            raise RuntimeError("injected forward failure")

        engine.runner.execute = execute
        with pytest.raises(RuntimeError, match=r"engine step failed.*injected"):
            await collect(w, GenerateRequest("a", PROMPT, GREEDY))
        assert await w._publisher.wait_synced(5.0)
        chain = hash_chain(PROMPT, 16, namespace(w.fingerprint))
        result = await index.lookup(chain)  # registered, but holding none of it
        assert w.replica_id in result.worker_ids and w.replica_id not in result.matches
        stats = await wait_idle(w)
        assert stats["num_free_blocks"] == stats["num_total_blocks"]

        retry = await collect(w, GenerateRequest("a", PROMPT, GREEDY))
        assert retry[0].num_cached_tokens == 0  # nothing of the failed step was left to hit
        again = await collect(w, GenerateRequest("b", PROMPT, GREEDY))
        assert again[0].num_cached_tokens == 32
        assert [t for d in retry for t in d.token_ids] == [t for d in again for t in d.token_ids]
        assert await w._publisher.wait_synced(5.0)
        assert (await index.lookup(chain)).matches[w.replica_id].confirmed_depth == 2
    finally:
        await w.shutdown()
        await index.close()
