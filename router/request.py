"""What travels through the Serve handle between the ingress and a worker replica.

Token ids, not text: workers are token-in / token-out and the router hashes these ids. A
prompt is held packed (:func:`router.blocks.token_array`), so neither the router nor Ray's
pickling touches each id. Sampling settings travel typed (`router.sampling_params`), and the
engine validates them as it takes the request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from prefixserve.router.blocks import token_array
from prefixserve.router.sampling_params import SamplingParams


@dataclass
class Expected:
    """What the router expected of the worker Serve sent a request to: the cached depth it
    credited there (blocks), and why that may be off (``failopen``: ranked without the index;
    ``partial``: the index's shard holding this worker's part did not answer; ``serve``: Serve
    sent it past the router's first choice; None: none of these). The worker compares
    it with what it finds (workers/index_truth.py): how true the index is."""

    blocks: int
    reason: str | None = None


@dataclass
class GenerateRequest:
    request_id: str
    prompt_token_ids: Sequence[int]  # held as a token_array
    sampling: SamplingParams = field(default_factory=SamplingParams)
    cache_salt: str | None = None  # already derived server-side (tenant); None = no salt
    tenant: str | None = None  # whose fair share of a worker's queue; None: one shared tenant
    lora: str | None = None  # the LoRA adapter's identity (name@digest); None: the base model
    lora_path: str | None = None  # where a worker without the adapter loads it from
    expected: Expected | None = None  # set by the prefix-aware router as the request leaves

    def __post_init__(self) -> None:
        self.prompt_token_ids = token_array(self.prompt_token_ids)


@dataclass
class TokenLogprob:
    """A sampled token's logprob and the most likely alternatives at its position."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the `logprobs` most likely (token_id, logprob), best first


@dataclass
class TokenDelta:
    """New tokens of one sample of one request from one engine step."""

    index: int  # sample index (n > 1)
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort"
    num_prompt_tokens: int
    num_cached_tokens: int
    worker: str  # replica unique id (tests assert routing with it)
    keepalive: bool = False  # no output: the worker is alive and the request still waits

    @classmethod
    def alive(cls, worker: str) -> TokenDelta:
        """What a worker sends while a request makes no progress, so that its caller can tell
        a busy worker from one that stopped answering."""
        return cls(0, [], None, False, None, 0, 0, worker, keepalive=True)
