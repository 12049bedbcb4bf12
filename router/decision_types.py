"""The values one routing decision passes around: the request's context, the candidates Serve
offers, and what the decision leaves behind (a prediction for the index, an outcome for the
metrics)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prefixserve.router.blocks import Chain
from prefixserve.router.policy import Ranking


@dataclass
class RequestContext:
    """Per pending request, so retries never re-hash the prompt."""

    chain: Chain  # the prompt's first blocks, as many as the decision needs (extend())
    tie_key: bytes  # orders tied workers when the chain is empty (see tie_key()); else b""
    num_prompt_tokens: int
    created_at: float
    tokens: Sequence[int] = ()  # the prompt (matched up to max_match_tokens): the chain's rest
    namespace: bytes = b""
    complete: bool = True  # the chain holds every full block of ``tokens``
    ranking: Ranking | None = None  # its candidates' costs, once ranked
    confirmed: dict[str, int] = field(default_factory=dict)  # replica -> depth at lookup
    adapter: str | None = None  # its LoRA adapter's identity; None: the base model
    failopen: str | None = None  # why its lookup failed open, if it did
    unknown: frozenset[str] = frozenset()  # replicas its lookup had no answer for (a shard down)

    def depth(self, replica: str) -> int:
        """The depth (blocks) the ranking credited ``replica`` with; 0 where it was not ranked."""
        score = self.ranking.of(replica) if self.ranking is not None else None
        return score.matched_blocks if score is not None else 0

    def new_tokens(self, replica: str) -> int:
        """The tokens it prefills if sent to ``replica`` and every predicted block lands."""
        score = self.ranking.of(replica) if self.ranking is not None else None
        return score.new_tokens if score is not None else self.num_prompt_tokens


def tie_key(ctx: RequestContext, deepest: int) -> bytes:
    """The key that orders tied workers: the chain's first block no worker holds (its last
    block when some worker holds it all), given the ``deepest`` match (blocks) of any worker.

    Requests that share their new content up to there break ties alike in every router, so a
    burst with one new prefix converges on one worker; requests that differ right after a
    prefix every worker holds (a common system prompt) spread, instead of all following the
    system prompt's hash to one worker.
    """
    if not ctx.chain:
        return ctx.tie_key
    return ctx.chain[min(deepest, len(ctx.chain) - 1)]


@dataclass(slots=True)  # one per replica per decision: not frozen, which costs 2.5x to make
class Candidate:
    """A replica Serve offers for one request, as the ranking sees it."""

    key: str  # the replica's unique id
    routing_stats: Mapping[str, Any] = field(default_factory=dict)  # its record_routing_stats
    queue_len: int | None = None  # Serve's cached count of its ongoing requests


@dataclass(frozen=True)
class Prediction:
    """A predicted entry to write to the index once Serve has sent a request."""

    chain: Chain
    worker_id: int
    from_block: int  # the blocks before it are confirmed there already


@dataclass(frozen=True)
class Outcome:
    """Where a request went, as the routing metrics count it."""

    matched_blocks: int  # credited prefix depth (blocks) on the replica it went to
    # Why it did not go to the replica with the deepest match: "cost" (the ranking put a
    # shallower, less loaded replica first), "serve" (Serve sent it past the first choice,
    # e.g. a full queue); None when it did (or nothing matched anywhere).
    spill: str | None
