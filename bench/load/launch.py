"""Start the local cluster for a benchmark: a private Redis, Ray, and the Serve application.

Each launch gets a fresh Redis and fresh worker replicas, so every run starts with empty prefix
caches and an empty index. Ray itself stays up between launches (it takes seconds to start).
Shared by `bench compare` and the end-to-end test.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx

from prefixserve.cluster.config import ClusterConfig
from prefixserve.cluster.local_redis import LocalRedis, free_port

APP_NAME = "prefixserve-bench"
_serve_port: int | None = None        # Serve's HTTP proxy keeps its first port while Ray is up


@dataclass
class Launched:
    base_url: str
    model: str
    config: ClusterConfig


def ensure_ray(num_cpus: float | None = None, metrics_export_port: int | None = None,
               metrics_report_interval_ms: int | None = None) -> None:
    """Start a private local Ray unless one is up. With a metrics port, Ray's metrics agent
    serves Prometheus text there (bench/load/router_metrics.py reads the router's histogram)."""
    import ray

    if not ray.is_initialized():
        extra: dict[str, Any] = {}
        if metrics_export_port is not None:
            extra["_metrics_export_port"] = metrics_export_port
        if metrics_report_interval_ms is not None:
            extra["_system_config"] = {"metrics_report_interval_ms": metrics_report_interval_ms}
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False,
                 logging_level="warning",
                 configure_logging=True, **extra)


@contextmanager
def local_cluster(port: int = 0, start_timeout_s: float = 180.0,
                  **options: Any) -> Iterator[Launched]:
    """Run the prefixserve app built from ClusterConfig(**options) until the block exits."""
    from ray import serve

    from prefixserve.cluster.app import build_app, serve_logging

    global _serve_port
    if _serve_port is not None and port and port != _serve_port:
        raise ValueError(f"Serve already listens on port {_serve_port}; cannot move to {port}")
    ensure_ray()
    # Picked after Ray's own processes have bound theirs: a port free a moment before ray.init
    # may be a Ray default (the dashboard agent's 52365 was), and Serve's proxy then fails.
    port = port or _serve_port or free_port()
    with LocalRedis() as redis:
        # No access log by default: a line per request and per worker call costs CPU the
        # workers would use, and floods the benchmark's terminal (access_log=true brings it back).
        config = ClusterConfig(**{"redis_url": redis.url, "access_log": False, **options,
                                  "port": port})
        serve.start(http_options={"host": config.host, "port": config.port},
                    logging_config=serve_logging(config))
        _serve_port = port
        serve.run(build_app(config), name=APP_NAME, route_prefix="/", blocking=False)
        try:
            base_url = f"http://{config.host}:{config.port}"
            _wait_ready(base_url, start_timeout_s)
            yield Launched(base_url, config.model_name(), config)
        finally:
            serve.delete(APP_NAME)


def _wait_ready(base_url: str, timeout_s: float) -> None:
    """Poll /v1/models until the ingress answers (workers are up by the time it does)."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        try:
            resp = httpx.get(f"{base_url}/v1/models", timeout=5.0)
            if resp.status_code == 200:
                return
            last = f"HTTP {resp.status_code}"
        except httpx.HTTPError as exc:
            last = f"{type(exc).__name__}: {exc}"
        time.sleep(0.5)
    raise TimeoutError(f"cluster at {base_url} not ready after {timeout_s:.0f}s ({last})")


def shutdown() -> None:
    import ray
    from ray import serve

    global _serve_port
    _serve_port = None
    if ray.is_initialized():
        serve.shutdown()
        ray.shutdown()
