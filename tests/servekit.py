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

# What a worker would otherwise measure as it starts (how the kernel reads K/V, the row counts
# for packed weights and the small-row kernel, bf16's tile weights): about 4 s of CPU a
# replica, paid again by every replica these tests start or restart on two shared cores. Pinned
# in the Ray jobs the tests start; the measuring itself is tested in-process
# (tests/test_attention_kernel.py, test_packed_linear.py, test_small_linear.py,
# test_tile_linear.py), and tests/test_cli_serve.py starts workers as a user does, measuring.
PINNED_CHOICES = {
    "PREFIXSERVE_KV_PREFETCH_ROWS": "0",
    "PREFIXSERVE_KV_SCORES": "lanes",
    "PREFIXSERVE_KV_V_ROWS": "1",
    "PREFIXSERVE_PACKED_WEIGHTS": "0",
    "PREFIXSERVE_SMALL_LINEAR_ROWS": "4",
    "PREFIXSERVE_TILE_WEIGHTS": "0",
}


def start_ray(**ray_init: Any) -> None:
    """`ray.init` without the dashboard or driver logs, `PINNED_CHOICES` in every worker's
    environment (a Serve application's own `env_vars` are merged over them)."""
    ray.init(include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": PINNED_CHOICES}, **ray_init)


def stop_ray() -> None:
    """Serve's shutdown, then Ray's. Ray's alone is 5 s faster, but with it the next Ray start
    in the process twice failed to bring up its GCS or raylet."""
    serve.shutdown()
    ray.shutdown()


@contextmanager
def serve_app(config: ClusterConfig, name: str, *, headers: dict[str, str] | None = None,
              ready_timeout_s: float = 90.0, **ray_init: Any) -> Iterator[str]:
    """Yield the base URL once `/v1/models` answers 200; Serve and Ray stop on exit.

    Ray starts fresh: Serve's HTTP port is fixed per Ray instance, so a Ray left running by an
    earlier module is shut down first.
    """
    if ray.is_initialized():
        stop_ray()
    start_ray(address="local", num_cpus=2, **ray_init)
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
        stop_ray()


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
