"""The bounds a request is held to before any worker runs it: the context, the vocabulary and
its cost. Each check raises a 400 in OpenAI's envelope naming the offending parameter.
"""

from __future__ import annotations

from dataclasses import dataclass

from prefixserve.cluster.errors import ApiError


@dataclass(frozen=True)
class RequestLimits:
    """One served model's bounds (the ingress's, per replica)."""

    max_model_len: int
    vocab_size: int
    max_chars_per_token: int  # the longest token's text: bounds text before tokenizing
    max_request_tokens: int
    max_request_logprobs: int

    def ids(self, ids: list[int], param: str) -> None:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ApiError(400, f"token id {bad[0]} is outside the vocabulary "
                           f"[0, {self.vocab_size})", param=param)

    def logit_bias(self, bias: dict[int, float]) -> None:
        bad = [t for t in bias if t >= self.vocab_size]
        if bad:
            raise ApiError(400, f"logit_bias token id {bad[0]} is outside the vocabulary "
                           f"[0, {self.vocab_size})", param="logit_bias")

    def stop_ids(self, ids: list[int] | None) -> None:
        bad = [t for t in ids or [] if t >= self.vocab_size]
        if bad:
            raise ApiError(400, f"stop token id {bad[0]} is outside the vocabulary "
                           f"[0, {self.vocab_size})", param="stop_token_ids")

    def context(self, prompt_len: int, max_tokens: int, param: str) -> None:
        if prompt_len + max_tokens > self.max_model_len:
            raise ApiError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {prompt_len + max_tokens} tokens ({prompt_len} in the {param}, "
                f"{max_tokens} for the completion). Please reduce the length of the {param} or "
                "the completion.",
                param=param, code="context_length_exceeded",
            )

    def length(self, tokens: int, param: str) -> None:
        if tokens > self.max_model_len:
            raise ApiError(400, f"This model's maximum context length is {self.max_model_len} "
                           f"tokens. However, the {param} has {tokens} tokens.", param=param,
                           code="context_length_exceeded")

    def chars(self, chars: int, param: str) -> None:
        """Refuse text that cannot fit the context whatever it tokenizes to, before tokenizing:
        a token stands for at most `max_chars_per_token` characters."""
        per_token = self.max_chars_per_token
        if chars > self.max_model_len * per_token:
            raise ApiError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you sent {chars:,} characters in the {param}, more than {self.max_model_len} "
                f"tokens can hold (a token here is at most {per_token} characters). Please "
                f"reduce the length of the {param}.",
                param=param, code="context_length_exceeded",
            )

    def cost(self, prompts: int, n: int, max_tokens: int, top_logprobs: int | None,
                    logprobs_param: str, rest_of_context: bool = False) -> None:
        """Refuse a request that asks for more generated tokens, or logprob entries, than one
        request may: each costs worker time (and KV) or ingress CPU and response bytes."""
        tokens = prompts * n * max_tokens
        shape = (f"{prompts} prompts × " if prompts > 1 else "") + f"n={n} × {max_tokens} tokens"
        if rest_of_context:
            shape += " (no max_tokens: the rest of the context)"
        limit = self.max_request_tokens
        if tokens > limit:
            raise ApiError(400, f"This request may generate up to {tokens:,} tokens ({shape}); "
                           f"the limit is {limit:,} per request. Lower max_tokens, n or the "
                           "number of prompts.", param="max_tokens", code="request_too_costly")
        if top_logprobs is None:
            return
        entries, limit = tokens * (top_logprobs + 1), self.max_request_logprobs
        if entries > limit:
            raise ApiError(400, f"This request may return up to {entries:,} logprob entries "
                           f"({tokens:,} tokens × {top_logprobs + 1}); the limit is {limit:,} "
                           f"per request. Lower {logprobs_param}, max_tokens or n.",
                           param=logprobs_param, code="request_too_costly")
