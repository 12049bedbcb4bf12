"""Sampling: parameter validation, greedy, seeds, top-k / top-p support sets, logprobs."""

import math

import pytest
import torch

from prefixserve.router.sampling_params import SamplingParams
from prefixserve.workers.errors import InvalidRequestError
from prefixserve.workers.kernels.build import cpu_kernels
from prefixserve.workers.sampling import Sampler, first_largest, make_generator

V = 50


def logits_rows(rows: int, seed: int = 0) -> torch.Tensor:
    return 3 * torch.randn(rows, V, generator=torch.Generator().manual_seed(seed))


def draws(logits: torch.Tensor, params: SamplingParams, n: int) -> list[int]:
    """n single-row draws sharing one seeded generator."""
    gen = make_generator(params)
    sampler = Sampler()
    return [sampler.sample(logits[None], [params], [gen])[0][0] for _ in range(n)]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 0),
        ("max_tokens", 1.5),
        ("temperature", -0.1),
        ("temperature", math.inf),
        ("temperature", math.nan),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -1),
        ("n", 0),
        ("n", 17),
        ("logprobs", -1),
        ("logprobs", 21),
        ("seed", "7"),
        ("stop_token_ids", (3, -1)),
        ("stop_token_ids", 3),
        ("repetition_penalty", 0),
        ("repetition_penalty", -1.0),
        ("repetition_penalty", math.inf),
        ("frequency_penalty", 2.5),
        ("presence_penalty", -2.01),
        ("presence_penalty", math.nan),
        ("min_p", 1.5),
        ("min_p", -0.1),
        ("min_tokens", -1),
        ("min_tokens", 17),  # above max_tokens (16)
        ("min_tokens", 1.0),
        ("logit_bias", {3: 101.0}),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {"3": 1.0}),
        ("logit_bias", [(3, 1.0)]),
        ("allowed_token_ids", ()),
        ("allowed_token_ids", [3, -1]),
        ("allowed_token_ids", (3, 1.0)),
        ("allowed_token_ids", (True,)),
        ("allowed_token_ids", {3}),
        ("allowed_token_ids", tuple(range(1025))),
    ],
)
def test_validate_names_the_bad_field(field, value):
    params = SamplingParams(**{field: value})
    with pytest.raises(InvalidRequestError, match=field):
        params.validate()


def test_validate_accepts_sane_params_and_lists():
    params = SamplingParams(
        temperature=0, top_p=0.5, top_k=5, n=4, logprobs=20, seed=0, stop_token_ids=[1, 2]
    )
    params.validate()
    assert params.stop_token_ids == (1, 2)
    SamplingParams(
        repetition_penalty=1.2, frequency_penalty=-2, presence_penalty=2.0, min_p=1,
        min_tokens=16, logit_bias={0: -100, 5: 100.0},
    ).validate()
    with pytest.raises(InvalidRequestError, match=r"^allowed_token_ids must be None or 1 to "
                       r"1024 non-negative token ids, got \(\)$"):
        SamplingParams(allowed_token_ids=()).validate()
    allowed = SamplingParams(allowed_token_ids=[0, 7])
    allowed.validate()
    assert allowed.allowed_token_ids == (0, 7)
    SamplingParams(allowed_token_ids=tuple(range(1024))).validate()
    SamplingParams(allowed_token_ids=(5,)).validate()


def test_greedy_is_argmax_across_a_batch():
    logits = logits_rows(8)
    ids, lps = Sampler().sample(logits, [SamplingParams(temperature=0)] * 8)
    assert ids == logits.argmax(-1).tolist()
    assert lps == [None] * 8


def test_seed_reproducible_and_independent_of_batch():
    logits = logits_rows(1)[0] / 3
    p = SamplingParams(seed=123)
    first, again = draws(logits, p, 30), draws(logits, p, 30)
    assert first == again
    assert len(set(first)) > 3  # really sampling, not greedy
    assert draws(logits, SamplingParams(seed=124), 30) != first
    # Sample index 1 of the same request gets a different stream.
    other = make_generator(p, index=1)
    sampler = Sampler()
    assert [sampler.sample(logits[None], [p], [other])[0][0] for _ in range(30)] != first
    # The same seeded row inside a batch with unseeded neighbours draws the same tokens.
    gen, batch = make_generator(p), torch.stack([logits_rows(1, 9)[0], logits, logits])
    params = [SamplingParams(), p, SamplingParams(temperature=0)]
    got = [sampler.sample(batch, params, [None, gen, None])[0][1] for _ in range(30)]
    assert got == first


def test_draws_follow_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    seen = draws(probs.log(), SamplingParams(seed=0), 4000)
    freq = torch.bincount(torch.tensor(seen), minlength=3).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03)


def test_temperature_sharpens():
    logits = torch.tensor([1.0, 0.0, 0.0, 0.0])
    cold = draws(logits, SamplingParams(seed=1, temperature=0.1), 300)
    hot = draws(logits, SamplingParams(seed=1, temperature=5.0), 300)
    assert cold.count(0) == 300
    assert hot.count(0) < 200


def test_top_k_support_set():
    logits = logits_rows(1, 3)[0]
    seen = set(draws(logits, SamplingParams(seed=0, top_k=3, temperature=3.0), 200))
    assert seen == set(logits.topk(3).indices.tolist())


@pytest.mark.parametrize(("top_p", "support"), [(0.7, {0, 1}), (0.8, {0, 1}), (0.81, {0, 1, 2})])
def test_top_p_support_set(top_p, support):
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    assert set(draws(logits, SamplingParams(seed=0, top_p=top_p), 200)) == support


def test_top_k_and_top_p_combine_per_row():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]]).log()
    params = [SamplingParams(seed=0, top_k=1), SamplingParams(seed=1, top_p=0.95)]
    gens = [make_generator(p) for p in params]
    sampler = Sampler()
    seen = [set(), set()]
    for _ in range(100):
        ids, _ = sampler.sample(logits, params, gens)
        seen[0].add(ids[0])
        seen[1].add(ids[1])
    assert seen == [{0}, {0, 1, 2}]


def test_logprobs_are_raw_log_softmax():
    logits = logits_rows(3, 5)
    params = [
        SamplingParams(temperature=0, logprobs=5),
        SamplingParams(),
        SamplingParams(seed=2, temperature=0.7, logprobs=0),
    ]
    ids, lps = Sampler().sample(logits, params, [None, None, make_generator(params[2])])
    ref = logits.log_softmax(-1)
    assert lps[1] is None
    top = lps[0]
    assert top.token_id == ids[0] and math.isclose(top.logprob, ref[0, ids[0]].item(), rel_tol=1e-6)
    want = ref[0].topk(5)
    assert [t for t, _ in top.top] == want.indices.tolist()
    assert torch.allclose(torch.tensor([v for _, v in top.top]), want.values)
    assert lps[2].top == []
    assert math.isclose(lps[2].logprob, ref[2, ids[2]].item(), rel_tol=1e-6)


def largest_cases() -> list[torch.Tensor]:
    """Rows the first-largest pick must agree with torch's max on: whole vectors, ragged tails,
    the real vocabulary, ties, infinities, NaNs."""
    gen = torch.Generator().manual_seed(3)
    cases = [torch.randn(rows, n, generator=gen) for rows, n in
             [(1, 1), (3, 15), (3, 16), (3, 17), (2, 100), (32, 49152), (0, 10)]]
    tied = torch.zeros(4, 70)
    tied[0, [7, 40]] = 5.0  # twice, in two vectors: the first
    tied[1, [20, 69]] = 5.0  # the second in the ragged tail
    tied[2, [33, 34]] = 5.0  # side by side in one vector
    tied[3] = -math.inf  # a row that is all -inf: index 0, as torch gives
    odd = torch.randn(4, 37, generator=gen)
    odd[0, [5, 9]] = math.nan  # the first NaN, as torch's max propagates it
    odd[1, 36] = math.nan  # a NaN in the ragged tail
    odd[2, [3, 30]] = math.inf
    odd[3, 12] = -math.nan
    wide = torch.randn(3, 80, generator=gen)[:, :50]  # rows strided past their values
    return [*cases, tied, odd, wide]


@pytest.mark.parametrize("case", range(len(largest_cases())))
def test_first_largest_picks_what_torch_max_picks(case):
    logits = largest_cases()[case]
    got = first_largest(logits)
    assert got.dtype == torch.int64
    assert torch.equal(got, logits.max(dim=-1).indices)


def check_argmax(kernels) -> None:
    """`argmax_rows` on every case gives torch's max's indices (also run on the kernels built for
    narrower vectors, tests/test_attention_kernel.py)."""
    for logits in largest_cases():
        assert torch.equal(kernels.argmax_rows(logits), logits.max(dim=-1).indices)


def test_the_kernels_pick_the_first_of_tied_largest():
    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("no C++ toolchain to build the kernels")
    check_argmax(kernels)
    tied = largest_cases()[7]
    assert kernels.argmax_rows(tied).tolist() == [7, 20, 33, 0]
    odd = largest_cases()[8]
    assert kernels.argmax_rows(odd).tolist()[:3] == [5, 36, 3]
    for bad in (torch.zeros(2, 3, dtype=torch.bfloat16), torch.zeros(2, 0), torch.zeros(6),
                torch.zeros(3, 4).t()):
        with pytest.raises(RuntimeError, match="argmax_rows: x must be float32"):
            kernels.argmax_rows(bad)


def test_greedy_rows_take_the_first_of_tied_logits():
    logits = torch.zeros(2, 40)
    logits[:, [11, 30]] = 2.0
    ids, _ = Sampler().sample(logits, [SamplingParams(temperature=0)] * 2)
    assert ids == [11, 11]
