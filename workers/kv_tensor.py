"""The one preallocated KV tensor: its layout, its size per token, and block copies.

`kv_cache.py` decides which block ids a sequence owns; this tensor is where those blocks' K and V
live, laid out [layers, 2, num_blocks, block_size, kv_heads, head_dim] so that the model hands
each layer's attention backend its [num_blocks, block_size, kv_heads, head_dim] K and V views.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from prefixserve.workers.kv_cache import cdiv
from prefixserve.workers.models.base import to_dtype

if TYPE_CHECKING:
    from prefixserve.workers.models.config import ModelConfig

log = logging.getLogger(__name__)

DEFAULT_CPU_KV_BYTES = 256 * 2**20


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


def blocks_for_budget(
    budget: int | None, per_token: int, block_size: int, device: torch.device,
    gpu_memory_utilization: float,
) -> int:
    """How many blocks `budget` bytes hold. By default 256 MiB on CPU; on a GPU what is left of
    `gpu_memory_utilization` x its memory once the weights (and anything else) are loaded, as
    vLLM's --gpu-memory-utilization."""
    if budget is None:
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            budget = int(total * gpu_memory_utilization) - (total - free)
        else:
            budget = DEFAULT_CPU_KV_BYTES
    num_blocks = budget // (per_token * block_size)
    if num_blocks < 1:
        raise ValueError(f"KV budget of {budget} bytes holds no block")
    return num_blocks


def fit_max_model_len(
    configured: int | None, model_len: int, num_blocks: int, block_size: int
) -> int:
    """The context the engine serves: no sequence may outgrow the whole KV pool.

    A configured ``max_model_len`` the pool cannot hold is refused at start-up (as vLLM does),
    so no request is accepted that could never finish; the unconfigured default (the model's
    context) is capped to the pool instead, so a zero-config start on a small CPU pool works.
    """
    pool_tokens = num_blocks * block_size
    if configured is None:
        if model_len > pool_tokens:
            log.warning(
                "max_model_len capped to %d tokens, what the KV cache holds (%d blocks of %d); "
                "the model's context is %d: raise kv_cache_memory_bytes or num_blocks to serve it",
                pool_tokens, num_blocks, block_size, model_len,
            )
        return min(model_len, pool_tokens)
    if cdiv(configured, block_size) > num_blocks:
        raise ValueError(
            f"max_model_len {configured} needs {cdiv(configured, block_size)} KV blocks of "
            f"{block_size} tokens, but the KV cache has {num_blocks} ({pool_tokens} tokens): "
            "raise kv_cache_memory_bytes or num_blocks, or lower max_model_len"
        )
    return configured


def log_kv_budget(
    mc: ModelConfig, dtype: str, per_token: int, num_blocks: int, block_size: int
) -> None:
    """The start-up line operators size pools by: bytes per token, the pool, and GQA's saving."""
    tokens = num_blocks * block_size
    log.info(
        "KV cache: %d bytes/token (2 x %d layers x %d kv heads x %d head_dim x %s), "
        "%d blocks of %d = %d tokens (%.1f MiB); GQA saves %.0fx over MHA (%d/%d heads)",
        per_token, mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim, dtype,
        num_blocks, block_size, tokens, per_token * tokens / 2**20,
        mc.num_attention_heads / mc.num_key_value_heads, mc.num_attention_heads,
        mc.num_key_value_heads,
    )
