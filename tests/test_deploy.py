"""deploy/ stays true: manifests parse and agree, and the Serve config really serves.

The live test starts deploy/serve_config.yaml the way `serve run` does (the controller builds
the application from `import_path` + `args`, then applies the per-deployment overrides), scaled
down to CPU by overriding only what a GPU-less machine cannot honour.
"""

from __future__ import annotations

import copy
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from ray import serve
from ray.serve.context import _get_global_client
from ray.serve.schema import ServeDeploySchema
from servekit import start_ray, stop_ray

from prefixserve.cluster.app import app_builder
from prefixserve.cluster.config import REDIS_URL_ENV, ClusterConfig
from prefixserve.cluster.local_redis import LocalRedis, free_port
from prefixserve.cluster.render import WORKER_HEADER
from prefixserve.router.request_router import PrefixAwareRequestRouter
from prefixserve.workers.checkpoints import BUILTIN_MODEL_NAME

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
SERVE_CONFIG = DEPLOY / "serve_config.yaml"
RAYSERVICE = DEPLOY / "kuberay" / "rayservice.yaml"
REDIS = DEPLOY / "kuberay" / "redis.yaml"


def load(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def serve_app() -> dict[str, Any]:
    (app,) = load(SERVE_CONFIG)["applications"]
    return app


def test_every_yaml_parses() -> None:
    files = sorted(DEPLOY.rglob("*.yaml"))
    assert len(files) >= 3
    for path in files:
        assert list(yaml.safe_load_all(path.read_text())), path


def test_serve_config_schema_import_path_and_args() -> None:
    config = ServeDeploySchema.model_validate(load(SERVE_CONFIG))
    (app,) = config.applications
    assert app.import_path == "prefixserve.cluster.app:app_builder"
    assert app.route_prefix == "/"
    module, attr = app.import_path.split(":")
    assert getattr(__import__(module, fromlist=[attr]), attr) is app_builder
    args = dict(app.args)
    args.pop("model")  # a path on the GPU nodes, not on this machine
    parsed = ClusterConfig.model_validate({**args, "redis_url": "redis://redis:6379/0"})
    assert parsed.workers.gpus_per_worker == 1
    assert parsed.policy == "prefix"
    workers = {d.name: d for d in app.deployments}["LLMWorker"]
    assert workers.ray_actor_options.num_gpus == 1
    router = workers.request_router_config
    assert router["request_router_class"] == (
        "prefixserve.router.request_router:PrefixAwareRequestRouter")
    module, attr = router["request_router_class"].split(":")
    assert getattr(__import__(module, fromlist=[attr]), attr) is PrefixAwareRequestRouter
    settings = router["request_router_kwargs"]["settings"]
    assert settings["block_size"] == parsed.engine.block_size
    assert settings["model"] == parsed.served_model_name
    assert workers.autoscaling_config["max_replicas"] >= workers.autoscaling_config["min_replicas"]


def test_serve_config_args_are_checked() -> None:
    args = {**serve_app()["args"], "redis_url": "redis://r:6379/0"}
    args.pop("model")
    with pytest.raises(ValueError, match="num_workers"):
        ClusterConfig.model_validate({**args, "num_workers": 0})
    with pytest.raises(ValueError, match="not_a_field"):
        ClusterConfig.model_validate({**args, "not_a_field": 1})


def test_rayservice_embeds_the_serve_config() -> None:
    service = load(RAYSERVICE)
    assert service["kind"] == "RayService"
    assert yaml.safe_load(service["spec"]["serveConfigV2"]) == load(SERVE_CONFIG)
    cluster = service["spec"]["rayClusterConfig"]
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    (group,) = cluster["workerGroupSpecs"]
    (container,) = group["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert container["readinessProbe"] and container["livenessProbe"]
    env = {e["name"]: e for e in container["env"]}
    secret = env["PREFIXSERVE_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
    assert secret == {"name": "prefixserve-redis", "key": "password"}
    assert REDIS_URL_ENV in env and "$(PREFIXSERVE_REDIS_PASSWORD)" in env[REDIS_URL_ENV]["value"]


def test_redis_manifest() -> None:
    docs = {d["kind"]: d for d in yaml.safe_load_all(REDIS.read_text())}
    assert {"Deployment", "Service", "NetworkPolicy"} <= set(docs)
    (container,) = docs["Deployment"]["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "prefixserve-redis"
    assert "--requirepass" in container["args"]
    assert container["readinessProbe"] and container["livenessProbe"]
    assert docs["Service"]["spec"]["ports"][0]["port"] == 6379


def test_dockerfile_is_non_root_and_installs_the_package() -> None:
    text = (DEPLOY / "docker" / "Dockerfile").read_text()
    assert "pip install --no-cache-dir ." in text
    assert "USER ray" in text
    assert (DEPLOY.parent / ".dockerignore").is_file()


def scaled_down(redis_url: str, port: int) -> dict[str, Any]:
    """The serve config on a CPU-only machine: built-in model, 2 workers, fractional CPUs."""
    config = copy.deepcopy(load(SERVE_CONFIG))
    config["http_options"] = {"host": "127.0.0.1", "port": port}
    config["proxy_location"] = "HeadOnly"
    (app,) = config["applications"]
    app["runtime_env"] = {"env_vars": {REDIS_URL_ENV: redis_url}}
    app["args"].update(
        model=BUILTIN_MODEL_NAME, served_model_name=None, gpus_per_worker=0, cpus_per_worker=0.5,
        dtype="float32", num_blocks=128, max_model_len=512, ingress_replicas=1,
    )
    deployments = {d["name"]: d for d in app["deployments"]}
    workers = deployments["LLMWorker"]
    workers["ray_actor_options"] = {"num_cpus": 0.5, "num_gpus": 0}
    workers["autoscaling_config"].update(min_replicas=2, initial_replicas=2, max_replicas=2)
    workers["request_router_config"]["request_router_kwargs"]["settings"]["model"] = \
        BUILTIN_MODEL_NAME
    deployments["OpenAIIngress"].update(num_replicas=1, ray_actor_options={"num_cpus": 0.25})
    return config


@pytest.fixture(scope="module")
def deployed(redis_server: LocalRedis) -> Iterator[str]:
    start_ray(address="local", num_cpus=2)
    port = free_port()  # after Ray's own processes have taken their ports
    try:
        config = ServeDeploySchema.model_validate(scaled_down(redis_server.url, port))
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        _get_global_client().deploy_apps(config, _blocking=False)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 240
        while True:
            try:
                if httpx.get(f"{url}/v1/models", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            status = serve.status().applications.get("prefixserve")
            assert status is None or status.status != "DEPLOY_FAILED", status
            assert time.monotonic() < deadline, "the serve config did not come up"
            time.sleep(0.5)
        yield url
    finally:
        stop_ray()


@pytest.mark.cluster
def test_serve_config_answers_a_chat_completion(deployed: str) -> None:
    body = {
        "model": BUILTIN_MODEL_NAME,
        "messages": [{"role": "user", "content": "Say hello"}],
        "max_tokens": 4,
        "temperature": 0,
    }
    r = httpx.post(f"{deployed}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "chat.completion"
    assert out["choices"][0]["message"]["role"] == "assistant"
    assert 1 <= out["usage"]["completion_tokens"] <= 4


@pytest.mark.cluster
def test_serve_config_routes_by_prefix(deployed: str) -> None:
    # The YAML's router kwargs carry no Redis URL: the router finds the index through
    # PREFIXSERVE_REDIS_URL, as it does on KubeRay. Load-only routing would split these pairs.
    for topic in ["billing", "shipping", "returns", "warranty"]:
        system = f"You are the {topic} desk of ACME. Answer briefly. " * 6
        served = []
        for question in ["Where is my order?", "Can I pay later?"]:
            body = {
                "model": BUILTIN_MODEL_NAME,
                "messages": [{"role": "system", "content": system},
                             {"role": "user", "content": question}],
                "max_tokens": 2,
                "temperature": 0,
            }
            r = httpx.post(f"{deployed}/v1/chat/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            served.append((r.headers[WORKER_HEADER],
                           r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]))
        (first, _), (second, cached) = served
        assert second == first
        assert cached >= 256


@pytest.mark.cluster
def test_worker_pods_readiness_probe_asks_the_application(deployed: str) -> None:
    """The RayService's worker readiness probe, run as written (this node's raylet check left
    out): it passes against the running application, and fails where nothing serves."""
    (group,) = load(RAYSERVICE)["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    (container,) = group["template"]["spec"]["containers"]
    shell, flag, command = container["readinessProbe"]["exec"]["command"]
    app_check = command.split(" && ", 1)[1]
    assert "/ready?min_workers=1" in app_check
    port = httpx.URL(deployed).port
    here = app_check.replace("localhost:8000", f"127.0.0.1:{port}")
    assert subprocess.run([shell, flag, here], timeout=30).returncode == 0
    nowhere = app_check.replace("localhost:8000", f"127.0.0.1:{free_port()}")
    assert subprocess.run([shell, flag, nowhere], timeout=30).returncode != 0
    ready = httpx.get(f"{deployed}/ready", timeout=30)
    assert ready.status_code == 200 and set(ready.json()["workers"].values()) == {"ready"}
