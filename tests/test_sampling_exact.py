"""Sampling, exactly: validation messages and bounds, truncation masks, draws on set logits."""

from __future__ import annotations

import math

import pytest
import torch

from prefixserve.router.sampling_params import (
    GREEDY_TEMPERATURE,
    MAX_LOGPROBS,
    MAX_N,
    MAX_SEED,
    MAX_STRUCTURED_CHARS,
    STRUCTURED_KINDS,
    SamplingParams,
    StructuredOutput,
)
from prefixserve.workers.errors import InvalidRequestError
from prefixserve.workers.logits_processors import TokenHistory
from prefixserve.workers.sampling import Sampler, _truncate, make_generator

INF = float("inf")


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("max_tokens", 0, "max_tokens must be an integer >= 1, got 0"),
        ("temperature", -1, "temperature must be a finite number >= 0, got -1"),
        ("top_p", 0, "top_p must be in (0, 1], got 0"),
        ("top_k", -1, "top_k must be an integer >= 0 (0 disables it), got -1"),
        ("seed", -1, f"seed must be None or an integer in [0, {MAX_SEED}], got -1"),
        ("n", 0, f"n must be an integer in [1, {MAX_N}], got 0"),
        ("logprobs", 21, f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got 21"),
        ("stop_token_ids", (-1,), "stop_token_ids must be non-negative integers, got (-1,)"),
        ("repetition_penalty", 0,
         "repetition_penalty must be a finite number > 0 (1 disables it), got 0"),
        ("frequency_penalty", 3, "frequency_penalty must be in [-2.0, 2.0], got 3"),
        ("presence_penalty", -3, "presence_penalty must be in [-2.0, 2.0], got -3"),
        ("min_p", 2, "min_p must be in [0, 1], got 2"),
        ("min_tokens", -1, "min_tokens must be an integer in [0, max_tokens], got -1"),
        ("logit_bias", {1: 101.0},
         "logit_bias must map token ids to biases in [-100.0, 100.0], got {1: 101.0}"),
        ("structured", StructuredOutput("yaml", "x"),
         "structured must be a StructuredOutput of a kind in ('json', 'regex', 'choice', "
         "'grammar', 'structural_tag') with at most 65536 characters, got "
         "StructuredOutput(kind='yaml', spec='x', field='structured_outputs')"),
    ],
)
def test_validate_message_names_field_rule_and_value(field: str, value: object, message: str):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**{field: value}).validate()
    assert str(info.value) == message


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", True),
        ("temperature", True),
        ("temperature", "1"),
        ("top_p", True),
        ("top_p", "0.5"),
        ("top_p", 1.0000001),
        ("top_k", True),
        ("seed", True),
        ("seed", MAX_SEED + 1),
        ("n", True),
        ("n", MAX_N + 1),
        ("logprobs", True),
        ("stop_token_ids", (True,)),
        ("repetition_penalty", -1.0),
        ("repetition_penalty", math.inf),
        ("repetition_penalty", True),
        ("repetition_penalty", "1"),
        ("frequency_penalty", 2.5),
        ("frequency_penalty", True),
        ("presence_penalty", -2.5),
        ("presence_penalty", math.nan),
        ("min_p", 1.5),
        ("min_p", True),
        ("min_p", "0.1"),
        ("min_tokens", 17),  # more than max_tokens (16)
        ("min_tokens", 1.0),
        ("logit_bias", {1: 100.5}),
        ("logit_bias", {1: -100.5}),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {True: 1.0}),
        ("logit_bias", {"1": 1.0}),
        ("logit_bias", {1: True}),
        ("logit_bias", [(1, 1.0)]),
        ("structured", {"kind": "json", "spec": ""}),
        ("structured", StructuredOutput("yaml", "")),
        ("structured", StructuredOutput("json", b"{}")),
        ("structured", StructuredOutput("regex", "a" * (MAX_STRUCTURED_CHARS + 1))),
    ],
)
def test_validate_rejects_bools_strings_and_just_out_of_range(field: str, value: object):
    with pytest.raises(InvalidRequestError, match=f"^{field} "):
        SamplingParams(**{field: value}).validate()


@pytest.mark.parametrize(
    "fields",
    [
        {"max_tokens": 1},
        {"temperature": 0},
        {"temperature": 0.0, "top_p": 1, "top_k": 0},
        {"seed": 0},
        {"seed": MAX_SEED},
        {"n": 1},
        {"n": MAX_N},
        {"logprobs": 0},
        {"logprobs": MAX_LOGPROBS},
        {"stop_token_ids": (0,)},
        {"stop_token_ids": [0, 5]},
        {"repetition_penalty": 0.5},
        {"repetition_penalty": 1e9},
        {"frequency_penalty": 2.0, "presence_penalty": -2.0},
        {"frequency_penalty": -2, "presence_penalty": 2},
        {"min_p": 0},
        {"min_p": 1.0},
        {"min_tokens": 0},
        {"min_tokens": 16, "max_tokens": 16},
        {"logit_bias": {}},
        {"logit_bias": {0: 100.0, 7: -100, 9: 0.5}},
        {"structured": None},
        {"structured": StructuredOutput("grammar", "a" * MAX_STRUCTURED_CHARS)},
        *({"structured": StructuredOutput(kind, "")} for kind in STRUCTURED_KINDS),
    ],
)
def test_validate_accepts_the_bounds(fields: dict[str, object]):
    SamplingParams(**fields).validate()


def test_greedy_threshold():
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=GREEDY_TEMPERATURE / 2).greedy
    assert not SamplingParams(temperature=GREEDY_TEMPERATURE).greedy


def test_make_generator_seeds_with_seed_plus_index():
    assert make_generator(SamplingParams()) is None
    params = SamplingParams(seed=100)
    assert make_generator(params).initial_seed() == 100
    assert make_generator(params, 3).initial_seed() == 103
    assert make_generator(params, 3, "cpu").device == torch.device("cpu")
    gen = make_generator(params, 2)
    expected = torch.empty(5).exponential_(generator=torch.Generator().manual_seed(102))
    assert torch.equal(torch.empty(5).exponential_(generator=gen), expected)


# --- _truncate: the exact masks ---------------------------------------------------------------


def masked(logits: list[float], **fields: object) -> list[float]:
    return _truncate(torch.tensor([logits]), [SamplingParams(**fields)])[0].tolist()


def test_top_k_mask_keeps_positions():
    assert masked([1.0, 3.0, 2.0, 0.0], top_k=2) == [-INF, 3.0, 2.0, -INF]
    assert masked([1.0, 3.0, 2.0, 0.0], top_k=1) == [-INF, 3.0, -INF, -INF]
    # ties with the k-th logit stay
    assert masked([2.0, 2.0, 0.0], top_k=1) == [2.0, 2.0, -INF]
    # k >= vocab or 0: off
    assert masked([1.0, 3.0, 2.0], top_k=3) == [1.0, 3.0, 2.0]
    assert masked([1.0, 3.0, 2.0], top_k=9) == [1.0, 3.0, 2.0]
    assert masked([1.0, 3.0, 2.0], top_k=0) == [1.0, 3.0, 2.0]


def test_top_k_mask_holds_when_kept_mass_rounds_below_one():
    # float32: the kept tokens' softmax sums to 0.99999994, below top_p = 1
    assert masked([2.0, 0.0, 0.0, -5.0, -5.0], top_k=3) == [2.0, 0.0, 0.0, -INF, -INF]


def test_top_p_mask_keeps_the_smallest_covering_prefix():
    logits = torch.tensor([0.15, 0.5, 0.05, 0.3]).log().tolist()
    assert masked(logits, top_p=0.6) == [-INF, logits[1], -INF, logits[3]]
    assert masked(logits, top_p=0.45) == [-INF, logits[1], -INF, -INF]
    assert masked(logits, top_p=1e-9) == [-INF, logits[1], -INF, -INF]  # the best always stays
    assert masked(logits, top_p=0.9) == [logits[0], logits[1], -INF, logits[3]]


def test_top_p_applies_to_the_top_k_renormalised_mass():
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log().tolist()
    # within the top 2 the mass is 4/7, 3/7: top_p 0.5 keeps only the first
    assert masked(logits, top_k=2, top_p=0.5) == [logits[0], -INF, -INF, -INF]
    assert masked(logits, top_k=3, top_p=0.6) == [logits[0], logits[1], -INF, -INF]


def test_truncate_is_per_row():
    logits = torch.tensor([[1.0, 3.0, 2.0], [1.0, 3.0, 2.0], [1.0, 3.0, 2.0]])
    params = [SamplingParams(top_k=1), SamplingParams(), SamplingParams(top_k=2)]
    assert _truncate(logits, params).tolist() == [
        [-INF, 3.0, -INF],
        [1.0, 3.0, 2.0],
        [-INF, 3.0, 2.0],
    ]


# --- draws ------------------------------------------------------------------------------------


def test_top_k_one_alone_is_argmax_at_any_temperature():
    logits = torch.tensor([[0.0, 0.2, 0.1, 0.15]])
    params = SamplingParams(top_k=1, temperature=50.0, seed=3)
    gen = make_generator(params)
    sampler = Sampler()
    assert {sampler.sample(logits, [params], [gen])[0][0] for _ in range(50)} == {1}


def test_unseeded_rows_draw_fresh_noise():
    torch.manual_seed(0)
    sampler = Sampler()
    flat = torch.zeros(1, 4)
    seen = {sampler.sample(flat, [SamplingParams()])[0][0] for _ in range(100)}
    assert seen == {0, 1, 2, 3}
    # identical unseeded rows in one batch get independent noise
    ids, _ = sampler.sample(torch.zeros(12, 4), [SamplingParams()] * 12)
    assert len(set(ids)) > 1
    # and so does an unseeded row next to a seeded one
    params = [SamplingParams(seed=5), SamplingParams()]
    gen = make_generator(params[0])
    seen = {sampler.sample(torch.zeros(2, 4), params, [gen, None])[0][1] for _ in range(100)}
    assert seen == {0, 1, 2, 3}


def test_unseeded_draws_follow_the_distribution():
    torch.manual_seed(1)
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log().expand(2, 3).contiguous()
    params = [SamplingParams(seed=9), SamplingParams()]  # the unseeded row next to a seeded one
    gens = [make_generator(params[0]), None]
    sampler = Sampler()
    alone = [sampler.sample(logits[:1], [SamplingParams()])[0][0] for _ in range(3000)]
    beside = [sampler.sample(logits, params, gens)[0][1] for _ in range(500)]
    for seen, tolerance in ((alone, 0.03), (beside, 0.06)):
        freq = torch.bincount(torch.tensor(seen), minlength=3).float() / len(seen)
        assert torch.allclose(freq, probs, atol=tolerance), freq


def test_sampled_rows_land_in_their_batch_positions():
    logits = torch.tensor([
        [5.0, 0.0, 0.0, 0.0],
        [0.0, 0.0, 9.0, 0.0],
        [0.0, 5.0, 0.0, 0.0],
        [0.0, 0.0, 0.0, 9.0],
    ])
    params = [
        SamplingParams(temperature=0),
        SamplingParams(top_k=1, seed=1),
        SamplingParams(temperature=0),
        SamplingParams(top_k=1),
    ]
    ids, lps = Sampler().sample(logits, params, [None, make_generator(params[1]), None, None])
    assert ids == [0, 2, 1, 3]
    assert lps == [None] * 4


def test_logprobs_per_row_counts_and_values():
    logits = torch.tensor([
        [2.0, 1.0, 0.0, -1.0],
        [0.0, 3.0, 1.0, 2.0],
        [1.0, 2.0, 4.0, 0.0],
    ])
    params = [
        SamplingParams(temperature=0, logprobs=1),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, logprobs=3),
    ]
    ids, lps = Sampler().sample(logits, params)
    ref = logits.log_softmax(-1)
    assert ids == [0, 1, 2]
    assert lps[1] is None
    first, third = lps[0], lps[2]
    assert first is not None and third is not None
    assert first.token_id == 0 and math.isclose(first.logprob, ref[0, 0].item(), rel_tol=1e-6)
    assert [t for t, _ in first.top] == [0]
    assert third.token_id == 2 and [t for t, _ in third.top] == [2, 1, 0]
    assert [v for _, v in third.top] == pytest.approx([ref[2, t].item() for t in (2, 1, 0)])
    assert math.isclose(third.logprob, ref[2, 2].item(), rel_tol=1e-6)


def test_logprob_of_a_sampled_token_is_the_raw_one():
    logits = torch.tensor([[0.0, 0.0, 3.0, 0.0]])
    params = SamplingParams(top_k=1, temperature=7.0, logprobs=2, seed=0)
    ids, lps = Sampler().sample(logits, [params], [make_generator(params)])
    ref = logits.log_softmax(-1)[0]
    assert ids == [2]
    assert lps[0] is not None and lps[0].token_id == 2
    assert math.isclose(lps[0].logprob, ref[2].item(), rel_tol=1e-6)
    assert lps[0].top[0][0] == 2 and len(lps[0].top) == 2


def test_sampling_keeps_to_the_logits_device_whatever_the_default():
    """Every tensor the sampler makes lives on the logits' device, not torch's default one."""
    logits = torch.tensor([[0.0, 4.0, 1.0], [3.0, 0.0, 1.0], [0.0, 1.0, 5.0], [9.0, 0.0, 0.0]])
    params = [
        SamplingParams(temperature=0, logprobs=2),
        SamplingParams(top_k=1, seed=4),
        SamplingParams(top_k=2, top_p=0.5, temperature=0.5),
        SamplingParams(top_k=1, logprobs=1),
    ]
    sampler = Sampler()
    probs = torch.tensor([[0.6, 0.3, 0.1]])
    # a CPU tensor mixed with a meta one raises, or silently reads zeros or garbage
    with torch.device("meta"):
        gens = [None, make_generator(params[1]), None, None]
        ids, lps = sampler.sample(logits, params, gens)
        mask = _truncate(torch.tensor([[1.0, 3.0, 2.0, 0.5]], device="cpu"),
                         [SamplingParams(top_k=2)])
        torch.manual_seed(2)
        seen = [sampler.sample(probs.log(), [SamplingParams()])[0][0] for _ in range(2000)]
    assert ids == [1, 0, 2, 0]
    assert lps[0] is not None and [t for t, _ in lps[0].top] == [1, 2]
    assert lps[3] is not None and lps[3].top == [(0, pytest.approx(lps[3].logprob))]
    assert mask.tolist() == [[-INF, 3.0, 2.0, -INF]]
    freq = torch.bincount(torch.tensor(seen), minlength=3).float() / len(seen)
    assert torch.allclose(freq, probs[0], atol=0.035), freq


def test_penalties_read_the_rows_history():
    logits = torch.tensor([[2.0, 1.9, 0.0], [2.0, 1.9, 0.0]])
    params = [SamplingParams(temperature=0, presence_penalty=0.5), SamplingParams(temperature=0)]
    history = TokenHistory([5, 0], 1, ())  # prompt [5], output [0]
    ids, _ = Sampler().sample(logits, params, histories=[history, None])
    assert ids == [1, 0]  # 2.0 - 0.5 < 1.9 in the penalised row only


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_sampling_on_cuda_matches_cpu_decisions():
    logits = torch.tensor([[0.0, 4.0, 1.0], [3.0, 0.0, 1.0], [0.0, 1.0, 5.0]])
    params = [
        SamplingParams(temperature=0, logprobs=2),
        SamplingParams(top_k=1, seed=4),
        SamplingParams(top_k=2, top_p=0.5),
    ]
    gens = [None, make_generator(params[1], 0, "cuda"), None]
    ids, lps = Sampler().sample(logits.cuda(), params, gens)
    assert ids == [1, 0, 2]
    assert lps[0] is not None and lps[0].top[0][0] == 1
