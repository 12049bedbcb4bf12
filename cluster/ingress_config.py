"""The ingress section of the cluster config: its replicas, its tenants and what it admits."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from prefixserve.cluster.chat_template import TokenizerError, compile_chat_template
from prefixserve.cluster.tool_parsers import TOOL_PARSERS

DEFAULT_MAX_REQUEST_TOKENS = 2**18
DEFAULT_MAX_REQUEST_LOGPROBS = 2**17
DEFAULT_BODY_READ_TIMEOUT_S = 30.0
DEFAULT_IDLE_STREAM_TIMEOUT_S = 30.0
DEFAULT_WORKER_STALL_TIMEOUT_S = 20.0
API_KEYS_ENV = "PREFIXSERVE_API_KEYS"  # JSON object key -> tenant, or a path to such a file
API_KEY_ENV = "VLLM_API_KEY"  # one key, as vLLM reads it
API_KEY_TENANT = "default"  # the tenant `api_key` maps to


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
    worker_stall_timeout_s: float = Field(
        DEFAULT_WORKER_STALL_TIMEOUT_S, gt=0.0, description="A worker call that brings nothing "
        "for this long (workers send a keepalive every quarter of it while a request waits) "
        "has a stalled worker: a stopped process, a hung driver. A prompt with nothing shown "
        "yet is retried on another worker, a stream under way ends with an error event and "
        "[DONE], and the router leaves the worker out until it answers again. Well under "
        "Serve's health check, which takes ~90 s to replace a replica")
    control_tokens_in_messages: bool = Field(
        False, description="Tokenize a chat template's control strings written inside message "
        "text (`<|im_start|>`, `<|eot_id|>`, ...) as the control tokens, as transformers and "
        "vLLM do; any client can then forge a system or assistant turn. Default: they stay "
        "plain text, and every other token is as transformers gives it")
    allow_disconnect_disabled_header: bool = Field(
        False, description="Serve requests that carry Ray Serve's `x-request-disconnect-"
        "disabled: ?1` header. Serve's proxy then keeps such a request running after its "
        "client has gone (holding its in-flight slot and its worker's KV to the end), so by "
        "default they get 400 (code header_not_allowed); allow it only when every client is "
        "trusted")
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
    enable_auto_tool_choice: bool = Field(
        False, description="Let the model decide whether to call tools (tool_choice `auto`, "
        "the default when a request has tools), its calls read by tool_call_parser (vLLM's "
        "--enable-auto-tool-choice). Without it such a request gets 400; `none`, `required` "
        "and a named function need no parser")
    allow_runtime_lora_updating: bool = Field(
        False, description="Serve vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter "
        "(vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING): clients then name folders the workers read "
        "adapters from, so allow it only for trusted clients (with API keys on, only key holders)")
    tool_call_parser: str | None = Field(
        None, description="How the model writes tool calls (vLLM's --tool-call-parser): "
        f"{', '.join(TOOL_PARSERS)}")
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

    @field_validator("tool_call_parser")
    @classmethod
    def _check_parser(cls, value: str | None) -> str | None:
        if value is not None and value not in TOOL_PARSERS:
            raise ValueError(f"unknown tool-call parser {value!r}; known: "
                             f"{', '.join(TOOL_PARSERS)}")
        return value

    @model_validator(mode="after")
    def _auto_needs_parser(self) -> IngressConfig:
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs a tool_call_parser")
        return self

    @property
    def auto_tool_parser(self) -> str | None:
        """The parser tool_choice `auto` uses; None when auto is off."""
        return self.tool_call_parser if self.enable_auto_tool_choice else None

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


# Fields whose default comes from the environment (the README table says "env" for them).
ENV_DEFAULTS = (_api_keys_from_env, _api_key_from_env)
