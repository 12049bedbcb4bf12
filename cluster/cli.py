"""`prefixserve` command line: `serve` runs a cluster (`prefixserve-bench` load-tests one).

`prefixserve serve` starts a local Ray (or joins `--address`), a private Redis for the prefix
index unless `--redis-url` is given, deploys the application and serves until Ctrl-C, then
shuts everything down. Every ClusterConfig field is a flag (`--num-workers 4`, `--policy
pow2`, ...); `--config file.yaml` supplies them from a file, flags override.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

import httpx
from pydantic import ValidationError

from prefixserve.cluster.config import REDIS_URL_ENV, ClusterConfig, leaves
from prefixserve.router.index import IndexUnavailable
from prefixserve.router.redis_connection import check_redis
from prefixserve.router.routing_policies import ROUTING_POLICIES
from prefixserve.router.secret_refs import SecretNotFound, is_reference, resolve, url_has_secret

APP_NAME = "prefixserve"
READY_NOTE_S = 10.0  # the CLI says it is still waiting for /ready after this long


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per ClusterConfig leaf setting; unset flags stay out of the config dict."""
    group = parser.add_argument_group("cluster configuration (ClusterConfig settings)")
    for leaf in leaves():
        flag = "--" + leaf.name.replace("_", "-")
        help_text = leaf.description.replace("%", "%%")
        if leaf.default is not None and not leaf.from_env:
            help_text += f" (default: {leaf.default})"
        if leaf.is_bool:
            group.add_argument(flag, dest=leaf.name, action=argparse.BooleanOptionalAction,
                               default=None, help=help_text)
        else:
            group.add_argument(flag, dest=leaf.name, default=None, metavar=leaf.name.upper(),
                               help=help_text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prefixserve", description="Prefix-aware LLM serving on Ray Serve.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve the OpenAI API on a local or existing cluster",
                           description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    serve.add_argument("--address", default=None,
                       help="Ray cluster to join ('auto', 'ray://host:10001', ...); "
                       "default: start a private local one")
    serve.add_argument("--config", type=Path, default=None,
                       help="YAML or JSON file of ClusterConfig fields (flags override)")
    serve.add_argument("--dashboard", action="store_true",
                       help="start the Ray dashboard with a local Ray")
    serve.add_argument("--metrics-export-port", type=int, default=None, metavar="PORT",
                       help="where a local Ray's metrics agent serves Prometheus text "
                       "(http://HOST:PORT/metrics: ray_vllm_* worker series, "
                       "ray_prefixserve_router_*); default: a random port. With --address "
                       "it is the cluster's own setting (`ray start --metrics-export-port`), "
                       "and this flag is ignored")
    _add_config_flags(serve)
    return parser


def config_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """Fields from `--config` then from flags (not yet validated)."""
    fields: dict[str, Any] = {}
    if args.config is not None:
        text = args.config.read_text()
        if args.config.suffix in (".yaml", ".yml"):
            import yaml

            fields.update(yaml.safe_load(text) or {})
        else:
            fields.update(json.loads(text))
    for leaf in leaves():
        value = getattr(args, leaf.name, None)
        if value is not None:
            fields[leaf.name] = value
    return fields


def _fail(message: str) -> int:
    print(f"prefixserve: error: {message}", file=sys.stderr)
    return 2


def invalid_config_message(exc: ValidationError) -> str:
    """One line per bad field ("model: ..."), without pydantic's input echo and doc links."""
    lines = []
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"]) or "config"
        lines.append(f"  {field}: {err['msg'].removeprefix('Value error, ')}")
    return "invalid configuration:\n" + "\n".join(lines)


def serve_command(args: argparse.Namespace) -> int:
    from prefixserve.cluster.local_redis import LocalRedis, RedisBinaryNotFound

    try:
        fields = config_from_args(args)
    except (OSError, ValueError) as exc:
        return _fail(f"cannot read --config: {exc}")
    redis: LocalRedis | None = None
    default_policy = ClusterConfig.model_fields["policy"].default
    policy = ROUTING_POLICIES.get(fields.get("policy", default_policy))
    needs_redis = policy is not None and policy.needs_index
    if needs_redis and not fields.get("redis_url") and not os.environ.get(REDIS_URL_ENV):
        try:
            redis = LocalRedis().start()
        except RedisBinaryNotFound as exc:
            return _fail(f"{exc}\n  (the prefix policy needs Redis; or use --policy pow2)")
        fields["redis_url"] = redis.url
        print(f"prefixserve: started a private Redis for the prefix index at {redis.url}")
        if args.address:
            print("prefixserve: warning: that Redis listens on 127.0.0.1 only; workers on other "
                  "nodes cannot reach it (pass --redis-url)", file=sys.stderr)
    try:
        try:
            config = ClusterConfig.model_validate(fields)
        except ValidationError as exc:
            return _fail(invalid_config_message(exc))
        url = config.redis_url
        if url and not args.address and not is_reference(url) and url_has_secret(url):
            os.environ[REDIS_URL_ENV] = url  # a local Ray's replicas inherit it, args stay clean
        try:
            config.deployable_redis_url()
        except ValueError as exc:
            return _fail(str(exc))
        try:  # a bad checkpoint stops here, before Ray starts, not in a replica's constructor
            config.model_path()
        except (ValueError, OSError) as exc:
            return _fail(f"cannot serve --model {config.model}: {exc}")
        if config.needs_index and config.redis_url and redis is None:
            try:
                asyncio.run(check_redis(resolve(config.redis_url)))
            except (IndexUnavailable, SecretNotFound) as exc:
                return _fail(f"{exc}\n  (the prefix index needs it; or use --policy pow2)")
        return _run(config, args)
    finally:
        if redis is not None:
            redis.close()


def _run(config: ClusterConfig, args: argparse.Namespace) -> int:
    import ray
    from ray import serve

    from prefixserve.cluster.app import build_app, serve_logging

    stop = threading.Event()

    def on_signal(signum: int, _: FrameType | None) -> None:
        stop.set()

    def handle_signals() -> dict[int, Any]:
        return {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}

    previous = handle_signals()
    local = args.address is None
    extra: dict[str, Any] = {}
    if args.metrics_export_port is not None:
        if local:
            extra["_metrics_export_port"] = args.metrics_export_port
        else:
            print("prefixserve: warning: --metrics-export-port is ignored with --address (the "
                  "cluster's nodes export on their own port)", file=sys.stderr)
    ray.init(address=args.address or "local", include_dashboard=args.dashboard if local else None,
             **extra)
    # ray.init takes SIGTERM for its own handler, which ends the process at once: a supervisor's
    # stop would then skip the shutdown below and leave the private Redis running
    handle_signals()
    try:
        serve.start(http_options={"host": config.host, "port": config.port},
                    logging_config=serve_logging(config))
        app = build_app(config)
        print(f"prefixserve: starting {config.workers.num_workers} worker(s) of "
              f"{config.model_name()} ({'GPU' if config.workers.on_gpu else 'CPU'}, policy "
              f"{config.policy}) ...")
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
        host = "127.0.0.1" if config.host in ("0.0.0.0", "::") else config.host
        base = f"http://{host}:{config.port}"
        if not wait_ready(base, stop):
            return 0
        # one write: Ray's log thread prints worker output to this stdout too
        sys.stdout.write(f"prefixserve: ready: serving the OpenAI API at {base}/v1 (model "
                         f"{config.model_name()!r}); Ctrl-C to stop\n")
        sys.stdout.flush()
        while not stop.wait(0.5):
            pass
        print("prefixserve: shutting down ...", flush=True)
        return 0
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        try:
            if local:
                serve.shutdown()
            else:
                serve.delete(APP_NAME)
        finally:
            ray.shutdown()


def wait_ready(base_url: str, stop: threading.Event) -> bool:
    """Wait for the ingress's /ready (every worker answers); False if stopped first."""
    note_at = time.monotonic() + READY_NOTE_S
    while not stop.is_set():
        try:
            if httpx.get(f"{base_url}/ready", timeout=10).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        if time.monotonic() > note_at:
            print(f"prefixserve: waiting for every worker to answer ({base_url}/ready) ...",
                  flush=True)
            note_at = float("inf")
        stop.wait(0.5)
    return False


def main(argv: list[str] | None = None) -> int:
    return serve_command(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
