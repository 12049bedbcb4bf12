"""Assemble the Serve application from a ClusterConfig: LLMWorker replicas behind a request
router (per `policy`), and the OpenAI ingress in front of them.

`app_builder` is the `import_path` for `serve run` and Serve config files::

    serve run prefixserve.cluster.app:app_builder num_workers=2 redis_url=redis://127.0.0.1:6379/0

    applications:
      - name: prefixserve
        route_prefix: /
        import_path: prefixserve.cluster.app:app_builder
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

from prefixserve.cluster.api import OpenAIIngress
from prefixserve.cluster.config import ClusterConfig
from prefixserve.cluster.guard import GuardSettings
from prefixserve.cluster.ingress_config import API_KEY_ENV, API_KEYS_ENV
from prefixserve.cluster.served_models import Adapter
from prefixserve.router.adapters import adapter_identity
from prefixserve.router.index import IndexSettings
from prefixserve.router.router_settings import RouterSettings
from prefixserve.router.routing_policies import ROUTING_POLICIES
from prefixserve.workers.deployment import KEEPALIVE_S, worker_deployment

ROUTING_STATS_PERIOD_S = 2.0  # how fresh the index routers' fallback loads are


def build_app(config: ClusterConfig) -> Application:
    """The whole cluster as one Serve application (ingress → workers)."""
    fingerprint = config.model_fingerprint()  # converts a GGUF here first: replicas find it done
    model_name = config.model_name()
    # Baselines run without the index, so they pay none of its costs.
    redis_url = config.deployable_redis_url()
    router = config.router.model_copy(update={
        "model": model_name,
        "block_size": config.engine.block_size,
        "fingerprint": fingerprint,
    })
    workers = worker_deployment(
        num_replicas=config.workers.num_workers,
        num_cpus=config.workers.cpus,
        num_gpus=config.workers.gpus_per_worker,
        max_ongoing_requests=config.workers.max_ongoing_requests,
        ray_actor_options={"resources": dict(config.workers.worker_resources)},
        request_router_config=request_router_config(config.policy, redis_url, router,
                                                    config.index),
    ).options(graceful_shutdown_timeout_s=config.graceful_shutdown_timeout_s,
              logging_config=serve_logging(config))
    if config.workers.max_workers_per_node is not None:
        workers = workers.options(max_replicas_per_node=config.workers.max_workers_per_node)
    stall_timeout_s = config.ingress.worker_stall_timeout_s
    worker_app = workers.bind(config.model, config.engine, redis_url, model_name,
                              index=config.index, stream_interval=config.workers.stream_interval,
                              drain_timeout_s=config.graceful_shutdown_timeout_s,
                              keepalive_s=min(KEEPALIVE_S, stall_timeout_s / 4))
    ingress = OpenAIIngress.options(
        num_replicas=config.ingress.ingress_replicas,
        ray_actor_options={"num_cpus": config.ingress.cpus_per_ingress},
        max_ongoing_requests=config.ingress.ingress_max_ongoing_requests,
        graceful_shutdown_timeout_s=config.graceful_shutdown_timeout_s,
        logging_config=serve_logging(config),
    )
    # A fresh secret per deploy keys the tenants' cache namespaces: nothing in the index can be
    # recomputed from a guessed prompt (a redeploy starts every tenant's cache cold).
    return ingress.bind(worker_app, config.model, model_name, config.engine.max_model_len,
                        GuardSettings.of(config.ingress), os.urandom(32),
                        tokenizer=config.ingress.tokenizer,
                        chat_template=config.ingress.chat_template,
                        worker_stall_timeout_s=stall_timeout_s,
                        control_tokens_in_messages=config.ingress.control_tokens_in_messages,
                        tool_call_parser=config.ingress.auto_tool_parser,
                        lora_adapters=[Adapter(name, adapter_identity(name, path), path)
                                       for name, path in config.engine.lora_modules.items()],
                        allow_runtime_lora_updating=config.ingress.allow_runtime_lora_updating)


def request_router_config(
    policy: str, redis_url: str | None, router: RouterSettings, index: IndexSettings,
    stats_period_s: float = ROUTING_STATS_PERIOD_S,
) -> RequestRouterConfig:
    """The workers' request router for ``policy`` (``router.routing_policies``). Index-backed
    routers get the router and index sections, as plain dicts; the others the one router
    setting every policy honours, how long a call aimed at one worker waits for it."""
    routing = ROUTING_POLICIES[policy]
    if not routing.needs_index:
        return RequestRouterConfig(request_router_class=routing.request_router,
                                   request_router_kwargs={"target_wait_s": router.target_wait_s})
    return RequestRouterConfig(
        request_router_class=routing.request_router,
        request_router_kwargs={"redis_url": redis_url, "settings": router.model_dump(),
                               "index": index.model_dump()},
        request_routing_stats_period_s=stats_period_s,
    )


def serve_logging(config: ClusterConfig) -> LoggingConfig:
    """Serve's logging for the app's replicas, and for the proxy where prefixserve starts
    Serve itself (`serve.start(logging_config=...)`)."""
    return LoggingConfig(enable_access_log=config.access_log)


def app_builder(args: dict[str, Any]) -> Application:
    """Serve's application builder: `args` are ClusterConfig fields (strings are coerced).

    Serve keeps these args in its config (dashboard, REST API), so API keys may only be named
    by file here (or set in PREFIXSERVE_API_KEYS), `api_key` only by VLLM_API_KEY, and a Redis
    password only by reference.
    """
    for key in ("api_key", "api-key"):
        if args.get(key) is not None:
            raise ValueError(f"{key} in application args would be stored in Serve's config: set "
                             f"{API_KEY_ENV} instead")
    for key in ("api_keys", "api-keys"):
        keys = args.get(key)
        if keys is not None and (not isinstance(keys, str) or keys.lstrip()[:1] in ("{", "[")):
            raise ValueError(f"{key} in application args would be stored in Serve's config: give "
                             f"a JSON file's path, or set {API_KEYS_ENV}")
    return build_app(ClusterConfig.model_validate(dict(args)))
