"""The baseline policies end to end (no Redis, no index). `--policy ray_prefix`: Ray Serve's
PrefixCacheAffinityRouter, fed token ids by `router.ray_prefix`, keeps prompts that share a prefix
on one worker. `--policy round_robin` rotates. `--policy pow2` is Serve's power of two choices.
All three route calls aimed at one worker as every policy does (router/call_routing.py)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from ray import serve
from servekit import serve_app

from prefixserve.cluster.config import ClusterConfig
from prefixserve.cluster.render import WORKER_HEADER
from prefixserve.router.call_routing import NoSuchReplica
from prefixserve.workers.checkpoints import BUILTIN_MODEL_NAME

pytestmark = pytest.mark.cluster

TARGET_WAIT_S = 1.0  # the router section's, which every policy honours


@pytest.fixture(scope="module", params=["ray_prefix", "round_robin", "pow2"])
def app(request: pytest.FixtureRequest) -> Iterator[tuple[str, str, str]]:
    """(policy, app name, base URL) of a two-worker app under that policy."""
    policy = request.param
    config = ClusterConfig(
        model=BUILTIN_MODEL_NAME, policy=policy, num_workers=2, cpus_per_worker=0.5,
        cpus_per_ingress=0.25, num_blocks=128, max_model_len=512, max_num_seqs=16,
        router={"target_wait_s": TARGET_WAIT_S},
    )
    name = f"prefixserve-{policy.replace('_', '-')}"
    with serve_app(config, name) as url:
        yield policy, name, url


@pytest.fixture
def base_url(app: tuple[str, str, str]) -> str:
    return app[2]


def complete(url: str, prompt: str | list[str]) -> httpx.Response:
    r = httpx.post(f"{url}/v1/completions", timeout=60,
                   json={"model": BUILTIN_MODEL_NAME, "prompt": prompt, "max_tokens": 2})
    assert r.status_code == 200, r.text
    return r


def test_prompts_sharing_a_prefix_follow_the_policy(app: tuple[str, str, str]) -> None:
    policy, _, base_url = app
    shared = "You are a helpful assistant. " * 8  # ~240 byte tokens: 15 full blocks
    first = complete(base_url, shared + "One?")
    workers = [first.headers[WORKER_HEADER]]
    for question in ("Two?", "Three?", "Four?"):
        r = complete(base_url, shared + question)
        workers.append(r.headers[WORKER_HEADER])
        if policy == "ray_prefix":  # on the holder, and its cache hit
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    if policy == "ray_prefix":
        assert set(workers) == {workers[0]}
    elif policy == "round_robin":  # one after the other: the two workers in turn
        assert workers[0] != workers[1] and workers[::2] == [workers[0]] * 2
    # pow2 places by queue length alone: each request answered (complete() checks) is its claim


def test_calls_aimed_at_one_worker_reach_it(app: tuple[str, str, str]) -> None:
    _, name, _ = app
    handle = serve.get_deployment_handle("LLMWorker", app_name=name)
    # untargeted calls go to any worker: 20 of them meet both (or the test is 1 in 500,000 unlucky)
    workers = {handle.stats.remote().result(timeout_s=30)["worker"] for _ in range(20)}
    assert len(workers) == 2
    for worker in workers:
        for _ in range(5):  # one landing elsewhere would be refused there (ValueError)
            assert handle.stats.remote(target_worker=worker).result(timeout_s=30)["worker"] == (
                worker)
    # after the router section's wait, well before the 10 s default's
    with pytest.raises(NoSuchReplica, match="no-such-replica"):
        handle.stats.remote(target_worker="no-such-replica").result(timeout_s=8)


def test_a_batch_of_prompts_is_routed_whole(base_url: str) -> None:
    # The batch's handle calls share one Serve request id: both must still be fulfilled.
    body = complete(base_url, ["Batch prompt one. " * 4, "Batch prompt two. " * 4]).json()
    assert len(body["choices"]) == 2
