"""Admission middleware and tenant salts, in process (no Ray): 401, 413, 429, salts."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from prefixserve.cluster.config import ClusterConfig
from prefixserve.cluster.errors import ApiError
from prefixserve.cluster.guard import Guard, GuardSettings, key_digest, tenant_salt
from prefixserve.cluster.ingress_config import API_KEYS_ENV, IngressConfig

SECRET = b"s" * 32


def _app(release: asyncio.Event) -> FastAPI:
    app = FastAPI()
    app.add_middleware(Guard)

    @app.exception_handler(ApiError)
    async def _error(_: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.post("/v1/completions")
    async def completions(request: Request) -> dict:
        body = await request.body()
        await release.wait()
        return {"tenant": getattr(request.state, "tenant", None), "bytes": len(body)}

    return app


@pytest.fixture
async def client() -> AsyncIterator[tuple[httpx.AsyncClient, asyncio.Event]]:
    release = asyncio.Event()
    Guard.configure(GuardSettings(key_tenants={key_digest("key-a"): "a"}, max_in_flight=2,
                                  max_request_bytes=1024))
    transport = httpx.ASGITransport(app=_app(release))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        yield c, release
    Guard.configure(GuardSettings.of(IngressConfig()))


def _assert_envelope(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


async def test_api_key_required_and_tenant_set(client: tuple) -> None:
    c, release = client
    release.set()
    assert (await c.get("/health")).status_code == 200
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic key-a"}):
        r = await c.post("/v1/completions", content=b"{}", headers=headers)
        assert _assert_envelope(r, 401)["code"] == "invalid_api_key"
        assert r.headers["www-authenticate"] == "Bearer"
    ok = await c.post("/v1/completions", content=b"{}", headers={"Authorization": "Bearer key-a"})
    assert ok.json() == {"tenant": "a", "bytes": 2}


async def test_body_over_the_limit_is_413(client: tuple) -> None:
    c, release = client
    release.set()
    auth = {"Authorization": "Bearer key-a"}
    r = await c.post("/v1/completions", content=b"x" * 2000, headers=auth)
    assert _assert_envelope(r, 413)["code"] == "request_too_large"

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: counted while read
        for _ in range(10):
            yield b"x" * 200

    r = await c.post("/v1/completions", content=chunks(), headers=auth)
    _assert_envelope(r, 413)
    assert (await c.post("/v1/completions", content=b"x" * 1000, headers=auth)).status_code == 200


async def test_in_flight_cap_is_429_with_retry_after(client: tuple) -> None:
    c, release = client
    auth = {"Authorization": "Bearer key-a"}
    held = [asyncio.create_task(c.post("/v1/completions", content=b"{}", headers=auth))
            for _ in range(2)]
    while Guard.in_flight < 2:
        await asyncio.sleep(0.01)
    r = await c.post("/v1/completions", content=b"{}", headers=auth)
    assert _assert_envelope(r, 429)["code"] == "overloaded"
    assert r.headers["retry-after"] == "1"
    assert (await c.get("/health")).status_code == 200  # not counted
    release.set()
    assert [t.status_code for t in await asyncio.gather(*held)] == [200, 200]
    assert Guard.in_flight == 0
    assert (await c.post("/v1/completions", content=b"{}", headers=auth)).status_code == 200


def test_tenant_salt_namespaces() -> None:
    assert tenant_salt(SECRET, None, "mine") == "mine"  # auth off: the client's, as is
    assert tenant_salt(SECRET, None, None) is None
    a = tenant_salt(SECRET, "a", None)
    assert a != tenant_salt(SECRET, "b", None)
    assert a != tenant_salt(SECRET, "a", "x")
    # a client sending another tenant's derived salt lands in its own namespace
    assert tenant_salt(SECRET, "b", a) not in (a, tenant_salt(SECRET, "a", a))
    assert tenant_salt(SECRET, "ab", "c") != tenant_salt(SECRET, "a", "bc")
    assert tenant_salt(SECRET, "a", None) != tenant_salt(b"t" * 32, "a", None)


def test_api_keys_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    redis = "redis://127.0.0.1:6399/0"
    monkeypatch.delenv(API_KEYS_ENV, raising=False)
    assert ClusterConfig(redis_url=redis).ingress.api_keys == {}
    monkeypatch.setenv(API_KEYS_ENV, '{"sk-secret-1": "acme"}')
    cfg = ClusterConfig(redis_url=redis)
    assert cfg.ingress.api_keys == {"sk-secret-1": "acme"}
    assert "sk-secret-1" not in repr(cfg) and "sk-secret-1" not in str(cfg)
    settings = GuardSettings.of(cfg.ingress)
    assert settings.key_tenants == {key_digest("sk-secret-1"): "acme"}
    assert "sk-secret-1" not in repr(settings)
    file = tmp_path / "keys.json"
    file.write_text(json.dumps({"sk-file": "beta"}))
    monkeypatch.setenv(API_KEYS_ENV, str(file))
    assert ClusterConfig(redis_url=redis).ingress.api_keys == {"sk-file": "beta"}
    from_flag = ClusterConfig(redis_url=redis, api_keys=str(file))
    assert from_flag.ingress.api_keys == {"sk-file": "beta"}
    for bad in ('{"sk-leak": ""}', '{" sk-leak": "t"}', "{not json sk-leak"):
        with pytest.raises(ValidationError) as info:
            ClusterConfig(redis_url=redis, api_keys=bad)
        assert "sk-leak" not in str(info.value)
    with pytest.raises(ValidationError, match="cannot read the API key file"):
        ClusterConfig(redis_url=redis, api_keys=str(tmp_path / "missing.json"))


def test_in_flight_cap_never_exceeds_serves_own_limit() -> None:
    cfg = ClusterConfig(policy="pow2", max_queued_requests=5000, ingress_max_ongoing_requests=64)
    assert GuardSettings.of(cfg.ingress).max_in_flight == 64
