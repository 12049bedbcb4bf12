"""Sampling parameters and the batched sampler.

Order of operations (as in vLLM v1): min_tokens, logit_bias and the penalties on the raw logits
(workers/logits_processors.py; greedy takes their argmax), then temperature, min_p, top-k,
top-p, and a draw.
Reported logprobs are those of the raw model distribution (log_softmax of the unmodified
logits), as vLLM reports them by default, so they do not depend on temperature or truncation.
A request with a `seed` draws from its own `torch.Generator` (see `make_generator`), so its
tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from router.request import TokenLogprob
from workers.errors import InvalidRequestError
from workers.logits_processors import TokenHistory, apply_min_p, process_logits

MAX_N = 16
MAX_LOGPROBS = 20
MAX_SEED = 2**63 - 1  # cluster/protocol.py accepts the same range; seed + index stays a uint64
# Below this a temperature is greedy (vLLM's _SAMPLING_EPS): dividing logits by a tiny one
# overflows to inf (or by one that rounds to 0 in float32, to NaN), and softmax yields NaN.
GREEDY_TEMPERATURE = 1e-5
MAX_PENALTY = 2.0  # |frequency_penalty|, |presence_penalty| (OpenAI's and vLLM's bound)
MAX_LOGIT_BIAS = 100.0  # |bias| (OpenAI's bound)


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # below GREEDY_TEMPERATURE (0 included) => greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 => off
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()  # (list accepted)
    n: int = 1
    ignore_eos: bool = False
    logprobs: int | None = None  # top logprobs per generated token; None => off
    repetition_penalty: float = 1.0  # > 0; over prompt and output tokens; 1 => off
    frequency_penalty: float = 0.0  # in [-2, 2]; times each output token's count
    presence_penalty: float = 0.0  # in [-2, 2]; once per distinct output token
    min_p: float = 0.0  # in [0, 1]; 0 => off
    min_tokens: int = 0  # EOS and stop_token_ids are held back until this many were generated
    logit_bias: dict[int, float] | None = None  # token id -> bias in [-100, 100]

    def __post_init__(self) -> None:
        if isinstance(self.stop_token_ids, list):
            self.stop_token_ids = tuple(self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def validate(self) -> None:
        """Raise InvalidRequestError naming the first bad field."""

        def fail(name: str, rule: str) -> None:
            raise InvalidRequestError(f"{name} {rule}, got {getattr(self, name)!r}")

        def is_int(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        if not is_int(self.max_tokens) or self.max_tokens < 1:
            fail("max_tokens", "must be an integer >= 1")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or t < 0:
            fail("temperature", "must be a finite number >= 0")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, int | float) or not 0 < p <= 1:
            fail("top_p", "must be in (0, 1]")
        if not is_int(self.top_k) or self.top_k < 0:
            fail("top_k", "must be an integer >= 0 (0 disables it)")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            fail("seed", f"must be None or an integer in [0, {MAX_SEED}]")
        if not is_int(self.n) or not 1 <= self.n <= MAX_N:
            fail("n", f"must be an integer in [1, {MAX_N}]")
        if self.logprobs is not None and (
            not is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            fail("logprobs", f"must be None or an integer in [0, {MAX_LOGPROBS}]")
        stops = self.stop_token_ids
        if not isinstance(stops, tuple) or not all(is_int(s) and s >= 0 for s in stops):
            fail("stop_token_ids", "must be non-negative integers")

        def in_range(v, low: float, high: float) -> bool:
            ok = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
            return ok and low <= v <= high

        r = self.repetition_penalty
        if not in_range(r, 0, math.inf) or r == 0:
            fail("repetition_penalty", "must be a finite number > 0 (1 disables it)")
        for name in ("frequency_penalty", "presence_penalty"):
            if not in_range(getattr(self, name), -MAX_PENALTY, MAX_PENALTY):
                fail(name, f"must be in [-{MAX_PENALTY}, {MAX_PENALTY}]")
        if not in_range(self.min_p, 0, 1):
            fail("min_p", "must be in [0, 1]")
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            fail("min_tokens", "must be an integer in [0, max_tokens]")
        bias = self.logit_bias
        if bias is not None and not (isinstance(bias, dict) and all(
            is_int(t) and t >= 0 and in_range(b, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
            for t, b in bias.items()
        )):
            fail("logit_bias", f"must map token ids to biases in [-{MAX_LOGIT_BIAS}, "
                 f"{MAX_LOGIT_BIAS}]")


def make_generator(
    params: SamplingParams, index: int = 0, device: str | torch.device = "cpu"
) -> torch.Generator | None:
    """The private RNG of sample `index` of a seeded request (None when unseeded).

    Seeded from seed + index so the n samples of one request differ but each is reproducible.
    """
    if params.seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(params.seed + index)
    return gen


class Sampler:
    """Picks one token per row; vectorised over rows, except the seeded draws."""

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None] | None = None,
        histories: list[TokenHistory | None] | None = None,
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        """logits [B, V] float32 -> (token ids [B], per-row TokenLogprob or None).

        `histories` (a row's tokens) is needed by rows with min_tokens or penalties only.
        """
        logits = logits.float()
        rows, _ = logits.shape
        generators = generators or [None] * rows
        processed = process_logits(logits, params, histories)
        tokens = processed.argmax(dim=-1)
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if sampled:
            idx = torch.tensor(sampled, device=logits.device)
            chosen = self._draw(
                processed.index_select(0, idx),
                [params[i] for i in sampled],
                [generators[i] for i in sampled],
            )
            tokens = tokens.index_copy(0, idx, chosen)
        ids = tokens.tolist()
        return ids, self._logprobs(logits, tokens, ids, params)

    def _draw(
        self, logits: torch.Tensor, params: list[SamplingParams], gens: list[torch.Generator | None]
    ) -> torch.Tensor:
        device = logits.device
        temp = torch.tensor([p.temperature for p in params], device=device)
        logits = apply_min_p(logits / temp[:, None], params)
        if any(p.top_k > 0 or p.top_p < 1 for p in params):
            logits = _truncate(logits, params)
        probs = logits.softmax(dim=-1)
        # Exponential race: argmax(p / E) with E ~ Exp(1) is a draw from p, and lets each seeded
        # row take its noise from its own generator while unseeded rows share one call.
        noise = torch.empty_like(probs)
        unseeded = [i for i, g in enumerate(gens) if g is None]
        if unseeded:
            noise[unseeded] = torch.empty(
                len(unseeded), probs.shape[1], device=device
            ).exponential_()
        for i, g in enumerate(gens):
            if g is not None:
                noise[i].exponential_(generator=g)
        # A zero draw would turn a masked token's 0/0 into NaN, which argmax would pick.
        noise.clamp_(min=torch.finfo(noise.dtype).tiny)
        return (probs / noise).argmax(dim=-1)

    def _logprobs(
        self, logits: torch.Tensor, tokens: torch.Tensor, ids: list[int], params
    ) -> list[TokenLogprob | None]:
        wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
        out: list[TokenLogprob | None] = [None] * len(params)
        if not wanted:
            return out
        idx = torch.tensor(wanted, device=logits.device)
        lp = logits.index_select(0, idx).log_softmax(dim=-1)
        chosen = lp.gather(1, tokens.index_select(0, idx)[:, None])[:, 0].tolist()
        k = max(params[i].logprobs for i in wanted)
        top_v, top_i = lp.topk(k, dim=-1)
        top_v, top_i = top_v.tolist(), top_i.tolist()
        for j, i in enumerate(wanted):
            n = params[i].logprobs
            out[i] = TokenLogprob(
                ids[i], chosen[j], list(zip(top_i[j][:n], top_v[j][:n], strict=True))
            )
        return out


def _truncate(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k and top-p sets."""
    vocab = logits.shape[1]
    device = logits.device
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=device)
    kth = sorted_logits.gather(1, (k - 1)[:, None])
    drop_sorted = sorted_logits < kth  # top-k
    top_p = torch.tensor([p.top_p for p in params], device=device)
    probs = sorted_logits.masked_fill(drop_sorted, float("-inf")).softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass of strictly better tokens
    drop_sorted |= before >= top_p[:, None]
    drop_sorted[:, 0] = False  # always keep the best token
    drop = torch.empty_like(drop_sorted).scatter_(1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))
