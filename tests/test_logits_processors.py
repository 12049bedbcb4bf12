"""vLLM's penalties, logit_bias, allowed_token_ids, min_tokens and min_p against transformers'
logits processors (or hand-built logits where transformers has none), and their place in the
Sampler."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    SuppressTokensLogitsProcessor,
)

from prefixserve.router.sampling_params import SamplingParams
from prefixserve.workers.logits_processors import (
    TokenHistory,
    apply_min_p,
    needs_history,
    process_logits,
)
from prefixserve.workers.sampling import Sampler, make_generator

V = 40


def logits_rows(rows: int, seed: int = 0) -> torch.Tensor:
    return 3 * torch.randn(rows, V, generator=torch.Generator().manual_seed(seed))


def history(prompt: list[int], output: list[int], stops: tuple[int, ...] = ()) -> TokenHistory:
    return TokenHistory([*prompt, *output], len(prompt), stops)


PROMPTS = [[1, 2, 3, 3], [5], [7, 8, 9, 10, 11]]
OUTPUTS = [[3, 4, 4, 4], [], [12, 7, 12]]


def test_defaults_return_the_same_tensor() -> None:
    logits = logits_rows(3)
    params = [SamplingParams(), SamplingParams(temperature=0), SamplingParams(top_k=3)]
    assert process_logits(logits, params, None) is logits
    assert apply_min_p(logits, params) is logits
    assert not any(needs_history(p) for p in params)


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_matches_transformers_over_prompt_and_output(penalty: float) -> None:
    logits = logits_rows(3, 1)
    params = [SamplingParams(repetition_penalty=penalty)] * 3
    hists = [history(p, o) for p, o in zip(PROMPTS, OUTPUTS, strict=True)]
    got = process_logits(logits, params, hists)
    hf = RepetitionPenaltyLogitsProcessor(penalty)
    for row, (p, o) in enumerate(zip(PROMPTS, OUTPUTS, strict=True)):
        want = hf(torch.tensor([p + o]), logits[row : row + 1].clone())[0]
        assert torch.equal(got[row], want)
    assert torch.equal(logits, logits_rows(3, 1))  # the raw logits are left alone


def test_frequency_and_presence_count_output_tokens_only() -> None:
    logits = torch.zeros(2, 6)
    logits[0] = torch.tensor([1.0, -1.0, 2.0, 0.5, 0.0, 3.0])
    params = [
        SamplingParams(frequency_penalty=0.5, presence_penalty=1.5),
        SamplingParams(frequency_penalty=-1.0),
    ]
    # token 5 is in row 0's prompt only: neither penalty touches it
    hists = [history([5, 5, 0], [2, 2, 2, 3, 0]), history([1], [4])]
    got = process_logits(logits, params, hists)
    want = logits.clone()
    want[0, 2] -= 0.5 * 3 + 1.5
    want[0, 3] -= 0.5 * 1 + 1.5
    want[0, 0] -= 0.5 * 1 + 1.5
    want[1, 4] += 1.0
    assert torch.equal(got, want)


def test_repetition_then_frequency_as_vllm() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0]])
    p = SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0, presence_penalty=0.5)
    got = process_logits(logits, [p], [history([1], [0, 0])])
    assert got.tolist() == [[2.0 / 2 - 2 - 0.5, -2.0 * 2, 1.0]]


def test_min_tokens_matches_transformers() -> None:
    stops = (0, 3, 17)
    logits = logits_rows(1, 2)
    p = SamplingParams(min_tokens=3, max_tokens=10)
    hf = MinNewTokensLengthLogitsProcessor(2, 3, list(stops))
    for generated in range(5):
        output = list(range(20, 20 + generated))
        # a stop id past the vocabulary is skipped, not an index error
        got = process_logits(logits, [p], [history([8, 9], output, (*stops, V + 5))])
        want = hf(torch.tensor([[8, 9, *output]]), logits.clone())
        assert torch.equal(got, want)
        assert got[0, 3].item() == (float("-inf") if generated < 3 else logits[0, 3].item())


def test_logit_bias_matches_transformers_sequence_bias() -> None:
    logits = logits_rows(2, 3)
    bias = {4: 100.0, 9: -2.5, 30: 0.25}
    params = [SamplingParams(logit_bias=bias), SamplingParams()]
    got = process_logits(logits, params, None)
    hf = SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()])
    want = hf(torch.tensor([[1]]), logits[:1].clone())
    assert torch.allclose(got[:1], want)
    assert torch.equal(got[1], logits[1])
    assert got[0].argmax().item() == 4


def test_allowed_token_ids_leave_what_transformers_leaves_suppressing_the_rest() -> None:
    logits = logits_rows(3, 6)
    allowed = (3, 17, 39)
    params = [SamplingParams(allowed_token_ids=allowed), SamplingParams(),
              SamplingParams(allowed_token_ids=(5, 6), logit_bias={5: 100.0, 7: 100.0})]
    got = process_logits(logits, params, None)
    others = [t for t in range(V) if t not in allowed]
    want = SuppressTokensLogitsProcessor(others)(torch.tensor([[1]]), logits[:1].clone())
    assert torch.equal(got[0], want[0])
    assert torch.equal(got[1], logits[1])
    # the bias applies after: a biased token outside the set stays out
    assert int(torch.isfinite(got[2]).sum()) == 2 and int(got[2].argmax()) == 5
    assert got[2, 6] == logits[2, 6]
    row = logits[0].clone()
    row[0], row[list(allowed)] = 10.0, torch.tensor([0.0, 0.3, 0.6])
    seeded = [SamplingParams(allowed_token_ids=allowed, logprobs=1, seed=s) for s in range(16)]
    ids, lps = Sampler().sample(row.expand(16, V), seeded, [make_generator(p) for p in seeded])
    assert set(ids) <= set(allowed) and len(set(ids)) > 1  # draws within the set
    assert lps[0].top[0][0] == 0  # logprobs stay raw


def test_a_row_left_nothing_to_draw_takes_its_unmasked_logits_back() -> None:
    raw = logits_rows(3, 7)
    raw[0, 1:] = float("-inf")  # a grammar that allows only token 0 (EOS, say) on rows 0, 1
    raw[1, 1:] = float("-inf")
    params = [SamplingParams(min_tokens=2, logit_bias={0: 1.5}),
              SamplingParams(allowed_token_ids=(4, 5)), SamplingParams(allowed_token_ids=(4,))]
    got = process_logits(raw, params, [history([1], [], (0,)), None, None])
    assert got[0, 0] == raw[0, 0] + 1.5 and torch.equal(got[1], raw[1])  # bias still applies
    assert int(torch.isfinite(got[2]).sum()) == 1 and got[2, 4] == raw[2, 4]  # masked as asked


@pytest.mark.parametrize("min_p", [0.05, 0.2, 0.9, 1.0])
def test_min_p_matches_transformers(min_p: float) -> None:
    logits = logits_rows(3, 4)
    params = [SamplingParams(min_p=min_p), SamplingParams(), SamplingParams(min_p=min_p)]
    got = apply_min_p(logits, params)
    want = MinPLogitsWarper(min_p)(torch.tensor([[1]]), logits.clone())
    assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])
    assert torch.equal(got[1], logits[1])


def test_sampler_greedy_sees_bias_and_penalties_but_logprobs_stay_raw() -> None:
    logits = logits_rows(2, 5)
    top = int(logits[0].argmax())
    params = [
        SamplingParams(temperature=0, logit_bias={top: -100.0}, logprobs=1),
        SamplingParams(temperature=0, repetition_penalty=1e6),
    ]
    best1 = int(logits[1].argmax())
    assert logits[1, best1] > 0  # a huge repetition penalty divides it to ~0
    ids, lps = Sampler().sample(logits, params, None, [None, history([best1], [])])
    assert ids[0] != top and ids[1] != best1
    assert lps[0].top[0][0] == top  # raw distribution, as vLLM reports by default
    assert lps[0].logprob == pytest.approx(logits[0].log_softmax(-1)[ids[0]].item())


@pytest.mark.parametrize(("temperature", "support"), [(1.0, {0, 1}), (10.0, {0, 1, 2, 3})])
def test_sampler_min_p_applies_after_temperature(temperature: float, support: set[int]) -> None:
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    p = SamplingParams(seed=0, min_p=0.5, temperature=temperature)
    gen = make_generator(p)
    sampler = Sampler()
    # at T=1, 0.15 < 0.5 * 0.5 is dropped; at T=10 every token clears half of the best one
    assert {sampler.sample(logits[None], [p], [gen])[0][0] for _ in range(300)} == support


def test_a_penalized_row_without_history_is_an_error() -> None:
    with pytest.raises(ValueError, match="TokenHistory"):
        process_logits(logits_rows(1), [SamplingParams(presence_penalty=1.0)], None)


def test_prompt_ids_are_converted_once() -> None:
    h = history([3, 1, 3, 2], [5])
    first = h.prompt_ids(torch.device("cpu"))
    assert first.tolist() == [1, 2, 3]
    h.token_ids.append(6)
    assert h.prompt_ids(torch.device("cpu")) is first
    assert h.output == [5, 6] and h.num_output_tokens == 2
