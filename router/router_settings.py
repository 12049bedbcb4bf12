"""The router section of the cluster config (:class:`RouterSettings`)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from prefixserve.router.blocks import DEFAULT_BLOCK_SIZE
from prefixserve.router.policy import PolicyConfig

_INTERNAL = {"internal": True}  # set by the app from other sections, not by users


class RouterSettings(BaseModel):
    """The router section of the cluster config, passed whole as the request router's kwargs
    (``PrefixAwareRequestRouter.initialize_state``); the internal fields the app fills in."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    lookup_deadline_s: float = Field(
        0.02, gt=0.0, description="Index lookup deadline; past it routing uses load only")
    failopen_backoff_s: float = Field(
        1.0, ge=0.0, description="After a failed index lookup, route by load only this long")
    load_max_age_s: float = Field(
        10.0, gt=0.0, description="A worker's reported load older than this is not used")
    check_interval_s: float = Field(
        30.0, gt=0.0, description="How often a router re-checks the workers' block size and "
        "model fingerprint")
    target_wait_s: float = Field(
        10.0, gt=0.0, description="How long a call for one named worker waits for that replica "
        "to appear, under every policy")
    max_match_tokens: int = Field(
        131072, ge=1, description="Routing matches at most this many leading prompt tokens "
        "(past it every worker counts as uncached)")
    hash_memo_tokens: int = Field(
        33_554_432, ge=0, description="Prompt tokens whose block digests a router remembers (two "
        "generations of this many, ~1.4 bytes a token), so a prompt that starts like a recent one "
        "(a chat's next turn, a shared system prompt) hashes only what is new; 0 turns it off")
    weights: PolicyConfig = Field(
        default_factory=PolicyConfig, description="The routing cost model (router.policy)")
    model: str = Field("", description="Served model name: the index keyspace",
                       json_schema_extra=_INTERNAL)
    block_size: int = Field(DEFAULT_BLOCK_SIZE, ge=1, description="The workers' block size",
                            json_schema_extra=_INTERNAL)
    fingerprint: str | None = Field(
        None, description="Model fingerprint; None adopts the registered workers'",
        json_schema_extra=_INTERNAL)
    prefix_routing: bool = Field(
        True, description="False ranks by load only (the no-index baseline)",
        json_schema_extra=_INTERNAL)

    @model_validator(mode="before")
    @classmethod
    def _weights_count_our_blocks(cls, data: Any) -> Any:
        """The cost model counts blocks of the workers' size: one block size for both."""
        if not isinstance(data, dict) or "block_size" not in data:
            return data
        weights = data.get("weights") or {}
        if isinstance(weights, PolicyConfig):
            weights = asdict(weights)
        return {**data, "weights": {**weights, "block_size": data["block_size"]}}
