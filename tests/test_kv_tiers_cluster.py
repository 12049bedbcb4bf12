"""A warm restart through the cluster: real Ray Serve, real Redis, real HTTP, real files.

One worker with a host tier and a disk folder serves a prompt; its replica is killed and Serve
starts another on the same node, which takes over the dead one's folder. The next request on
the prompt's prefix reports cached tokens, and the index shows the blocks again under the new
worker before anything recomputed them.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import ray
from servekit import serve_app, wait_for

from prefixserve.bench.load.soak import worker_ids, worker_stats
from prefixserve.cluster.config import ClusterConfig
from prefixserve.cluster.local_redis import LocalRedis
from prefixserve.router.blocks import hash_chain, namespace
from prefixserve.router.index_stores import open_index
from prefixserve.workers.checkpoints import BUILTIN_MODEL_NAME

APP = "prefixserve-tiers"
MODEL = "prefixserve-tiny"
BLOCK = 16
pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kv-disk")


@pytest.fixture(scope="module")
def cluster(redis_server: LocalRedis, disk_dir: Path) -> Iterator[str]:
    config = ClusterConfig(
        model=BUILTIN_MODEL_NAME, redis_url=redis_server.url, num_workers=1,
        cpus_per_worker=0.5, cpus_per_ingress=0.25, num_blocks=32, max_model_len=256,
        kv_offloading_size=0.002, kv_disk_dir=str(disk_dir), lease_ttl_s=3.0)
    with serve_app(config, APP) as url:
        assert wait_for(lambda: len(worker_ids(APP)) == 1, 60)
        yield url


def complete(url: str, prompt: list[int]) -> dict:
    r = httpx.post(f"{url}/v1/completions", timeout=60, json={
        "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


def cached(body: dict) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def depths(url: str, chain: list[bytes]) -> dict[str, int]:
    async def go() -> dict[str, int]:
        index = open_index(url, MODEL, deadline_s=1.0)
        try:
            return {k: m.confirmed_depth for k, m in (await index.lookup(chain)).matches.items()}
        finally:
            await index.close()
    return asyncio.run(go())


def _replica_actor(replica: str):
    for a in ray.util.list_named_actors(all_namespaces=True):
        if a["name"].endswith(f"#LLMWorker#{replica}"):
            return ray.get_actor(a["name"], namespace=a["namespace"])
    raise LookupError(replica)


def test_a_killed_worker_restarts_warm_from_its_disk_folder(
    cluster: str, redis_server: LocalRedis, disk_dir: Path
) -> None:
    (old,) = worker_ids(APP)
    fp = worker_stats(APP)[old]["fingerprint"]
    rng = random.Random(7)
    prompt = [rng.randrange(250) for _ in range(6 * BLOCK + 1)]
    chain = hash_chain(prompt, BLOCK, namespace(fp))[:6]
    first = complete(cluster, prompt)
    assert cached(first) == 0
    files = lambda: len(list(disk_dir.glob("*/worker-*/*.kv")))  # noqa: E731
    assert wait_for(lambda: files() >= 6, 20), files()  # written behind
    ray.kill(_replica_actor(old), no_restart=True)
    assert wait_for(lambda: worker_ids(APP) and old not in worker_ids(APP), 90, 0.5)
    (new,) = worker_ids(APP)
    # the new worker announced what it found on disk: the index has the prefix under it
    assert wait_for(lambda: depths(redis_server.url, chain).get(new) == 6, 60, 0.2), \
        depths(redis_server.url, chain)
    stats = worker_stats(APP)[new]
    assert stats["num_free_blocks"] == stats["num_total_blocks"]  # nothing computed yet
    again = complete(cluster, prompt)
    assert cached(again) == 6 * BLOCK
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    stats = worker_stats(APP)[new]
    assert stats["external_tokens_hit"] == 6 * BLOCK and stats["prompt_tokens_hit"] == 0
    tiers = stats["tiers"]
    assert tiers["loaded_bytes"]["disk"] > 0 and not tiers["load_failures"], tiers
