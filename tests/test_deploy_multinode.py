"""A simulated 3-node cluster built the way deploy/ builds one: ClusterConfig → build_app.

`ray.cluster_utils.Cluster` starts a head and three worker nodes on this machine; each worker
node offers one logical accelerator (a custom resource, since there are no GPUs here) and
`worker_resources` + `max_workers_per_node` place one replica per node. Then a node is removed:
serving goes on, and the dead worker's index entries disappear within the lease TTL. The index
is split over two worker groups (``index.shards``), as a large fleet's would be.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
from ray import serve
from ray.cluster_utils import Cluster
from servekit import start_ray, stop_ray

from prefixserve.cluster.app import build_app
from prefixserve.cluster.config import ClusterConfig
from prefixserve.cluster.local_redis import LocalRedis, free_port
from prefixserve.cluster.render import WORKER_HEADER
from prefixserve.router.blocks import hash_chain, namespace
from prefixserve.router.index import IndexSettings, WorkerInfo
from prefixserve.router.index_stores import open_index
from prefixserve.router.sharded_index import GROUP_SPAN, group_name
from prefixserve.workers.builtin import ensure_builtin_model
from prefixserve.workers.checkpoints import BUILTIN_MODEL_NAME, checkpoint_fingerprint

LEASE_TTL_S = 3.0
INDEX = IndexSettings(shards=2, lease_ttl_s=LEASE_TTL_S)
BLOCK = 16
pytestmark = [pytest.mark.cluster, pytest.mark.timeout(400)]


@dataclass
class Deployed:
    url: str
    cluster: Cluster
    nodes: list  # the three worker nodes (ray._private.node.Node)


@pytest.fixture(scope="module")
def deployed(redis_server: LocalRedis) -> Iterator[Deployed]:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    nodes = [cluster.add_node(num_cpus=1, resources={"accel": 1}) for _ in range(3)]
    config = ClusterConfig(
        model=BUILTIN_MODEL_NAME, redis_url=redis_server.url, num_workers=3, max_workers_per_node=1,
        worker_resources={"accel": 1}, cpus_per_worker=0.5, cpus_per_ingress=0.25,
        num_blocks=128, max_model_len=512, max_num_seqs=8, index=INDEX,
    )
    start_ray(address=cluster.address)
    port = free_port()  # after Ray's own processes have taken their ports
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
        serve.run(build_app(config), name="three-nodes", route_prefix="/")
        yield Deployed(f"http://127.0.0.1:{port}", cluster, nodes)
    finally:
        stop_ray()
        cluster.shutdown()


def live_workers(url: str) -> list[WorkerInfo]:
    async def go() -> list[WorkerInfo]:
        index = open_index(url, BUILTIN_MODEL_NAME, deadline_s=1.0, settings=INDEX)
        try:
            return await index.live_workers()
        finally:
            await index.close()

    return asyncio.run(go())


def group_members(url: str, group: int) -> set[tuple[str, int]]:
    """(replica id, id in the group) of each live worker, read from one group's own store."""
    async def go() -> set[tuple[str, int]]:
        store = open_index(url, group_name(BUILTIN_MODEL_NAME, group), deadline_s=1.0)
        try:
            return {(w.replica_id, w.worker_id) for w in await store.live_workers()}
        finally:
            await store.close()

    return asyncio.run(go())


def depths(url: str, tokens: list[int]) -> dict[str, int]:
    """Confirmed depth per live worker for this prompt's chain."""
    ns = namespace(checkpoint_fingerprint(ensure_builtin_model()))

    async def go() -> dict[str, int]:
        index = open_index(url, BUILTIN_MODEL_NAME, deadline_s=1.0, settings=INDEX)
        try:
            found = await index.lookup(hash_chain(tokens, BLOCK, ns))
            return {m.replica_id: m.confirmed_depth for m in found.matches.values()}
        finally:
            await index.close()

    return asyncio.run(go())


def complete(url: str, tokens: list[int]) -> httpx.Response:
    body = {"prompt": tokens, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r


def prefix(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(8 * BLOCK)]


def test_one_replica_per_node_and_prefix_routing_across_nodes(deployed: Deployed,
                                                              redis_server: LocalRedis) -> None:
    workers = live_workers(redis_server.url)
    assert len(workers) == 3
    worker_nodes = {w.node for w in workers}
    assert worker_nodes == {n.node_id for n in deployed.nodes}  # one per worker node

    served = Counter()
    for i in range(9):
        p = prefix(i)
        first = complete(deployed.url, [*p, 1, 2])
        second = complete(deployed.url, [*p, 3, 4])
        assert second.headers[WORKER_HEADER] == first.headers[WORKER_HEADER]
        assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 8 * BLOCK
        served[first.headers[WORKER_HEADER]] += 1
    assert len(served) >= 2, served  # prefixes spread over nodes


def test_serving_goes_on_after_a_node_is_removed(deployed: Deployed,
                                                 redis_server: LocalRedis) -> None:
    p = prefix(100)
    holder = complete(deployed.url, [*p, 1, 2]).headers[WORKER_HEADER]
    assert depths(redis_server.url, [*p, 1, 2]).get(holder, 0) >= 8
    workers = live_workers(redis_server.url)
    # each worker registered in one group's part of the index, the group its id carries
    members = [group_members(redis_server.url, g) for g in range(2)]
    assert len(workers) == 3 and all(
        (w.replica_id, w.worker_id % GROUP_SPAN) in members[w.worker_id // GROUP_SPAN]
        for w in workers)
    assert sum(map(len, members)) == 3
    node_of = {w.replica_id: w.node for w in workers}
    (victim,) = [n for n in deployed.nodes if n.node_id == node_of[holder]]

    deployed.cluster.remove_node(victim)
    removed_at = time.monotonic()
    while holder in {w.replica_id for w in live_workers(redis_server.url)}:
        assert time.monotonic() - removed_at < LEASE_TTL_S + 5, "dead worker still listed"
        time.sleep(0.2)
    # Its blocks no longer answer a lookup, so no router sends this prefix to a dead worker.
    assert holder not in depths(redis_server.url, [*p, 1, 2])

    survivors = set()
    for i in range(6):
        r = complete(deployed.url, [*prefix(200 + i), 5, 6])
        survivors.add(r.headers[WORKER_HEADER])
    assert holder not in survivors and survivors
    again = complete(deployed.url, [*p, 7, 8])
    assert again.headers[WORKER_HEADER] != holder
