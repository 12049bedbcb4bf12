"""Small hardening checks: masked Redis URLs, tiny temperatures, seed bounds."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from prefixserve.cluster import protocol
from prefixserve.router import sampling_params as params_mod
from prefixserve.router.redis_connection import safe_url
from prefixserve.router.sampling_params import SamplingParams
from prefixserve.workers import sampling
from prefixserve.workers.errors import InvalidRequestError
from prefixserve.workers.sampling import Sampler


@pytest.mark.parametrize(
    ("url", "masked"),
    [
        ("redis://h:6379/0?password=s3cret", "redis://h:6379/0?password=***"),
        ("redis://h/0?db=1&password=s3cret&ssl=1", "redis://h/0?db=1&password=***&ssl=1"),
        ("rediss://u:pw@h:6380/0?Password=s3cret", "rediss://u:***@h:6380/0?Password=***"),
        ("redis://u:pw@h:6380/0", "redis://u:***@h:6380/0"),
        ("redis://h:6379/0?db=1", "redis://h:6379/0?db=1"),
    ],
)
def test_safe_url_masks_the_password_wherever_it_is(url: str, masked: str) -> None:
    assert safe_url(url) == masked
    assert "s3cret" not in safe_url(url)


@pytest.mark.parametrize("temperature", [1e-300, 1e-45, 1e-9, 5e-7])
def test_a_tiny_temperature_is_greedy_not_nan(temperature: float) -> None:
    logits = 30 * torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=temperature, seed=i, logprobs=1) for i in range(4)]
    gens = [sampling.make_generator(p) for p in params]
    ids, lps = Sampler().sample(logits, params, gens)
    assert ids == logits.argmax(dim=-1).tolist()
    assert all(lp is not None and lp.logprob == lp.logprob for lp in lps)  # not NaN


@pytest.mark.parametrize("seed", [-1, params_mod.MAX_SEED + 1, 2**64])
def test_engine_rejects_a_seed_out_of_range(seed: int) -> None:
    with pytest.raises(InvalidRequestError, match="seed"):
        SamplingParams(seed=seed).validate()


def test_seed_bounds_agree_with_the_api() -> None:
    assert protocol.MAX_SEED == params_mod.MAX_SEED
    SamplingParams(seed=params_mod.MAX_SEED, n=params_mod.MAX_N).validate()
    assert sampling.make_generator(SamplingParams(seed=params_mod.MAX_SEED), params_mod.MAX_N - 1)
    with pytest.raises(ValidationError, match="less than or equal to"):
        protocol.CompletionRequest.model_validate({"prompt": "x", "seed": params_mod.MAX_SEED + 1})
