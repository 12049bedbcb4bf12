"""A worker process that stops answering (SIGSTOP: as a hung driver or a stuck GIL would) while
streams run on it: the ingress's progress deadline ends or moves every request within
`worker_stall_timeout_s` plus a margin, the router leaves the worker out while it is stopped,
and uses it again once it answers (SIGCONT). Real Ray Serve, Redis, HTTP and worker processes.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from ray import serve
from servekit import replica_logs, serve_app, wait_for

from prefixserve.cluster.config import ClusterConfig
from prefixserve.cluster.local_redis import LocalRedis
from prefixserve.cluster.render import WORKER_HEADER
from prefixserve.workers.checkpoints import BUILTIN_MODEL_NAME

pytestmark = pytest.mark.cluster

APP = "prefixserve-stall-test"
STALL_S = 3.0
MARGIN_S = 15.0  # far below the ~90 s Serve's health check takes to replace the replica
PROMPT = "the stalled worker holds this prefix: " + "lorem ipsum " * 10


@pytest.fixture(scope="module")
def base_url(redis_server: LocalRedis) -> Iterator[str]:
    config = ClusterConfig(
        model=BUILTIN_MODEL_NAME, redis_url=redis_server.url, num_workers=2,
        cpus_per_worker=0.5, cpus_per_ingress=0.25, num_blocks=256, max_model_len=1024,
        worker_stall_timeout_s=STALL_S, access_log=False,
    )
    with serve_app(config, APP) as url:
        yield url


def worker_pids() -> dict[str, int]:
    """Replica id -> process id, of both workers."""
    handle = serve.get_deployment_handle("LLMWorker", APP)
    pids: dict[str, int] = {}
    assert wait_for(lambda: len(pids.update(
        {(s := handle.stats.remote().result())["worker"]: s["pid"]}) or pids) == 2, 30)
    return pids


def worker_stats(worker: str) -> dict:
    handle = serve.get_deployment_handle("LLMWorker", APP)
    return handle.stats.remote(target_worker=worker).result(timeout_s=30)


def complete(base_url: str, prompt: str, **extra: object) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": 4, **extra}
    return httpx.post(f"{base_url}/v1/completions", json=body, timeout=120)


def readiness(base_url: str) -> tuple[int, dict[str, str]]:
    r = httpx.get(f"{base_url}/ready", timeout=30)
    return r.status_code, r.json()["workers"]


def test_a_stopped_worker_releases_its_streams_and_is_routed_around(base_url: str) -> None:
    pids = worker_pids()
    assert readiness(base_url) == (200, dict.fromkeys(pids, "ready"))
    assert httpx.get(f"{base_url}/health").status_code == 200
    long = {"prompt": PROMPT, "max_tokens": 700, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=base_url, timeout=120) as client, \
            client.stream("POST", "/v1/completions", json=long) as stream:
        assert stream.status_code == 200
        stalled = stream.headers[WORKER_HEADER]
        (other,) = set(pids) - {stalled}
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        os.kill(pids[stalled], signal.SIGSTOP)
        try:
            stopped_at = time.monotonic()
            # the same prefix: the router would send it to the stopped worker, which holds it
            moved = complete(base_url, PROMPT)
            assert moved.status_code == 200, moved.text
            assert moved.headers[WORKER_HEADER] == other
            # the router sent it where its prefix is: the deadline moved it before its output
            assert "silent for 3 s before output; retry 1 of 2" in replica_logs(
                APP, "OpenAIIngress")
            rest = [line for line in lines if line.startswith("data: ")]
            ended_after = time.monotonic() - stopped_at
            assert rest[-1] == "data: [DONE]"
            error = json.loads(rest[-2].removeprefix("data: "))["error"]
            assert error["code"] == "worker_stalled", error
            assert ended_after < STALL_S + MARGIN_S
            for i in range(4):  # later requests avoid it at once
                r = complete(base_url, f"{PROMPT} {i}")
                assert (r.status_code, r.headers[WORKER_HEADER]) == (200, other)
            assert readiness(base_url) == (503, {stalled: "stalled", other: "ready"})
            some = httpx.get(f"{base_url}/ready", params={"min_workers": 1}, timeout=30)
            assert some.status_code == 200  # what a pod's readiness probe asks: can it serve
            bad = httpx.get(f"{base_url}/ready", params={"min_workers": 0}, timeout=30)
            assert bad.status_code == 400 and bad.json()["error"]["param"] is None
            assert httpx.get(f"{base_url}/health").status_code == 200  # alive all the same
        finally:
            os.kill(pids[stalled], signal.SIGCONT)
    # it answers again: the probe clears it, and it is routed to again
    assert wait_for(lambda: readiness(base_url) == (200, dict.fromkeys(pids, "ready")), 30,
                    interval_s=0.5)
    # 12 at once: while they queue on the other worker, the router spreads them (one at a
    # time, a worker whose last steps included the 20 s stop may look slower for a while)
    with ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(lambda i: complete(base_url, f"fresh prompt {i}: " + "x" * i),
                                range(12)))
    assert stalled in {r.headers[WORKER_HEADER] for r in answers}
    # the streams cut off while it was stopped were aborted there: nothing runs, nothing leaks
    assert wait_for(lambda: worker_stats(stalled)["num_running"] == 0, 30)
    stats = worker_stats(stalled)
    assert stats["num_waiting"] == 0
