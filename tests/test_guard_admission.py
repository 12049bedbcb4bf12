"""Admission against hostile clients, in process (no Ray): per-tenant fair share, slots taken
only once a body is in, the body-read timeout (408), and the idle-stream timeout.

The timeouts are exercised against a real HTTP server (uvicorn in a thread) over raw sockets:
only a real server has slow bodies and a client that stops reading. The app behind the real
`Guard` is a stand-in for the API (its routes hold a request, or stream without end); the
streamed response is the API's own `ClosingStreamingResponse`.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from prefixserve.cluster.config import ClusterConfig
from prefixserve.cluster.errors import ApiError
from prefixserve.cluster.guard import Guard, GuardSettings, key_digest
from prefixserve.cluster.ingress_config import IngressConfig
from prefixserve.cluster.local_redis import free_port
from prefixserve.cluster.render import ClosingStreamingResponse

KEYS = {key_digest("key-a"): "a", key_digest("key-b"): "b"}
A = {"Authorization": "Bearer key-a"}
B = {"Authorization": "Bearer key-b"}


class Stand:
    """What the stand-in app lets a test hold and observe."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.stream_closed = threading.Event()


def _app(stand: Stand) -> FastAPI:
    app = FastAPI()
    app.add_middleware(Guard)

    @app.exception_handler(ApiError)
    async def _error(_: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.post("/v1/completions")
    async def completions(request: Request) -> dict:
        body = await request.body()
        if body != b"quick":
            await stand.release.wait()
        return {"tenant": getattr(request.state, "tenant", None), "bytes": len(body)}

    @app.post("/v1/chat/completions")
    async def endless(request: Request) -> ClosingStreamingResponse:
        async def chunks() -> AsyncIterator[str]:
            try:
                while True:
                    yield "data: " + "x" * 65536 + "\n\n"
                    await asyncio.sleep(0)
            finally:  # where the API's generation is closed, aborting it on the workers
                stand.stream_closed.set()

        return ClosingStreamingResponse(chunks(), media_type="text/event-stream")

    return app


def _configure(**settings: object) -> None:
    base: dict = {"key_tenants": KEYS, "max_in_flight": 4, "max_request_bytes": 200_000}
    Guard.configure(GuardSettings(**(base | settings)))


@pytest.fixture(autouse=True)
def _restore_guard() -> Iterator[None]:
    yield
    Guard.configure(GuardSettings.of(IngressConfig()))


@contextmanager
def _asgi(stand: Stand) -> Iterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=_app(stand))
    yield httpx.AsyncClient(transport=transport, base_url="http://t", timeout=10)


async def _held(client: httpx.AsyncClient, headers: dict[str, str], count: int
                ) -> list[asyncio.Task]:
    """`count` requests admitted and held in the app."""
    before = Guard.in_flight
    tasks = [asyncio.create_task(client.post("/v1/completions", content=b"{}", headers=headers))
             for _ in range(count)]
    while Guard.in_flight < before + count:
        await asyncio.sleep(0.01)
    return tasks


def _envelope(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


async def test_one_tenant_cannot_take_every_slot() -> None:
    _configure(max_in_flight=5, max_in_flight_per_tenant=2)
    stand = Stand()
    with _asgi(stand) as client:
        held = await _held(client, A, 2)  # tenant a floods up to its cap ...
        r = await client.post("/v1/completions", content=b"{}", headers=A)
        assert _envelope(r, 429)["code"] == "tenant_overloaded"
        assert r.headers["retry-after"] == "1"
        assert Guard.tenant_in_flight == {"a": 2}
        ok = await client.post("/v1/completions", content=b"quick", headers=B)
        assert ok.json() == {"tenant": "b", "bytes": 5}  # ... and tenant b is still served
        held += await _held(client, B, 2)
        r = await client.post("/v1/completions", content=b"quick", headers=B)
        assert _envelope(r, 429)["code"] == "tenant_overloaded"  # one slot left, not b's
        stand.release.set()
        responses = await asyncio.wait_for(asyncio.gather(*held), 10)
        assert [r.status_code for r in responses] == [200] * 4
    assert Guard.in_flight == 0 and Guard.tenant_in_flight == {}


async def test_the_global_cap_still_holds_across_tenants() -> None:
    _configure(max_in_flight=3, max_in_flight_per_tenant=2)
    stand = Stand()
    with _asgi(stand) as client:
        held = await _held(client, A, 2) + await _held(client, B, 1)
        r = await client.post("/v1/completions", content=b"quick", headers=B)
        assert _envelope(r, 429)["code"] == "overloaded"
        stand.release.set()
        await asyncio.gather(*held)


async def test_without_api_keys_only_the_global_cap_applies() -> None:
    """Every client is the same anonymous tenant then: a per-tenant cap would halve the
    replica's capacity, so it is not applied."""
    _configure(key_tenants={}, max_in_flight=3, max_in_flight_per_tenant=1)
    stand = Stand()
    with _asgi(stand) as client:
        held = await _held(client, {}, 3)
        r = await client.post("/v1/completions", content=b"quick")
        assert _envelope(r, 429)["code"] == "overloaded"
        stand.release.set()
        assert [r.status_code for r in await asyncio.gather(*held)] == [200] * 3


def test_per_tenant_cap_defaults_to_half_the_replicas() -> None:
    assert IngressConfig().max_in_flight_per_tenant == 256
    assert IngressConfig(max_queued_requests=1).max_in_flight_per_tenant == 1
    assert IngressConfig(max_queued_requests=7).max_in_flight_per_tenant == 3
    assert IngressConfig(max_queued_requests_per_tenant=5).max_in_flight_per_tenant == 5
    capped = IngressConfig(max_queued_requests=8, max_queued_requests_per_tenant=50)
    assert capped.max_in_flight_per_tenant == 8
    cfg = ClusterConfig(policy="pow2", max_queued_requests=10, body_read_timeout_s=3,
                        idle_stream_timeout_s=4, max_request_tokens=100,
                        max_request_logprobs=50)
    settings = GuardSettings.of(cfg.ingress)
    assert (settings.max_in_flight_per_tenant, settings.body_read_timeout_s,
            settings.idle_stream_timeout_s, settings.max_request_tokens,
            settings.max_request_logprobs) == (5, 3.0, 4.0, 100, 50)


async def test_a_request_holds_no_slot_until_its_body_is_in() -> None:
    _configure(max_in_flight=1)
    stand = Stand()
    more = asyncio.Event()

    async def slow_body() -> AsyncIterator[bytes]:
        yield b"qu"
        await more.wait()
        yield b"ick"

    with _asgi(stand) as client:
        slow = [asyncio.create_task(client.post("/v1/completions", content=slow_body(),
                                                headers=A)) for _ in range(5)]
        await asyncio.sleep(0.1)
        assert Guard.in_flight == 0
        ok = await client.post("/v1/completions", content=b"quick", headers=B)
        assert ok.status_code == 200, ok.text
        more.set()
        statuses = sorted(r.status_code for r in await asyncio.gather(*slow))
    # once their bodies are in they compete for the one slot like any request
    assert 200 in statuses and set(statuses) <= {200, 429}, statuses


async def test_a_body_that_stalls_is_408_and_closes_the_connection() -> None:
    _configure(body_read_timeout_s=0.2)
    stand = Stand()

    async def stalled() -> AsyncIterator[bytes]:
        yield b'{"prompt": "'
        await asyncio.sleep(30)
        yield b'"}'

    with _asgi(stand) as client:
        r = await client.post("/v1/completions", content=stalled(), headers=A)
    assert _envelope(r, 408)["code"] == "request_timeout"
    assert r.headers["connection"] == "close"
    assert Guard.in_flight == 0


# ---- a real server ---------------------------------------------------------------------------


@contextmanager
def _server(stand: Stand) -> Iterator[int]:
    """uvicorn serving the stand-in app in a thread; yields its port."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(_app(stand), host="127.0.0.1", port=port,
                                           log_level="critical", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(10)


async def _open_slow_body(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection that sends its headers and a sliver of a 100 kB body, then nothing."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer key-a\r\n"
                 b"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n{\"pro")
    await writer.drain()
    return reader, writer


async def test_slow_bodies_do_not_starve_a_normal_request() -> None:
    _configure(max_in_flight=2, max_in_flight_per_tenant=2, body_read_timeout_s=1.5)
    stand = Stand()
    with _server(stand) as port:
        slow = await asyncio.gather(*(_open_slow_body(port) for _ in range(100)))
        await asyncio.sleep(0.2)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as c:
            for _ in range(3):
                r = await c.post("/v1/completions", content=b"quick", headers=B)
                assert r.status_code == 200, r.text
        answers = await asyncio.gather(*(asyncio.wait_for(reader.read(), 10)
                                         for reader, _ in slow))
        for _, writer in slow:
            writer.close()
    for answer in answers:  # each got its 408, then the server closed the connection (EOF)
        assert answer.startswith(b"HTTP/1.1 408 "), answer[:100]
        assert b'"request_timeout"' in answer
    assert Guard.in_flight == 0


async def test_a_client_that_stops_reading_is_cancelled() -> None:
    _configure(idle_stream_timeout_s=0.3)
    stand = Stand()
    with _server(stand) as port:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fills at once
        sock.connect(("127.0.0.1", port))
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\n"
                     b"Authorization: Bearer key-a\r\nContent-Length: 2\r\n\r\n{}")
        # never read: the server's writes block, and the request is cancelled
        closed = await asyncio.to_thread(stand.stream_closed.wait, 10)
        assert closed, "the stream of a client that reads nothing was never closed"
        deadline = time.monotonic() + 5
        while Guard.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert Guard.in_flight == 0
        sock.settimeout(10)
        received = b""
        while chunk := sock.recv(1 << 20):  # the server dropped the connection: EOF
            received += chunk
        sock.close()
    assert received.startswith(b"HTTP/1.1 200 ")
