"""Admission at the HTTP edge: request size, API keys → tenants, and a bound on in-flight work.

`Guard` is a pure ASGI middleware, so it sees a request before FastAPI reads its body and stays
in the call until a streamed response has ended. Per request it

1. answers 413 when the body is over `max_request_bytes` (at once from `Content-Length`, else
   as soon as the streamed body passes the limit), so a giant body is never buffered whole;
2. when API keys are configured, answers 401 without a valid `Authorization: Bearer` key
   (`/health` stays open) and puts the key's tenant in `request.state.tenant`;
3. answers 429 with `Retry-After` once `max_in_flight` generation requests are already held by
   this ingress replica, instead of queueing without bound.

Keys are held only as SHA-256 digests. Every rejection is in OpenAI's error envelope.

Serve deep-copies the FastAPI app into each replica, so the replica's constructor hands the
settings over with `Guard.configure` (one ingress replica per process).
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from dataclasses import dataclass
from typing import Any, ClassVar

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cluster.config import IngressConfig
from cluster.errors import ApiError

OPEN_PATHS = frozenset({"/health"})
GENERATE_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
RETRY_AFTER_S = 1


def key_digest(key: str) -> str:
    """What the ingress keeps of an API key."""
    return hashlib.sha256(key.encode()).hexdigest()


def tenant_salt(secret: bytes, tenant: str | None, client_salt: str | None) -> str | None:
    """The `cache_salt` the engine sees. Without auth it is the client's, as is. With auth it
    is keyed by the tenant, so no client-sent salt can reach another tenant's namespace (and
    the index holds nothing a reader could recompute from a guessed prompt)."""
    if tenant is None:
        return client_salt
    t, s = tenant.encode(), (client_salt or "").encode()
    flag = b"\x00" if client_salt is None else b"\x01"
    msg = struct.pack("<I", len(t)) + t + flag + struct.pack("<I", len(s)) + s
    return "t:" + hmac.new(secret, msg, hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class GuardSettings:
    key_tenants: dict[str, str]  # key digest -> tenant; {}: off
    max_in_flight: int
    max_request_bytes: int

    @classmethod
    def of(cls, ingress: IngressConfig) -> GuardSettings:
        """What an ingress with this config admits. Only digests of the API keys leave it."""
        return cls(
            key_tenants={key_digest(key): tenant for key, tenant in ingress.api_keys.items()},
            max_in_flight=ingress.max_in_flight,
            max_request_bytes=ingress.max_request_bytes,
        )


class BodyTooLarge(ApiError):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body is larger than {limit} bytes",
                         code="request_too_large")


class Guard:
    """The admission middleware (see the module docstring)."""

    settings: ClassVar[GuardSettings]  # set by configure() before the app serves
    in_flight: ClassVar[int] = 0

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    @classmethod
    def configure(cls, settings: GuardSettings) -> None:
        cls.settings = settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        error = self._admit(scope)
        if error is not None:
            await error.response(self._extra_headers(error))(scope, receive, send)
            return
        counted = scope["method"] == "POST" and _route(scope) in GENERATE_PATHS
        if counted:
            if Guard.in_flight >= self.settings.max_in_flight:
                error = ApiError(429, "too many requests in flight on this server; retry later",
                                 "rate_limit_error", code="overloaded")
                await error.response({"Retry-After": str(RETRY_AFTER_S)})(scope, receive, send)
                return
            Guard.in_flight += 1
        try:
            await self.app(scope, self._limited(receive), send)
        finally:
            if counted:
                Guard.in_flight -= 1

    def _admit(self, scope: Scope) -> ApiError | None:
        """Size by Content-Length, then the API key (sets the tenant)."""
        headers = _headers(scope)
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.settings.max_request_bytes:
            return BodyTooLarge(self.settings.max_request_bytes)
        if not self.settings.key_tenants or _route(scope) in OPEN_PATHS:
            return None
        scheme, _, key = headers.get("authorization", "").partition(" ")
        tenant = self.settings.key_tenants.get(key_digest(key.strip())) \
            if scheme.lower() == "bearer" else None
        if tenant is None:
            return ApiError(401, "Incorrect or missing API key; send `Authorization: Bearer "
                            "<key>`.", code="invalid_api_key")
        scope.setdefault("state", {})["tenant"] = tenant
        return None

    @staticmethod
    def _extra_headers(error: ApiError) -> dict[str, str]:
        return {"WWW-Authenticate": "Bearer"} if error.status == 401 else {}

    def _limited(self, receive: Receive) -> Receive:
        """`receive` that raises 413 once the body read so far passes the limit."""
        limit, seen = self.settings.max_request_bytes, 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(limit)
            return message

        return limited


def _route(scope: Scope) -> str:
    """The path inside the app (Serve mounts it under its route prefix, the root_path)."""
    root, path = scope.get("root_path", ""), scope["path"]
    if root and path.startswith(root):
        return path[len(root):] or "/"
    return path


def _headers(scope: Scope) -> dict[str, Any]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
