"""The routing policies a cluster can run, by the name ``ClusterConfig.policy`` takes.

A policy is a Serve request router (``router.serve_compat.ServeRequestRouter``, whose calls
aimed at one replica go through ``router.call_routing`` under every policy). Adding one is a
module with such a subclass plus one entry here: the config's choices and the app's wiring both
come from this table. Import paths, not classes, so that reading the table (the config does, in
every CLI call) imports no Ray.
"""

from __future__ import annotations

from dataclasses import dataclass

from prefixserve.router.registry import Registry


@dataclass(frozen=True)
class RoutingPolicy:
    request_router: str  # "module:Class" of the request router
    needs_index: bool  # routes with the prefix index: gets the index settings as router kwargs


ROUTING_POLICIES: Registry[RoutingPolicy] = Registry("routing policy", {
    # KV-aware: ranks by estimated TTFT with prefix-cache credit from the index
    "prefix": RoutingPolicy("prefixserve.router.request_router:PrefixAwareRequestRouter",
                            needs_index=True),
    # Serve's power of two choices (by queue length)
    "pow2": RoutingPolicy("prefixserve.router.pow2:PowerOfTwoRequestRouter", needs_index=False),
    # cache-blind rotation, the baseline
    "round_robin": RoutingPolicy("prefixserve.router.round_robin:RoundRobinRequestRouter",
                                 needs_index=False),
    # Ray Serve's PrefixCacheAffinityRouter (its own prefix tree of routed prompts), the reference
    "ray_prefix": RoutingPolicy("prefixserve.router.ray_prefix:RayPrefixRouter", needs_index=False),
})

POLICY_NAMES: tuple[str, ...] = ROUTING_POLICIES.names()
