"""Tier 1 of the simulation: ``sim:<profile>`` served by the real stack (ingress, prefix router,
Redis index, KV event publishers) over SimEngine replicas that sleep their modelled steps."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
from servekit import serve_app

from prefixserve.cluster.config import ClusterConfig
from prefixserve.cluster.local_redis import LocalRedis
from prefixserve.cluster.render import WORKER_HEADER
from prefixserve.workers import builtin
from prefixserve.workers.sim import profiles

MODEL = "sim:cpu-smollm2"


def test_sim_tokenizer_vocabulary_is_the_builtin_one() -> None:
    assert profiles.TOKENIZER_VOCAB_SIZE == builtin.VOCAB_SIZE
    assert profiles.CPU_SMOLLM2.served_vocab_size == builtin.VOCAB_SIZE


def test_a_sim_model_validates_and_is_named_by_its_profile() -> None:
    cfg = ClusterConfig(model=MODEL, policy="pow2")
    assert cfg.model_name() == "sim-cpu-smollm2"
    assert cfg.model_fingerprint() == profiles.CPU_SMOLLM2.fingerprint
    with pytest.raises(ValueError, match="known: sim:cpu-smollm2, sim:h100-llama3-8b"):
        ClusterConfig(model="sim:nope", policy="pow2")


@pytest.fixture(scope="module")
def base_url(redis_server: LocalRedis) -> Iterator[str]:
    config = ClusterConfig(model=MODEL, redis_url=redis_server.url, num_workers=4,
                           cpus_per_worker=0.1, cpus_per_ingress=0.25, num_blocks=256)
    with serve_app(config, "prefixserve-sim") as url:
        yield url


def complete(url: str, body: dict) -> httpx.Response:
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r


@pytest.mark.cluster
def test_shared_prefix_lands_on_one_simulated_worker(base_url: str) -> None:
    shared = "You are a helpful assistant. " * 8  # ~240 byte tokens: 15 full blocks
    first = complete(base_url, {"model": "sim-cpu-smollm2", "prompt": shared + "One?",
                                "max_tokens": 4})
    assert first.json()["usage"]["completion_tokens"] == 4
    time.sleep(0.5)  # let the worker's KV events reach the index
    second = complete(base_url, {"prompt": shared + "Two?", "max_tokens": 4})
    assert second.headers[WORKER_HEADER] == first.headers[WORKER_HEADER]
    assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16 * 10


@pytest.mark.cluster
def test_chat_is_served_by_a_simulated_worker(base_url: str) -> None:
    r = httpx.post(f"{base_url}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "sim-cpu-smollm2"
    assert body["usage"]["completion_tokens"] == 3
    assert isinstance(body["choices"][0]["message"]["content"], str)
