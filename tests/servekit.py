"""End-to-end test helpers: start the whole app (local Ray, Serve over HTTP), wait on conditions."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import ray
from ray import serve

from prefixserve.cluster.app import build_app
from prefixserve.cluster.config import ClusterConfig
from prefixserve.cluster.local_redis import free_port


@contextmanager
def serve_app(config: ClusterConfig, name: str, *, headers: dict[str, str] | None = None,
              ready_timeout_s: float = 90.0, **ray_init: Any) -> Iterator[str]:
    """Yield the base URL once `/v1/models` answers 200; Serve and Ray stop on exit.

    Ray starts fresh: Serve's HTTP port is fixed per Ray instance, so a Ray left running by an
    earlier module is shut down first.
    """
    if ray.is_initialized():
        serve.shutdown()
        ray.shutdown()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             **ray_init)
    port = free_port()  # after Ray's own processes have taken their ports
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(config), name=name, route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + ready_timeout_s
        while httpx.get(f"{url}/v1/models", headers=headers).status_code != 200:
            assert time.monotonic() < deadline, "ingress did not come up"
            time.sleep(0.2)
        yield url
    finally:
        serve.shutdown()
        ray.shutdown()


def wait_for(predicate: Callable[[], object], timeout_s: float, interval_s: float = 0.1) -> bool:
    """Poll until `predicate()` is true or `timeout_s` passes; the last answer is returned."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return bool(predicate())


def replica_logs(app: str, deployment: str) -> str:
    """What the replicas of `deployment` in `app` wrote to their Serve log files so far."""
    logs = Path(ray._private.worker.global_worker.node.get_logs_dir_path()) / "serve"
    return "".join(p.read_text(errors="replace")
                   for p in sorted(logs.glob(f"replica_{app}_{deployment}_*.log")))


def request_router(handle: Any, timeout_s: float = 30.0) -> Any:
    """The request router inside ``handle`` (in this process), once Serve has made it: tests
    look at what it holds. Reaches into Serve's handle internals, which tests alone need."""
    asyncio_router = handle._router._asyncio_router
    assert wait_for(lambda: asyncio_router.request_router is not None, timeout_s)
    return asyncio_router.request_router
