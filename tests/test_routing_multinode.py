"""Prefix routing across Ray nodes: a head plus two worker nodes (ray.cluster_utils.Cluster on
one machine), one LLMWorker replica pinned to each worker node by a custom resource."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest
from ray import serve
from ray.cluster_utils import Cluster
from servekit import start_ray, stop_ray

from prefixserve.cluster.app import request_router_config
from prefixserve.cluster.local_redis import LocalRedis
from prefixserve.router.index import IndexSettings
from prefixserve.router.index_stores import open_index
from prefixserve.router.request import GenerateRequest, TokenDelta
from prefixserve.router.router_settings import RouterSettings
from prefixserve.router.sampling_params import SamplingParams
from prefixserve.workers.builtin import ensure_builtin_model
from prefixserve.workers.deployment import worker_deployment

MODEL = "tiny"
BLOCK = 16
GREEDY = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def handle(redis_server: LocalRedis):
    model_path = str(ensure_builtin_model())
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    for _ in range(2):
        cluster.add_node(num_cpus=1, resources={"llm_slot": 1})
    start_ray(address=cluster.address)
    try:
        serve.start(proxy_location="Disabled")
        deployment = worker_deployment(
            num_replicas=2,
            num_cpus=0.5,
            num_gpus=0,
            max_ongoing_requests=16,
            ray_actor_options={"resources": {"llm_slot": 1}},  # one replica per worker node
            request_router_config=request_router_config(
                "prefix", redis_server.url,
                RouterSettings(model=MODEL, block_size=BLOCK, lookup_deadline_s=0.1),
                IndexSettings()),
        )
        app = deployment.bind(model_path, {"block_size": BLOCK, "num_blocks": 128},
                              redis_server.url, MODEL, stream_interval=1, drain_timeout_s=5.0,
                              heartbeat_interval_s=0.2)
        yield serve.run(app, name="multinode", route_prefix=None)
    finally:
        stop_ray()
        cluster.shutdown()


def run(handle, tokens: list[int], tag: int) -> list[TokenDelta]:
    request = GenerateRequest(f"mn-{tag}", tokens, GREEDY)
    deltas = [d for d in handle.options(stream=True).generate.remote(request) if not d.keepalive]
    assert deltas[-1].finished
    return deltas


def prefix(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(250) for _ in range(8 * BLOCK)]


async def live_nodes(url: str) -> dict[str, str]:
    index = open_index(url, MODEL, deadline_s=1.0)
    try:
        return {w.replica_id: w.node for w in await index.live_workers()}
    finally:
        await index.close()


def test_replicas_on_two_nodes_share_one_index_and_route_by_prefix(handle, redis_server) -> None:
    nodes = asyncio.run(live_nodes(redis_server.url))
    assert len(nodes) == 2 and len(set(nodes.values())) == 2, nodes  # two workers, two nodes

    # A new prefix goes to an idle worker chosen by rendezvous hashing, so which node a given
    # prefix lands on is random per run: keep sending new prefixes until both nodes have been
    # picked (16 all on one node by chance: 1 in 32,768).
    picks = Counter()
    for i in range(16):
        p = prefix(i)
        first = run(handle, [*p, 1, 2, 3], tag=2 * i)
        second = run(handle, [*p, 4, 5, 6], tag=2 * i + 1)
        assert second[-1].worker == first[-1].worker
        assert second[0].num_cached_tokens >= 8 * BLOCK
        picks[nodes[first[-1].worker]] += 1
        if i >= 3 and len(picks) == 2:
            break
    assert len(picks) == 2, picks  # prefixes spread over both nodes
