"""Admission at the HTTP edge: request size, API keys → tenants, slow clients, and bounds on
in-flight work, globally and per tenant.

`Guard` is a pure ASGI middleware, so it sees a request before FastAPI reads its body and stays
in the call until a streamed response has ended. Per request it

1. answers 413 when the body is over `max_request_bytes` (at once from `Content-Length`, else
   as soon as the streamed body passes the limit), so a giant body is never buffered whole;
2. when API keys are configured, answers 401 without a valid `Authorization: Bearer` key
   (`/health` and `/ready` stay open) and puts the key's tenant in `request.state.tenant`;
3. reads a generation request's whole body before counting it, within `body_read_timeout_s`
   (else 408 and the connection closed): a client that sends headers and then trickles or
   withholds its body holds no slot, so such clients cannot starve the others;
4. answers 429 with `Retry-After` once the tenant holds `max_in_flight_per_tenant` generation
   requests in this replica (code `tenant_overloaded`; with API keys only: without them every
   client is the same anonymous tenant), or the replica holds `max_in_flight` (code
   `overloaded`), instead of queueing without bound;
5. answers 400 to a request carrying Serve's `x-request-disconnect-disabled: ?1` header unless
   the operator allows it (`allow_disconnect_disabled_header`): with it, Serve's proxy would
   keep generating for a client that has gone, holding its slot to the end;
6. cancels a request whose client reads nothing of its response for `idle_stream_timeout_s`
   (a response write that long blocked), which aborts its generation, and drops the connection.

Keys are held only as SHA-256 digests. Every rejection is in OpenAI's error envelope.

Serve deep-copies the FastAPI app into each replica, so the replica's constructor hands the
settings over with `Guard.configure` (one ingress replica per process).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import struct
import sys
from dataclasses import dataclass
from typing import Any, ClassVar

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from prefixserve.cluster.errors import ApiError
from prefixserve.cluster.ingress_config import (
    DEFAULT_BODY_READ_TIMEOUT_S,
    DEFAULT_IDLE_STREAM_TIMEOUT_S,
    DEFAULT_MAX_REQUEST_LOGPROBS,
    DEFAULT_MAX_REQUEST_TOKENS,
    IngressConfig,
)

OPEN_PATHS = frozenset({"/health", "/ready"})
GENERATE_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
RETRY_AFTER_S = 1
# Serve's proxy stops watching for the client's disconnect when a request carries this as ?1.
DISCONNECT_DISABLED_HEADER = "x-request-disconnect-disabled"


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
    """What the ingress admits (the middleware's part, and the per-request cost bounds the
    routes check once they know a request's size)."""

    key_tenants: dict[str, str]  # key digest -> tenant; {}: off
    max_in_flight: int
    max_request_bytes: int
    max_in_flight_per_tenant: int | None = None  # None: no per-tenant cap
    body_read_timeout_s: float = DEFAULT_BODY_READ_TIMEOUT_S
    idle_stream_timeout_s: float = DEFAULT_IDLE_STREAM_TIMEOUT_S
    max_request_tokens: int = DEFAULT_MAX_REQUEST_TOKENS
    max_request_logprobs: int = DEFAULT_MAX_REQUEST_LOGPROBS
    allow_disconnect_disabled_header: bool = False

    @classmethod
    def of(cls, ingress: IngressConfig) -> GuardSettings:
        """What an ingress with this config admits. Only digests of the API keys leave it."""
        return cls(
            key_tenants={key_digest(key): tenant for key, tenant in ingress.key_tenants.items()},
            max_in_flight=ingress.max_in_flight,
            max_request_bytes=ingress.max_request_bytes,
            max_in_flight_per_tenant=ingress.max_in_flight_per_tenant,
            body_read_timeout_s=ingress.body_read_timeout_s,
            idle_stream_timeout_s=ingress.idle_stream_timeout_s,
            max_request_tokens=ingress.max_request_tokens,
            max_request_logprobs=ingress.max_request_logprobs,
            allow_disconnect_disabled_header=ingress.allow_disconnect_disabled_header,
        )


class BodyTooLarge(ApiError):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body is larger than {limit} bytes",
                         code="request_too_large")


class BodyTimeout(ApiError):
    def __init__(self, timeout_s: float) -> None:
        super().__init__(408, f"the request body did not arrive within {timeout_s:g} s",
                         code="request_timeout")


class Guard:
    """The admission middleware (see the module docstring)."""

    settings: ClassVar[GuardSettings]  # set by configure() before the app serves
    in_flight: ClassVar[int] = 0
    tenant_in_flight: ClassVar[dict[str, int]] = {}

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
        if scope["method"] != "POST" or _route(scope) not in GENERATE_PATHS:
            await self.app(scope, self._limited(receive), send)
            return
        try:
            body = await self._read_body(receive)
        except ApiError as exc:  # the rest of the body is unread: the connection cannot be reused
            await exc.response({"Connection": "close"})(scope, receive, send)
            return
        if body is None:  # the client left before its body was in
            return
        tenant = scope.get("state", {}).get("tenant")
        error = self._take_slot(tenant)
        if error is not None:
            await error.response({"Retry-After": str(RETRY_AFTER_S)})(scope, receive, send)
            return
        try:
            await self._serve(scope, _replay(body, receive), send)
        finally:
            self._release_slot(tenant)

    def _admit(self, scope: Scope) -> ApiError | None:
        """Size by Content-Length, Serve's disconnect header, then the API key (sets the
        tenant)."""
        headers = _headers(scope)
        length = headers.get("content-length", "")
        limit = self.settings.max_request_bytes
        # Compared by digits first: int() refuses a text past 4,300 digits.
        if length.isdigit() and (len(length) > len(str(limit)) or int(length) > limit):
            return BodyTooLarge(limit)
        if (headers.get(DISCONNECT_DISABLED_HEADER) == "?1"
                and not self.settings.allow_disconnect_disabled_header):
            return ApiError(400, f"the {DISCONNECT_DISABLED_HEADER} header is not accepted here: "
                            "a request is aborted when its client disconnects",
                            param=DISCONNECT_DISABLED_HEADER, code="header_not_allowed")
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

    async def _read_body(self, receive: Receive) -> bytes | None:
        """The whole body, within the size limit and the read deadline; None: client gone.
        One deadline for the whole body, so trickling a byte at a time does not extend it."""
        limit, timeout_s = self.settings.max_request_bytes, self.settings.body_read_timeout_s
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        chunks: list[bytes] = []
        size = 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0.0))
            except asyncio.TimeoutError:
                raise BodyTimeout(timeout_s) from None
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise BodyTooLarge(limit)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _take_slot(self, tenant: str | None) -> ApiError | None:
        """Count the request against the replica's cap and the tenant's; 429 when either is
        full (`tenant_overloaded` when only the tenant's is)."""
        if Guard.in_flight >= self.settings.max_in_flight:
            return ApiError(429, "too many requests in flight on this server; retry later",
                            "rate_limit_error", code="overloaded")
        per_tenant = self.settings.max_in_flight_per_tenant
        held = Guard.tenant_in_flight.get(tenant, 0) if tenant is not None else 0
        if tenant is not None and per_tenant is not None and held >= per_tenant:
            return ApiError(429, f"tenant {tenant!r} has {held} requests in flight on this "
                            "server, its limit; retry later", "rate_limit_error",
                            code="tenant_overloaded")
        Guard.in_flight += 1
        if tenant is not None:
            Guard.tenant_in_flight[tenant] = held + 1
        return None

    @staticmethod
    def _release_slot(tenant: str | None) -> None:
        Guard.in_flight -= 1
        if tenant is not None:
            left = Guard.tenant_in_flight.pop(tenant) - 1
            if left:
                Guard.tenant_in_flight[tenant] = left

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Run the app; a response write blocked past the idle timeout (the client reads
        nothing) cancels the request. The write may run in a task of the app's own (Starlette
        streams in a task group), so this task is cancelled: that unwinds the app, and the
        response's generation is closed, which aborts it on the workers."""
        task = asyncio.current_task()
        assert task is not None
        stalled = False

        async def watched(message: Message) -> None:
            nonlocal stalled
            if message["type"] != "http.response.body":
                await send(message)
                return
            try:
                await asyncio.wait_for(send(message), self.settings.idle_stream_timeout_s)
            except asyncio.TimeoutError:
                stalled = True
                task.cancel()
                await asyncio.Future()  # cancelled with the request, never resolves

        try:
            await self.app(scope, receive, watched)
        except asyncio.CancelledError:
            if not stalled:
                raise
            if sys.version_info >= (3, 11):
                task.uncancel()
            # returning with the response cut short: the server drops the connection

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


def _replay(body: bytes, receive: Receive) -> Receive:
    """`receive` that hands the app the body read already, then waits on the client (for its
    disconnect) as before."""
    pending = True

    async def replay() -> Message:
        nonlocal pending
        if pending:
            pending = False
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _route(scope: Scope) -> str:
    """The path inside the app (Serve mounts it under its route prefix, the root_path)."""
    root, path = scope.get("root_path", ""), scope["path"]
    if root and path.startswith(root):
        return path[len(root):] or "/"
    return path


def _headers(scope: Scope) -> dict[str, Any]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
