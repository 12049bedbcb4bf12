"""The Serve side of the request router: request keys, call arguments, the Serve shim."""

from __future__ import annotations

import pickle

import pytest
from ray.serve._private.common import DeploymentID

from prefixserve.router.blocks import hash_chain, namespace, token_array
from prefixserve.router.call_routing import generate_request
from prefixserve.router.request import GenerateRequest
from prefixserve.router.request_router import _request_key
from prefixserve.router.router_settings import RouterSettings
from prefixserve.router.router_state import RouterState
from prefixserve.router.serve_compat import (
    PendingRequest,
    ReplicaID,
    RequestMetadata,
    call_arguments,
    call_option,
    internal_request_id,
    replica_key,
)

C = hash_chain([7] * 64, 16, namespace("fp"))
META = RequestMetadata("r", "internal-r")


def test_a_request_at_a_reused_address_gets_its_own_state() -> None:
    a_args, c_args = [GenerateRequest("a", list(range(16 * 6)))], [GenerateRequest("c", [7] * 64)]
    for _ in range(100):  # CPython usually hands a freed block straight out again; retry if not
        state = RouterState(RouterSettings(fingerprint="fp", block_size=16))
        first = PendingRequest(a_args, {}, META, future=None)
        state.context(_request_key(first), a_args[0].prompt_token_ids, None, now=0.0)
        address = id(first)  # then cancelled before routing
        del first
        second = PendingRequest(c_args, {}, META, future=None)
        if id(second) == address:
            break
    else:
        pytest.fail("no freed address was reused")
    ctx = state.context(_request_key(second), c_args[0].prompt_token_ids, None, now=1.0)
    assert ctx.chain == C  # its own chain, not the cancelled request's
    assert len(state.contexts) == 2


def test_request_key_is_stable_per_request() -> None:
    one = PendingRequest([], {}, META, future=None)
    two = PendingRequest([], {}, META, future=None)
    assert _request_key(one) == _request_key(one) != _request_key(two)


def test_the_generate_request_is_found_in_args_or_kwargs() -> None:
    req = GenerateRequest("x", [1, 2])
    assert generate_request(PendingRequest([1, req], {}, META, future=None)) is req
    assert generate_request(PendingRequest([], {"request": req}, META, future=None)) is req
    assert generate_request(PendingRequest(["stats"], {}, META, future=None)) is None
    assert generate_request(None) is None


def test_a_request_carries_its_prompt_packed_and_checked() -> None:
    req = GenerateRequest("x", [5, 2**32 - 1, 0])
    assert req.prompt_token_ids == token_array([5, 2**32 - 1, 0])
    assert pickle.loads(pickle.dumps(req)) == req  # as Ray ships it to the worker
    with pytest.raises(ValueError, match="token ids"):
        GenerateRequest("x", [1, -2])


def test_serve_shim_accessors() -> None:
    req = GenerateRequest("x", [1])
    pr = PendingRequest([req], {"target_worker": "w1"}, META, future=None)
    assert call_arguments(pr) == (req, "w1")
    assert call_option(pr, "target_worker") == "w1"
    assert call_option(pr, "other") is None and call_option(None, "target_worker") is None
    assert internal_request_id(pr) == "internal-r"
    assert replica_key(ReplicaID("abc", DeploymentID("LLMWorker", "app"))) == "abc"
