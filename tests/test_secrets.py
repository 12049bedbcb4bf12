"""Secrets travel by reference: what a deployment may hold, and how a replica resolves it."""

from __future__ import annotations

from pathlib import Path

import pytest

from prefixserve.cluster.app import app_builder
from prefixserve.cluster.config import REDIS_URL_ENV, ClusterConfig
from prefixserve.cluster.ingress_config import API_KEYS_ENV
from prefixserve.router.secret_refs import SecretNotFound, resolve, url_has_secret

SECRET_URL = "rediss://:s3cret@redis.example:6380/0"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(REDIS_URL_ENV, raising=False)
    monkeypatch.delenv(API_KEYS_ENV, raising=False)


def test_references_resolve_from_env_and_file(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MY_REDIS", f" {SECRET_URL}\n")
    assert resolve("env:MY_REDIS") == SECRET_URL
    (tmp_path / "url").write_text(SECRET_URL + "\n")
    assert resolve(f"file:{tmp_path / 'url'}") == SECRET_URL
    assert resolve("redis://plain:6379/0") == "redis://plain:6379/0"
    with pytest.raises(SecretNotFound, match="NOPE is not set"):
        resolve("env:NOPE")
    with pytest.raises(SecretNotFound, match="cannot read"):
        resolve(f"file:{tmp_path / 'missing'}")


@pytest.mark.parametrize(("url", "secret"), [
    (SECRET_URL, True),
    ("redis://user:pw@h:6379/0", True),
    ("redis://h:6379/0?password=pw", True),
    ("redis://user@h:6379/0", False),
    ("unix:///tmp/redis.sock?db=0", False),
])
def test_url_has_secret(url: str, secret: bool) -> None:
    assert url_has_secret(url) is secret


def test_deployments_get_a_reference_never_the_password(
        monkeypatch: pytest.MonkeyPatch) -> None:
    plain = ClusterConfig(redis_url="redis://127.0.0.1:6379/0")
    assert plain.deployable_redis_url() == "redis://127.0.0.1:6379/0"
    assert ClusterConfig(redis_url="env:MY_REDIS").deployable_redis_url() == "env:MY_REDIS"
    assert ClusterConfig(redis_url="file:/run/secrets/redis").deployable_redis_url() \
        == "file:/run/secrets/redis"
    with pytest.raises(ValueError, match="carries a password"):
        ClusterConfig(redis_url=SECRET_URL).deployable_redis_url()
    monkeypatch.setenv(REDIS_URL_ENV, SECRET_URL)
    assert ClusterConfig().deployable_redis_url() == f"env:{REDIS_URL_ENV}"
    assert ClusterConfig(policy="pow2").deployable_redis_url() is None  # baselines: no index


@pytest.mark.parametrize("keys", [{"sk-1": "a"}, '{"sk-1": "a"}', ' {"sk-1": "a"}'])
def test_app_args_refuse_inline_api_keys(keys: object) -> None:
    args = {"redis_url": "redis://127.0.0.1:6379/0", "api_keys": keys}
    with pytest.raises(ValueError, match="stored in Serve's config") as info:
        app_builder(args)
    assert "sk-1" not in str(info.value)
