"""vLLM's request-level logits processors: allowed_token_ids, min_tokens, logit_bias, penalties
and min_p.

They follow vllm/v1/sample: allowed_token_ids, min_tokens and logit_bias, then repetition /
frequency / presence penalties, all on the raw logits before the greedy argmax and before
temperature; min_p after
temperature, ahead of top-k / top-p. Each is a pure function of a [batch, vocab] float logits
tensor, the rows' SamplingParams and, for the ones that look at what was generated, each row's
`TokenHistory`. Every function returns its input untouched when no row uses it, so a batch at
the defaults costs nothing and samples exactly as before.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from itertools import chain
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from prefixserve.router.sampling_params import SamplingParams


class TokenHistory:
    """One sequence's tokens as the processors read them; made once per sequence.

    It shares the sequence's growing id list, so the output is always current, and keeps the
    prompt's distinct ids as a tensor on the logits' device: prompts are long and never change,
    so they are converted once, not every step.
    """

    def __init__(
        self, token_ids: list[int], num_prompt_tokens: int, stop_ids: Collection[int]
    ) -> None:
        self.token_ids = token_ids  # prompt + output; appended to by the engine
        self.num_prompt_tokens = num_prompt_tokens
        self.stop_ids = tuple(stop_ids)  # what min_tokens holds back: EOS and stop_token_ids
        self._prompt: torch.Tensor | None = None

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    def prompt_ids(self, device: torch.device) -> torch.Tensor:
        if self._prompt is None or self._prompt.device != device:
            prompt = sorted(set(self.token_ids[: self.num_prompt_tokens]))
            self._prompt = torch.tensor(prompt, dtype=torch.long, device=device)
        return self._prompt


def needs_history(p: SamplingParams) -> bool:
    """Whether a row's processors read its tokens (the engine builds histories only then)."""
    return p.min_tokens > 0 or _penalized(p)


def _penalized(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1 or p.frequency_penalty != 0 or p.presence_penalty != 0


def process_logits(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[TokenHistory | None] | None,
) -> torch.Tensor:
    """allowed_token_ids, min_tokens, logit_bias, then penalties (vLLM's order); a new tensor
    when any applies."""
    hist: Sequence[TokenHistory | None] = histories or [None] * len(params)
    allowed = [i for i, p in enumerate(params) if p.allowed_token_ids]
    held = [
        i for i, p in enumerate(params)
        if p.min_tokens > 0 and _history(hist, i).num_output_tokens < p.min_tokens
    ]
    biased = [i for i, p in enumerate(params) if p.logit_bias]
    penalized = [i for i, p in enumerate(params) if _penalized(p)]
    if not (allowed or held or biased or penalized):
        return logits
    raw, logits = logits, logits.clone()  # the raw logits still give the reported logprobs
    if allowed:
        _allow_only(logits, allowed, [params[i].allowed_token_ids or () for i in allowed])
    if held:
        _hold_stops(logits, held, [_history(hist, i).stop_ids for i in held])
    if allowed or held:
        _keep_drawable(logits, raw, sorted({*allowed, *held}))
    if biased:
        _add_bias(logits, biased, [params[i].logit_bias for i in biased])
    if penalized:
        _penalize(logits, penalized, [params[i] for i in penalized],
                  [_history(hist, i) for i in penalized])
    return logits


def _history(hist: Sequence[TokenHistory | None], row: int) -> TokenHistory:
    h = hist[row]
    if h is None:
        raise ValueError(f"row {row} uses min_tokens or penalties but has no TokenHistory")
    return h


def _pairs(rows: list[int], cols: Sequence[Collection[int]], device: torch.device
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, column index) tensors for every column of every row: one scatter's worth."""
    lengths = torch.tensor([len(c) for c in cols], device=device)
    r = torch.tensor(rows, device=device).repeat_interleave(lengths)
    c = torch.tensor(list(chain.from_iterable(cols)), dtype=torch.long, device=device)
    return r, c


def _allow_only(logits: torch.Tensor, rows: list[int], allowed: list[Collection[int]]) -> None:
    """allowed_token_ids: every other token of the row to -inf (the ids are in the vocabulary:
    the engine checked them)."""
    r, c = _pairs(rows, allowed, logits.device)
    kept = logits[r, c]
    logits[torch.tensor(rows, device=logits.device)] = float("-inf")
    logits.index_put_((r, c), kept)


def _keep_drawable(logits: torch.Tensor, raw: torch.Tensor, rows: list[int]) -> None:
    """A row the masks left nothing to draw from takes its unmasked logits back: a structured
    output's grammar (applied to `raw` before) that allows only EOS or only tokens outside
    allowed_token_ids wins over min_tokens and allowed_token_ids, so the text still fits it."""
    idx = torch.tensor(rows, device=logits.device)
    dead = idx[torch.isneginf(logits.index_select(0, idx).amax(dim=-1))]
    if len(dead):
        logits[dead] = raw[dead]


def _hold_stops(logits: torch.Tensor, rows: list[int], stops: list[tuple[int, ...]]) -> None:
    """min_tokens: EOS and stop_token_ids cannot be drawn until enough tokens were generated.

    An id past the vocabulary is never drawn anyway; indexing it would fail the whole step.
    """
    vocab = logits.shape[1]
    r, c = _pairs(rows, [[t for t in s if t < vocab] for s in stops], logits.device)
    logits.index_put_((r, c), torch.tensor(float("-inf"), device=logits.device))


def _add_bias(logits: torch.Tensor, rows: list[int], biases: list[dict[int, float]]) -> None:
    r, c = _pairs(rows, [b.keys() for b in biases], logits.device)
    values = torch.tensor(
        list(chain.from_iterable(b.values() for b in biases)), dtype=logits.dtype,
        device=logits.device,
    )
    logits.index_put_((r, c), values, accumulate=True)


def _penalize(
    logits: torch.Tensor, rows: list[int], params: list[SamplingParams],
    hist: list[TokenHistory],
) -> None:
    """Repetition over prompt and output (as transformers' RepetitionPenaltyLogitsProcessor),
    then the OpenAI frequency and presence penalties over the output only."""
    device = logits.device
    idx = torch.tensor(rows, device=device)
    sub = logits.index_select(0, idx)
    counts = torch.zeros_like(sub)
    local = list(range(len(rows)))
    r, c = _pairs(local, [h.output for h in hist], device)
    counts.index_put_((r, c), torch.ones_like(c, dtype=sub.dtype), accumulate=True)
    in_output = counts > 0
    rep = [i for i, p in enumerate(params) if p.repetition_penalty != 1]
    if rep:
        seen = in_output.clone()
        prompts = [hist[i].prompt_ids(device) for i in rep]
        lengths = torch.tensor([len(t) for t in prompts], device=device)
        seen[torch.tensor(rep, device=device).repeat_interleave(lengths), torch.cat(prompts)] = True
        penalty = torch.tensor([p.repetition_penalty for p in params], device=device)
        penalty = torch.where(seen, penalty[:, None], 1.0)
        sub = torch.where(sub > 0, sub / penalty, sub * penalty)
    if any(p.frequency_penalty or p.presence_penalty for p in params):
        freq = torch.tensor([p.frequency_penalty for p in params], device=device)
        presence = torch.tensor([p.presence_penalty for p in params], device=device)
        sub = sub - freq[:, None] * counts
        sub = sub - presence[:, None] * in_output
    logits.index_copy_(0, idx, sub)


def apply_min_p(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Drop tokens less likely than min_p times the likeliest (on temperature-scaled logits)."""
    if not any(p.min_p > 0 for p in params):
        return logits
    probs = logits.softmax(dim=-1)
    min_p = torch.tensor([p.min_p for p in params], dtype=probs.dtype, device=logits.device)
    floor = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return logits.masked_fill(probs < floor, float("-inf"))
