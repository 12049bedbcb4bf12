"""The request router's pure helpers: local predictions and shared-prefix backlog accounting."""

from __future__ import annotations

import pytest
from ray.serve._private.common import RequestMetadata
from ray.serve.request_router import PendingRequest

from router.blocks import hash_chain, namespace
from router.request import GenerateRequest
from router.request_router import (
    LocalPredictions,
    PrefixAwareRequestRouter,
    _common_blocks,
    _Routed,
)

NS = namespace("fp")
A = hash_chain(list(range(16 * 6)), 16, NS)  # 6 blocks
B = hash_chain(list(range(16 * 4)) + [999] * 32, 16, NS)  # shares A's first 4 blocks
C = hash_chain([7] * 64, 16, NS)  # shares nothing


def test_common_blocks() -> None:
    assert _common_blocks(A, A) == 6
    assert _common_blocks(A, B) == _common_blocks(B, A) == 4
    assert _common_blocks(A, C) == 0
    assert _common_blocks(A, []) == 0
    assert _common_blocks(A, A[:3]) == 3


def test_local_predictions_give_consecutive_depth_and_expire() -> None:
    local = LocalPredictions(ttl_s=2.0)
    local.record(A, "w1", now=100.0)
    local.record(B[:5], "w2", now=100.5)
    assert local.depths(A, now=101.0) == {"w1": 6, "w2": 4}
    assert local.depths(B, now=101.0) == {"w1": 4, "w2": 5}
    assert local.depths(C, now=101.0) == {}
    assert local.depths(A, now=102.2) == {"w2": 4}  # w1's entries expired
    assert local.depths(A, now=103.0) == {}


def test_local_predictions_are_bounded() -> None:
    local = LocalPredictions(ttl_s=10.0, max_blocks=5)
    local.record(A, "w1", now=0.0)
    assert local.depths(A, now=1.0) == {}  # block 0 was evicted first
    assert len(local._blocks) == 5


def test_pending_work_shared_with_the_request_is_not_a_backlog() -> None:
    leader = _Routed("w", 0.0, new_tokens=6 * 16 + 3, chain=A, start_block=0, internal_id="r")
    follower = _Routed("w", 0.0, new_tokens=3, chain=A, start_block=6, internal_id="r")
    other = _Routed("w", 0.0, new_tokens=64, chain=C, start_block=0, internal_id="r")
    # A request with A's prefix waits only for the leader's unshared tail.
    assert leader.unshared_tokens(A, 16) == 3
    assert follower.unshared_tokens(A, 16) == 3
    assert other.unshared_tokens(A, 16) == 64
    # B shares 4 of the leader's blocks: the other 2 blocks + tail are a real backlog.
    assert leader.unshared_tokens(B, 16) == 2 * 16 + 3



def test_a_request_at_a_reused_address_gets_its_own_state() -> None:
    meta = RequestMetadata("r", "internal-r")
    a_args, c_args = [GenerateRequest("a", list(range(16 * 6)))], [GenerateRequest("c", [7] * 64)]
    for _ in range(100):  # CPython usually hands a freed block straight out again; retry if not
        router = PrefixAwareRequestRouter.__new__(PrefixAwareRequestRouter)  # the pure part
        router._contexts, router._prefix_routing = {}, True
        router._fingerprint, router._block_size = "fp", 16
        first = PendingRequest(a_args, {}, meta, future=None)
        router._context(first, a_args[0], now=0.0)  # then cancelled before routing
        address = id(first)
        del first
        second = PendingRequest(c_args, {}, meta, future=None)
        if id(second) == address:
            break
    else:
        pytest.fail("no freed address was reused")
    ctx = router._context(second, c_args[0], now=1.0)
    assert ctx.chain == C  # its own chain, not the cancelled request's
    assert len(router._contexts) == 2
