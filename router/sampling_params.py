"""A request's sampling settings (`SamplingParams`) and their bounds, written once.

Part of the request protocol: the settings cross the worker boundary as this dataclass inside a
`GenerateRequest`, the ingress's request models take their bounds from here, and the engine
validates them once, as it takes the request (`validate` names the first bad field). Torch-free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prefixserve.router.errors import InvalidRequestError

MAX_N = 16
MAX_LOGPROBS = 20
MAX_SEED = 2**63 - 1  # cluster/protocol.py accepts the same range; seed + index stays a uint64
# Below this a temperature is greedy (vLLM's _SAMPLING_EPS): dividing logits by a tiny one
# overflows to inf (or by one that rounds to 0 in float32, to NaN), and softmax yields NaN.
GREEDY_TEMPERATURE = 1e-5
MAX_PENALTY = 2.0  # |frequency_penalty|, |presence_penalty| (OpenAI's and vLLM's bound)
MAX_LOGIT_BIAS = 100.0  # |bias| (OpenAI's bound)
MAX_ALLOWED_TOKEN_IDS = 1024  # allowed_token_ids: each costs the worker on every step
# What a structured output constrains to: a JSON schema ("" for any JSON object), a regular
# expression, one of a JSON list of strings, an EBNF grammar (xgrammar's dialect, as vLLM's),
# or a structural tag (free text with schema-held sections after trigger strings).
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "structural_tag")
MAX_STRUCTURED_CHARS = 65536  # a constraint's text; compiling it costs the worker


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the generated text, compiled to a grammar by the worker."""

    kind: str  # one of STRUCTURED_KINDS
    spec: str  # the schema (JSON text), regex, choices (a JSON list), grammar or tag (JSON)
    field: str = "structured_outputs"  # the request field it came from, for error messages


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
    allowed_token_ids: tuple[int, ...] | None = None  # vLLM's: only these may be drawn (list ok)
    structured: StructuredOutput | None = None  # None: free text

    def __post_init__(self) -> None:
        if isinstance(self.stop_token_ids, list):
            self.stop_token_ids = tuple(self.stop_token_ids)
        if isinstance(self.allowed_token_ids, list):
            self.allowed_token_ids = tuple(self.allowed_token_ids)

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
        allowed = self.allowed_token_ids
        if allowed is not None and not (
            isinstance(allowed, tuple) and 1 <= len(allowed) <= MAX_ALLOWED_TOKEN_IDS
            and all(is_int(t) and t >= 0 for t in allowed)
        ):
            fail("allowed_token_ids", f"must be None or 1 to {MAX_ALLOWED_TOKEN_IDS} "
                 "non-negative token ids")

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
        so = self.structured
        if so is not None and not (
            isinstance(so, StructuredOutput) and so.kind in STRUCTURED_KINDS
            and isinstance(so.spec, str) and len(so.spec) <= MAX_STRUCTURED_CHARS
        ):
            fail("structured", f"must be a StructuredOutput of a kind in {STRUCTURED_KINDS} "
                 f"with at most {MAX_STRUCTURED_CHARS} characters")
