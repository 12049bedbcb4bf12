"""The routing-policy registry: what the config offers is what the app can build."""

from __future__ import annotations

import importlib
import typing

import pytest
from pydantic import ValidationError

from cluster.config import ClusterConfig, Policy
from router.routing_policies import POLICY_NAMES, ROUTING_POLICIES
from router.serve_compat import RequestRouter

REDIS = "redis://127.0.0.1:1/0"


def load(path: str) -> type:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def test_every_registered_router_is_a_serve_request_router() -> None:
    for name, policy in ROUTING_POLICIES.items():
        if policy.request_router is not None:
            assert issubclass(load(policy.request_router), RequestRouter), name


def test_the_known_policies_and_what_they_need() -> None:
    assert POLICY_NAMES == ("prefix", "pow2", "round_robin")  # the config's order (docs, CLI)
    assert {n for n, p in ROUTING_POLICIES.items() if p.needs_index} == {"prefix"}
    assert ROUTING_POLICIES["pow2"].request_router is None  # Serve's default router
    assert load(ROUTING_POLICIES["prefix"].request_router).__name__ == "PrefixAwareRequestRouter"


def test_the_config_offers_exactly_the_registered_policies() -> None:
    assert typing.get_args(Policy) == POLICY_NAMES
    for name in POLICY_NAMES:
        assert ClusterConfig(policy=name, redis_url=REDIS).policy == name
    with pytest.raises(ValidationError):
        ClusterConfig(policy="random", redis_url=REDIS)
