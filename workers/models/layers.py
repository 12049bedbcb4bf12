"""Building blocks shared by Llama-family models: RMSNorm and RoPE (with its scalings)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from prefixserve.workers.models.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalise in float32 like the reference, then scale in the model dtype.
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)


def apply_rope(x: torch.Tensor, cis: torch.Tensor) -> torch.Tensor:
    """RoPE on x [T, heads, D] as one complex multiply by cis [T, 1, D/2] (complex64).

    HF checkpoints rotate dim j with dim j + D/2 ("rotate half"); the loader reorders the q/k
    projection rows of every head to (0, D/2, 1, D/2 + 1, ...), so the pairs sit side by side.
    q.k is unchanged by a permutation applied to both, and the reordered K is what the cache holds.
    """
    xc = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    return torch.view_as_real(xc * cis).flatten(-2).to(x.dtype)


def interleave_rope_rows(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Reorder the output rows (dim 0) of a q/k projection weight or bias for `apply_rope`."""
    half = head_dim // 2
    perm = torch.stack([torch.arange(half), torch.arange(half, head_dim)], dim=1).flatten()
    return w.unflatten(0, (-1, head_dim))[:, perm].flatten(0, 1)


def rope_inv_freq(c: ModelConfig) -> torch.Tensor:
    """RoPE inverse frequencies [head_dim / 2] in float32, with the configured scaling."""
    dim = c.head_dim
    inv = 1.0 / (c.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    s = c.rope_scaling
    if s is None:
        return inv
    if s["rope_type"] == "linear":
        return inv / s["factor"]
    if s["rope_type"] == "freq_factors":  # GGUF's precomputed llama3 divisors
        return inv / torch.tensor(s["factors"], dtype=torch.float32)
    # llama3: long wavelengths slowed by `factor`, short kept, a smooth blend in between.
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)
