"""What travels through the Serve handle from the ingress to a worker replica.

Token ids, not text: workers are token-in / token-out and the router hashes these ids. Sampling
parameters travel as a plain dict so that `router` never imports `workers`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class GenerateRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams fields
    cache_salt: str | None = None  # already derived server-side (tenant); None = no salt
    model: str = ""  # served model name
