"""What the engine accepts: a request is checked whole before anything is queued, so a bad one
raises InvalidRequestError and changes nothing (a bad token id in a batch would fail the step of
every request in it)."""

from __future__ import annotations

import operator
from collections.abc import Iterable

from prefixserve.router.sampling_params import SamplingParams
from prefixserve.workers.errors import InvalidRequestError


def checked_request(
    prompt_token_ids: Iterable[int],
    sampling_params: SamplingParams,
    cache_salt: str | None,
    tenant: str | None,
    max_model_len: int,
    vocab_size: int,
) -> list[int]:
    """The prompt as a list of ints, once every part of the request is valid."""
    if not isinstance(sampling_params, SamplingParams):
        raise InvalidRequestError("sampling_params must be a SamplingParams")
    sampling_params.validate()
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise InvalidRequestError("cache_salt must be a string or None")
    if tenant is not None and not isinstance(tenant, str):
        raise InvalidRequestError("tenant must be a string or None")
    try:
        prompt = [operator.index(t) for t in prompt_token_ids]
    except TypeError:
        raise InvalidRequestError("prompt token ids must be integers") from None
    if not prompt:
        raise InvalidRequestError("prompt is empty")
    # max_model_len never exceeds the KV pool (fit_max_model_len), so this check also
    # refuses every prompt the pool could not hold
    if len(prompt) >= max_model_len:
        raise InvalidRequestError(
            f"prompt has {len(prompt)} tokens; this worker's context (max_model_len, at "
            f"most what its KV cache holds) is {max_model_len} tokens, including at "
            "least 1 to generate"
        )
    if min(prompt) < 0 or max(prompt) >= vocab_size:
        bad = next(t for t in prompt if not 0 <= t < vocab_size)
        raise InvalidRequestError(
            f"token id {bad} is outside the vocabulary [0, {vocab_size})"
        )
    for field, ids in (("logit_bias", sampling_params.logit_bias or ()),
                       ("allowed_token_ids", sampling_params.allowed_token_ids or ())):
        outside = [t for t in ids if t >= vocab_size]
        if outside:  # an out-of-range index would fail the whole batch's step
            raise InvalidRequestError(
                f"{field} token id {outside[0]} is outside the vocabulary [0, {vocab_size})",
                field)
    return prompt


def stop_ids(sampling_params: SamplingParams, eos_token_ids: Iterable[int]) -> frozenset[int]:
    """The tokens that end a request's output: its stop_token_ids, and EOS unless ignore_eos.
    Refuses allowed_token_ids that are all such tokens while min_tokens holds them back (no
    token could be drawn)."""
    stop = set(sampling_params.stop_token_ids)
    if not sampling_params.ignore_eos:
        stop.update(eos_token_ids)
    allowed = sampling_params.allowed_token_ids
    if allowed and sampling_params.min_tokens and stop.issuperset(allowed):
        raise InvalidRequestError("allowed_token_ids: every allowed token ends the output, and "
                                  "min_tokens holds them back", "allowed_token_ids")
    return frozenset(stop)
