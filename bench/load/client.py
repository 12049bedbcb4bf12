"""Streaming client for any OpenAI-compatible server (prefixserve, vLLM, SGLang).

Each request streams with `stream_options.include_usage`, so the last chunk reports exact token
counts and, where the server supports it, `prompt_tokens_details.cached_tokens`. Prompts that are
token-id lists go to `/v1/completions` as `prompt: [ids]`, so prompt lengths are exact.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from prefixserve.bench.load.metrics import RequestResult, from_timeline
from prefixserve.bench.load.sse import StreamReader

WORKER_HEADER = "x-prefixserve-worker"


@dataclass
class Prompt:
    """One request of a workload: token ids (completions) or chat messages."""

    tokens: list[int] | None = None
    messages: list[dict[str, str]] | None = None
    output_len: int = 16
    group: str = ""

    @property
    def prompt_len(self) -> int:
        return len(self.tokens) if self.tokens is not None else 0


@dataclass
class ClientConfig:
    base_url: str = "http://127.0.0.1:8000"
    model: str = ""
    endpoint: str = "/v1/completions"          # or /v1/chat/completions (needs messages)
    api_key: str | None = None
    ignore_eos: bool = False                   # vLLM/SGLang extension: exact output lengths
    temperature: float = 0.0
    extra_body: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 600.0

    @property
    def chat(self) -> bool:
        return self.endpoint.rstrip("/").endswith("chat/completions")


def build_body(cfg: ClientConfig, prompt: Prompt) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": cfg.model,
        "max_tokens": prompt.output_len,
        "temperature": cfg.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.chat:
        if prompt.messages is None:
            raise ValueError("the chat endpoint needs a text workload (messages)")
        body["messages"] = prompt.messages
    else:
        body["prompt"] = prompt.tokens
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    body.update(cfg.extra_body)
    return body


def make_http_client(cfg: ClientConfig, max_connections: int = 1000) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=100)
    return httpx.AsyncClient(base_url=cfg.base_url, headers=headers, limits=limits,
                             timeout=httpx.Timeout(cfg.timeout_s, connect=30.0))


async def send(http: httpx.AsyncClient, cfg: ClientConfig, prompt: Prompt,
               request_id: str = "", start_time: float = 0.0) -> RequestResult:
    """Send one streaming request and time it; never raises for server or network errors."""
    meta: dict[str, Any] = {"request_id": request_id, "group": prompt.group,
                            "prompt_len": prompt.prompt_len, "start_time": start_time}
    reader = StreamReader()
    error = ""
    body = build_body(cfg, prompt)
    sent = time.perf_counter()
    try:
        async with http.stream("POST", cfg.endpoint, json=body) as resp:
            meta["worker"] = resp.headers.get(WORKER_HEADER)
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", "replace")
                error = f"HTTP {resp.status_code}: {body[:300]}"
            else:
                error = await _consume(resp, reader)
    except (httpx.HTTPError, OSError, ValueError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    ended = time.perf_counter()
    usage = reader.usage
    if usage.get("prompt_tokens"):
        meta["prompt_len"] = usage["prompt_tokens"]
    meta["cached_tokens"] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    output_tokens = usage.get("completion_tokens") or 0
    if error:
        return RequestResult(success=False, error=error, output_tokens=output_tokens,
                             latency=ended - sent, **meta)
    return from_timeline(sent, reader.content_times, output_tokens, **meta)


async def _consume(resp: httpx.Response, reader: StreamReader) -> str:
    """Read the SSE stream, stamping content events; returns an error message or ''."""
    async for chunk in resp.aiter_bytes():
        if reader.feed(chunk, time.perf_counter()):
            return reader.error
    return reader.finish()
