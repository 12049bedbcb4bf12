"""The routing-policy registry: what the config offers is what the app can build."""

from __future__ import annotations

import importlib
import typing

import pytest
from pydantic import ValidationError

from prefixserve.cluster.app import request_router_config
from prefixserve.cluster.config import ClusterConfig, Policy
from prefixserve.router.index import IndexSettings
from prefixserve.router.ray_prefix import token_text
from prefixserve.router.request import GenerateRequest
from prefixserve.router.router_settings import RouterSettings
from prefixserve.router.routing_policies import POLICY_NAMES, ROUTING_POLICIES
from prefixserve.router.serve_compat import PowerOfTwoChoicesRequestRouter, ServeRequestRouter

REDIS = "redis://127.0.0.1:1/0"


def load(path: str) -> type:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def test_every_registered_router_is_a_serve_request_router() -> None:
    for name, policy in ROUTING_POLICIES.items():
        # every policy routes calls aimed at one replica the same way (router.call_routing)
        assert issubclass(load(policy.request_router), ServeRequestRouter), name


def test_the_known_policies_and_what_they_need() -> None:
    # the config's order (docs, CLI)
    assert POLICY_NAMES == ("prefix", "pow2", "round_robin", "ray_prefix")
    assert {n for n, p in ROUTING_POLICIES.items() if p.needs_index} == {"prefix"}
    pow2 = load(ROUTING_POLICIES["pow2"].request_router)  # Serve's own ranking, our call routing
    assert issubclass(pow2, PowerOfTwoChoicesRequestRouter)
    assert load(ROUTING_POLICIES["prefix"].request_router).__name__ == "PrefixAwareRequestRouter"
    assert load(ROUTING_POLICIES["ray_prefix"].request_router).__name__ == "RayPrefixRouter"


def test_every_policy_is_given_the_router_sections_wait_for_a_named_worker() -> None:
    """Calls aimed at one worker are routed alike under every policy (router.call_routing),
    and how long such a call waits for its replica is the router section's under each."""
    router = RouterSettings(target_wait_s=2.5)
    for name in POLICY_NAMES:
        kwargs = request_router_config(name, REDIS, router, IndexSettings()).request_router_kwargs
        wait = kwargs["settings"]["target_wait_s"] if name == "prefix" else kwargs["target_wait_s"]
        assert wait == 2.5, name
    for name in ("round_robin", "pow2"):  # (ray_prefix's state starts a Ray actor)
        cls = load(ROUTING_POLICIES[name].request_router)
        chooser = cls.__new__(cls)
        chooser.initialize_state(
            **request_router_config(name, None, router, IndexSettings()).request_router_kwargs)
        assert chooser._target_wait_s == 2.5, name


def test_the_config_offers_exactly_the_registered_policies() -> None:
    assert typing.get_args(Policy) == POLICY_NAMES
    for name in POLICY_NAMES:
        assert ClusterConfig(policy=name, redis_url=REDIS).policy == name
    with pytest.raises(ValidationError):
        ClusterConfig(policy="random", redis_url=REDIS)


def test_ray_prefix_spells_token_prefixes_as_character_prefixes() -> None:
    def text(ids: list[int], salt: str | None = None) -> str:
        return token_text(GenerateRequest("r", ids, cache_salt=salt))

    assert len(text([0, 1, 2])) == 3
    assert text([5, 6, 7]).startswith(text([5, 6]))
    assert not text([5, 6]).startswith(text([5, 7]))
    assert not any(0xD800 <= ord(c) <= 0xDFFF for c in text([0, 0x1FFF, 0x20000]))
    assert not text([5, 6], "a").startswith(text([5], "b"))
    assert not text([5, 6], "a").startswith(text([5]))
