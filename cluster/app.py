"""Assemble the Serve application from a ClusterConfig: LLMWorker replicas behind a request
router (per `policy`), and the OpenAI ingress in front of them.

`app_builder` is the `import_path` for `serve run` and Serve config files::

    serve run cluster.app:app_builder num_workers=2 redis_url=redis://127.0.0.1:6379/0

    applications:
      - name: prefixserve
        route_prefix: /
        import_path: cluster.app:app_builder
        args: {model: /models/Llama-3.1-8B-Instruct, num_workers: 4, gpus_per_worker: 1,
               redis_url: "rediss://:secret@redis:6380/0"}

HTTP host and port are Serve's `http_options`, not part of the application: `prefixserve serve`
sets them from `host` / `port`.
"""

from __future__ import annotations

import os
from typing import Any

from ray.serve import Application
from ray.serve.config import RequestRouterConfig
from ray.serve.schema import LoggingConfig

from cluster.api import OpenAIIngress
from cluster.config import ClusterConfig
from cluster.guard import GuardSettings, key_digest
from workers.deployment import worker_deployment
from workers.engine import checkpoint_fingerprint

ROUND_ROBIN_ROUTER = "router.round_robin:RoundRobinRequestRouter"


def build_app(config: ClusterConfig) -> Application:
    """The whole cluster as one Serve application (ingress → workers)."""
    model_path = config.model_path()  # converts a GGUF here first, so replicas find it done
    model_name = config.model_name()
    prefix = config.policy == "prefix"
    workers = worker_deployment(
        num_replicas=config.num_workers,
        num_cpus=config.worker_cpus,
        num_gpus=config.gpus_per_worker,
        max_ongoing_requests=config.max_ongoing_requests,
        ray_actor_options={"resources": dict(config.worker_resources)},
        prefix_routing=prefix,
        router_kwargs={
            "redis_url": config.redis_url,
            "model": model_name,
            "block_size": config.block_size,
            "fingerprint": checkpoint_fingerprint(model_path),
            "lookup_deadline_s": config.lookup_deadline_s,
            "predict_ttl_s": config.predict_ttl_s,
        },
    )
    workers = workers.options(graceful_shutdown_timeout_s=config.graceful_shutdown_timeout_s,
                              logging_config=serve_logging(config))
    if config.max_workers_per_node is not None:
        workers = workers.options(max_replicas_per_node=config.max_workers_per_node)
    if config.policy == "round_robin":
        workers = workers.options(
            request_router_config=RequestRouterConfig(request_router_class=ROUND_ROBIN_ROUTER)
        )
    # Baselines run without the index, so they pay none of its costs.
    worker_app = workers.bind(
        config.model,
        config.engine_config(),
        config.redis_url if prefix else None,
        model_name,
        lease_ttl_s=config.lease_ttl_s,
        stream_interval=config.stream_interval,
    )
    ingress = OpenAIIngress.options(
        num_replicas=config.ingress_replicas,
        ray_actor_options={"num_cpus": config.cpus_per_ingress},
        max_ongoing_requests=config.ingress_max_ongoing_requests,
        graceful_shutdown_timeout_s=config.graceful_shutdown_timeout_s,
        logging_config=serve_logging(config),
    )
    # A fresh secret per deploy keys the tenants' cache namespaces: nothing in the index can be
    # recomputed from a guessed prompt (a redeploy starts every tenant's cache cold).
    return ingress.bind(worker_app, config.model, model_name, config.max_model_len,
                        guard_settings(config), os.urandom(32))


def serve_logging(config: ClusterConfig) -> LoggingConfig:
    """Serve's logging for the app's replicas, and for the proxy where prefixserve starts
    Serve itself (`serve.start(logging_config=...)`)."""
    return LoggingConfig(enable_access_log=config.access_log)


def guard_settings(config: ClusterConfig) -> GuardSettings:
    """What the ingress admits. Only digests of the API keys leave the config. Past
    ingress_max_ongoing_requests Serve's proxy would queue without bound, so the in-flight
    cap is at most that."""
    return GuardSettings(
        key_tenants={key_digest(key): tenant for key, tenant in config.api_keys.items()},
        max_in_flight=min(config.max_queued_requests, config.ingress_max_ongoing_requests),
        max_request_bytes=config.max_request_bytes,
    )


def app_builder(args: dict[str, Any]) -> Application:
    """Serve's application builder: `args` are ClusterConfig fields (strings are coerced)."""
    return build_app(ClusterConfig.model_validate(dict(args)))
