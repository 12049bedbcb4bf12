"""Isolation, access and overload at the HTTP API, end to end (real Ray Serve, Redis, HTTP).

One module-scoped cluster, hardened: API keys on (two tenants), the prefix index in a Redis that
wants a password and speaks only TLS (a CA made by the test), ONE worker (so a shared prefix
cache would show as a hit: nothing routes the other tenant elsewhere), a tiny in-flight cap, a
small body limit and a KV pool smaller than the context.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
import redis
from conftest import TLS_PASSWORD, TlsRedis, reverse_index
from ray import serve
from servekit import serve_app

from prefixserve.cluster.config import REDIS_URL_ENV, ClusterConfig
from prefixserve.cluster.local_redis import free_port
from prefixserve.router.blocks import hash_chain, namespace
from prefixserve.router.index import INDEX_KEY_BYTES
from prefixserve.router.redis_index import RedisPrefixIndex
from prefixserve.router.redis_records import key_tag
from prefixserve.workers.checkpoints import BUILTIN_MODEL_NAME

pytestmark = pytest.mark.cluster

APP = "prefixserve-guard-test"
KEYS = {"key-a": "tenant-a", "key-b": "tenant-b"}
A = {"Authorization": "Bearer key-a"}
B = {"Authorization": "Bearer key-b"}
NUM_BLOCKS = 32  # 512 tokens of KV: less than the model's 4,096-token context
MAX_IN_FLIGHT = 3
MAX_BODY = 64 * 1024
PROMPT = [(7 * i + 3) % 250 + 1 for i in range(160)]  # 10 full blocks of token ids


@pytest.fixture(scope="module")
def redis_url(tls_redis: TlsRedis) -> str:
    return tls_redis.url


@pytest.fixture(scope="module")
def base_url(redis_url: str) -> Iterator[str]:
    # As `prefixserve serve` does with a local Ray: the password-bearing URL reaches the
    # replicas through the environment they inherit, and deployments get only a reference.
    previous = os.environ.get(REDIS_URL_ENV)
    os.environ[REDIS_URL_ENV] = redis_url
    config = ClusterConfig(
        model=BUILTIN_MODEL_NAME,
        redis_url=redis_url, num_workers=1, cpus_per_worker=0.5, cpus_per_ingress=0.25,
        num_blocks=NUM_BLOCKS, max_num_seqs=16, api_keys=KEYS,
        max_queued_requests=MAX_IN_FLIGHT, max_request_bytes=MAX_BODY,
        max_queued_requests_per_tenant=MAX_IN_FLIGHT,  # one tenant may reach the global cap
    )
    try:
        with serve_app(config, APP, headers=A) as url:
            yield url
    finally:
        if previous is None:
            os.environ.pop(REDIS_URL_ENV, None)
        else:
            os.environ[REDIS_URL_ENV] = previous


def complete(url: str, headers: dict[str, str], body: dict, **kw) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=60, **kw)


def cached(url: str, headers: dict[str, str], salt: str | None = None) -> int:
    body = {"prompt": PROMPT, "max_tokens": 1} | ({"cache_salt": salt} if salt else {})
    r = complete(url, headers, body)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def envelope(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    return error


def test_keys_are_required_except_for_health(base_url: str) -> None:
    assert httpx.get(f"{base_url}/health").status_code == 200
    for headers in ({}, {"Authorization": "Bearer key-c"}, {"Authorization": "key-a"}):
        assert envelope(httpx.get(f"{base_url}/v1/models", headers=headers), 401)["code"] \
            == "invalid_api_key"
        r = complete(base_url, headers, {"prompt": "hi", "max_tokens": 1})
        envelope(r, 401)
        assert r.headers["www-authenticate"] == "Bearer"
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="key-b", max_retries=0)
    assert client.completions.create(model=BUILTIN_MODEL_NAME, prompt="Hi",
                                     max_tokens=2).usage.completion_tokens >= 1
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{base_url}/v1", api_key="wrong",
                      max_retries=0).models.list()


def test_tenants_never_share_prefix_cache(base_url: str, redis_url: str) -> None:
    assert cached(base_url, A) == 0
    time.sleep(0.5)  # let the worker's KV events reach the index
    assert cached(base_url, A) >= 144  # A's repeat hits (9 of 10 blocks: not the last token)
    assert cached(base_url, B) == 0  # same prompt, same worker, other tenant: no hit
    # a client salt is folded under the tenant: the same salt value never crosses tenants
    assert cached(base_url, A, salt="shared") == 0
    time.sleep(0.5)
    assert cached(base_url, A, salt="shared") >= 144
    assert cached(base_url, B, salt="shared") == 0
    time.sleep(0.5)
    _index_holds_only_salted_digests(redis_url)


def _index_holds_only_salted_digests(redis_url: str) -> None:
    """No unsalted (or client-salt-only) chain of the prompt is in Redis, in any key."""
    stats = serve.get_deployment_handle("LLMWorker", APP).stats.remote().result()
    unsalted = {d for salt in (None, "shared", "tenant-a", "tenant-b")
                for d in hash_chain(PROMPT, 16, namespace(stats["fingerprint"], salt))}

    async def lookup() -> None:
        index = RedisPrefixIndex(redis_url, BUILTIN_MODEL_NAME, deadline_s=2.0)
        try:
            for salt in (None, "shared"):
                chain = hash_chain(PROMPT, 16, namespace(stats["fingerprint"], salt))
                result = await index.lookup(chain)
                assert result.worker_ids, "the worker is registered"
                assert result.matches == {}, result  # nothing held or predicted under it
        finally:
            await index.close()

    asyncio.run(lookup())
    raw = redis.Redis.from_url(redis_url)
    prefix = "{" + key_tag(BUILTIN_MODEL_NAME) + "}"
    keys: set[bytes] = set(raw.hkeys(prefix + "B"))  # the block hash: digests' first bytes
    assert len(keys) >= 20, "the tenants' blocks are in the index, salted"
    digests: set[bytes] = set()
    for key in raw.scan_iter(match=prefix + "*"):
        digests.add(key.removeprefix(prefix.encode() + b"q"))  # predicted entries' digests
        if key.startswith(prefix.encode() + b"r:") and not key.endswith(b":s"):  # reverse indexes
            blob = reverse_index(raw, key)
            keys.update(blob[i:i + INDEX_KEY_BYTES] for i in range(0, len(blob), INDEX_KEY_BYTES))
    assert not digests & unsalted
    assert not keys & {d[:INDEX_KEY_BYTES] for d in unsalted}


def test_the_index_is_reached_over_tls_with_the_password(base_url: str, redis_url: str,
                                                        tls_redis: TlsRedis) -> None:
    """The worker registered and published through rediss://; plaintext is refused there."""
    assert redis_url.startswith("rediss://")
    stats = serve.get_deployment_handle("LLMWorker", APP).stats.remote().result()
    assert stats["index_synced"] and stats["publisher"]["batches"] > 0, stats
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(tls_redis.plaintext_url, socket_timeout=2).ping()


def test_no_secret_in_serves_config(base_url: str, redis_url: str) -> None:
    """What Ray's Serve API shows of the application (deployment args, router kwargs) holds
    neither the Redis password nor any API key; the index is still in use (above)."""
    from ray.serve.context import _get_global_client

    details = json.dumps(_get_global_client().get_serve_details(), default=str)
    assert APP in details and "request_router_kwargs" in details
    assert f"env:{REDIS_URL_ENV}" in details
    for secret in (TLS_PASSWORD, *KEYS):
        assert secret not in details, secret


@pytest.mark.parametrize("wrong", ["password", "scheme", "no_password"])
def test_serve_refuses_to_start_on_a_wrong_redis_url(tls_redis: TlsRedis, wrong: str) -> None:
    """Before Ray starts: exit 2 with the reason, the password never printed."""
    url = {
        "password": tls_redis.url.replace(":tls-pw@", ":not-the-password@"),
        "scheme": tls_redis.plaintext_url,
        "no_password": tls_redis.url.replace(":tls-pw@", ""),
    }[wrong]
    proc = subprocess.run(
        [sys.executable, "-m", "prefixserve.cluster", "serve", "--redis-url", url,
         "--num-workers", "1", "--port", str(free_port())],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "prefixserve: error:" in proc.stderr
    expected = {"password": "rejected the password", "scheme": "cannot use Redis",
                "no_password": "requires a password"}[wrong]
    assert expected in proc.stderr, proc.stderr
    assert "not-the-password" not in proc.stderr and "tls-pw" not in proc.stderr
    assert "starting" not in proc.stdout  # it never got as far as Ray


def test_prompt_over_kv_capacity_is_400_at_once(base_url: str) -> None:
    long = [5] * (NUM_BLOCKS * 16 + 10)  # fits the model's context, not the 512-token KV pool
    error = envelope(complete(base_url, A, {"prompt": long, "max_tokens": 1}), 400)
    assert error["code"] == "kv_capacity_exceeded"
    assert error["param"] == "prompt"
    chat = httpx.post(f"{base_url}/v1/chat/completions", headers=A, timeout=60, json={
        "messages": [{"role": "user", "content": "word " * 600}], "max_tokens": 1})
    assert envelope(chat, 400)["param"] == "messages"
    assert complete(base_url, A, {"prompt": "fine", "max_tokens": 1}).status_code == 200


def test_body_over_the_limit_is_413(base_url: str) -> None:
    r = complete(base_url, A, {"prompt": "x" * (MAX_BODY + 10), "max_tokens": 1})
    assert envelope(r, 413)["code"] == "request_too_large"

    def chunks() -> Iterator[bytes]:  # chunked: no Content-Length, counted as it is read
        yield b'{"prompt": "'
        for _ in range(MAX_BODY // 1024 + 4):
            yield b"y" * 1024
        yield b'"}'

    r = httpx.post(f"{base_url}/v1/completions", content=chunks(), timeout=60,
                   headers={**A, "content-type": "application/json"})
    envelope(r, 413)


async def test_overload_is_429_with_retry_after(base_url: str) -> None:
    body = {"prompt": "busy", "max_tokens": 300, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=base_url, headers=A, timeout=120) as client:
        responses = await asyncio.gather(
            *(client.post("/v1/completions", json=body) for _ in range(MAX_IN_FLIGHT + 5)))
    statuses = [r.status_code for r in responses]
    assert statuses.count(200) >= MAX_IN_FLIGHT, statuses
    rejected = [r for r in responses if r.status_code == 429]
    assert rejected, statuses
    for r in rejected:
        assert envelope(r, 429)["code"] == "overloaded"
        assert int(r.headers["retry-after"]) >= 1
    assert complete(base_url, A, {"prompt": "after", "max_tokens": 1}).status_code == 200


def test_shutdown_drains_in_flight_streams(base_url: str) -> None:
    """Last in this module: deleting the app lets a running stream finish."""
    body = {"prompt": "drain", "max_tokens": 400, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    events: list[str] = []
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, headers=A,
                      timeout=120) as r:
        assert r.status_code == 200
        lines = (line for line in r.iter_lines() if line)
        events.append(next(lines))
        serve.delete(APP, _blocking=False)
        started = time.monotonic()
        events.extend(lines)
        drained_s = time.monotonic() - started
    assert events[-1] == "data: [DONE]"
    usage = json.loads(events[-2].removeprefix("data: "))["usage"]
    assert usage["completion_tokens"] == 400
    print(f"drained a stream for {drained_s:.1f} s after the app was deleted")
