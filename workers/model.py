"""Llama-family causal LM (Llama, Mistral, Qwen2): RMSNorm, RoPE, GQA/MQA, SwiGLU.

q/k/v and gate/up are fused into one matmul each (the loader fills the slices), RoPE is applied
to q and k in one op, and attention goes through the paged KV cache (`workers.attention`).
Only the rows in `meta.logits_indices` reach the final norm and the LM head.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from workers.attention import AttentionMetadata, paged_attention

if TYPE_CHECKING:
    from workers.model_config import ModelConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def to_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


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


class Attention(nn.Module):
    def __init__(self, c: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = (
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
        )
        width = (self.heads + 2 * self.kv_heads) * self.head_dim
        self.qkv_proj = nn.Linear(c.hidden_size, width, bias=c.attention_bias, dtype=dtype)
        self.o_proj = nn.Linear(self.heads * self.head_dim, c.hidden_size, bias=False, dtype=dtype)
        self.scale = self.head_dim**-0.5

    def forward(self, x, cis, meta, k_cache, v_cache) -> torch.Tensor:
        qkv = self.qkv_proj(x).view(x.shape[0], -1, self.head_dim)
        h, kvh = self.heads, self.kv_heads
        qk = apply_rope(qkv[:, : h + kvh], cis)
        q, k, v = qk[:, :h], qk[:, h:], qkv[:, h + kvh :]
        return self.o_proj(paged_attention(q, k, v, k_cache, v_cache, meta, self.scale))


class MLP(nn.Module):
    def __init__(self, c: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.gate_up_proj = nn.Linear(
            c.hidden_size, 2 * c.intermediate_size, bias=False, dtype=dtype
        )
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))  # in place: one less big allocation


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.self_attn = Attention(c, dtype)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.mlp = MLP(c, dtype)

    def forward(self, x, cis, meta, k_cache, v_cache) -> torch.Tensor:
        # Residual adds land in the sublayer's fresh output instead of a new tensor.
        x = self.self_attn(self.input_layernorm(x), cis, meta, k_cache, v_cache).add_(x)
        return self.mlp(self.post_attention_layernorm(x)).add_(x)


class CausalLM(nn.Module):
    """Built on the meta device by the loader; `finish_init` runs after weights get storage."""

    def __init__(self, config: ModelConfig, dtype: str | torch.dtype = torch.float32):
        super().__init__()
        dtype = to_dtype(dtype)
        self.config = config
        c = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(c, dtype) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False, dtype=dtype)
        self.inv_freq = torch.empty(0)
        self.finish_init()

    def finish_init(self) -> None:
        """Tie embeddings and compute RoPE frequencies on the parameters' device."""
        device = self.embed_tokens.weight.device
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        if device.type != "meta":
            self.inv_freq = rope_inv_freq(self.config).to(device)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        """Run the step's T flat tokens; logits [len(logits_indices), vocab] in float32."""
        x = self.embed_tokens(input_ids)
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        cis = torch.polar(torch.ones_like(freqs), freqs)[:, None, :]
        for i, layer in enumerate(self.layers):
            x = layer(x, cis, meta, kv_cache[i, 0], kv_cache[i, 1])
        x = self.norm(x.index_select(0, meta.logits_indices))
        return self.lm_head(x).float()


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


def allocate_kv_cache(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: str | torch.dtype,
    device: str | torch.device,
) -> torch.Tensor:
    """The one KV tensor [layers, 2, num_blocks, block_size, kv_heads, head_dim].

    Zero-filled, not empty: padded decode rows read (masked) slots, and garbage NaNs there
    would leak through the softmax's zero weights.
    """
    shape = (
        config.num_hidden_layers,
        2,
        num_blocks,
        block_size,
        config.num_key_value_heads,
        config.head_dim,
    )
    return torch.zeros(shape, dtype=to_dtype(dtype), device=device)


def kv_bytes_per_token(config: ModelConfig, dtype: str | torch.dtype) -> int:
    """2 (K and V) x layers x kv_heads x head_dim x bytes per element."""
    size = torch.empty(0, dtype=to_dtype(dtype)).element_size()
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * size


def copy_blocks(kv_cache: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
    """Copy whole blocks src -> dst in every layer (copy-on-write)."""
    if not pairs:
        return
    src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=kv_cache.device)
    dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=kv_cache.device)
    kv_cache.index_copy_(2, dst, kv_cache.index_select(2, src))
