"""`--policy ray_prefix` end to end: Ray Serve's PrefixCacheAffinityRouter, fed token ids by
`router.ray_prefix`, keeps prompts that share a prefix on one worker (no Redis, no index)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from servekit import serve_app

from prefixserve.cluster.config import ClusterConfig
from prefixserve.cluster.render import WORKER_HEADER
from prefixserve.workers.checkpoints import BUILTIN_MODEL_NAME

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    config = ClusterConfig(
        model=BUILTIN_MODEL_NAME, policy="ray_prefix", num_workers=2, cpus_per_worker=0.5,
        cpus_per_ingress=0.25, num_blocks=128, max_model_len=512, max_num_seqs=16,
    )
    with serve_app(config, "prefixserve-ray-prefix") as url:
        yield url


def complete(url: str, prompt: str | list[str]) -> httpx.Response:
    r = httpx.post(f"{url}/v1/completions", timeout=60,
                   json={"model": BUILTIN_MODEL_NAME, "prompt": prompt, "max_tokens": 2})
    assert r.status_code == 200, r.text
    return r


def test_prompts_sharing_a_prefix_stay_on_one_worker_and_hit_its_cache(base_url: str) -> None:
    shared = "You are a helpful assistant. " * 8  # ~240 byte tokens: 15 full blocks
    first = complete(base_url, shared + "One?")
    for question in ("Two?", "Three?", "Four?"):
        r = complete(base_url, shared + question)
        assert r.headers[WORKER_HEADER] == first.headers[WORKER_HEADER]
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_a_batch_of_prompts_is_routed_whole(base_url: str) -> None:
    # The batch's handle calls share one Serve request id: both must still be fulfilled.
    body = complete(base_url, ["Batch prompt one. " * 4, "Batch prompt two. " * 4]).json()
    assert len(body["choices"]) == 2
