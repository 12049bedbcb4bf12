"""`RayPrefixRouter`: Ray Serve's own ``PrefixCacheAffinityRouter`` over our LLMWorker replicas,
the reference the KV-aware ``prefix`` policy is measured against.

Ray's router keeps a character prefix tree of the text it finds in ``.prompt`` / ``.messages``
of the handle call's arguments; ours carry a `GenerateRequest` of token ids. Each token becomes
one character (``chr(0xE000 + id)``: above the surrogates, so any id below ~1.05M is a valid
code point), so the tree's character prefixes are token prefixes. A salted request starts with
its salt and a NUL, which no token character is: tenants never share tree entries, as they never
share KV blocks. Pending requests are fulfilled by identity (`ServeRequestRouter`): Serve's
default matching by request id would leave the second of a batch's handle calls unrouted. Calls
aimed at one replica and calls that generate nothing are routed as every policy routes them
(:mod:`router.call_routing`); Ray's router ranks the generate calls.
"""

from __future__ import annotations

from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (
    PrefixCacheAffinityRouter,
)

from prefixserve.router.call_routing import ServeRanked
from prefixserve.router.request import GenerateRequest
from prefixserve.router.serve_compat import PendingRequest

TOKEN_CHAR_BASE = 0xE000  # private use area, past the surrogates (0xD800-0xDFFF)


def token_text(request: GenerateRequest) -> str:
    """One character per prompt token, after the salt's namespace marker when salted."""
    tokens = "".join(chr(TOKEN_CHAR_BASE + t) for t in request.prompt_token_ids)
    return tokens if request.cache_salt is None else f"{request.cache_salt}\0{tokens}"


class RayPrefixRouter(ServeRanked, PrefixCacheAffinityRouter):
    def _extract_text_from_request(self, pending_request: PendingRequest) -> str:
        for arg in pending_request.args:
            if isinstance(arg, GenerateRequest):
                return token_text(arg)
        return super()._extract_text_from_request(pending_request)
