"""The one preallocated KV tensor: its layout, its size per token, and block copies.

`kv_cache.py` decides which block ids a sequence owns; this tensor is where those blocks' K and V
live, laid out [layers, 2, num_blocks, block_size, kv_heads, head_dim] so that the model hands
each layer's attention backend its [num_blocks, block_size, kv_heads, head_dim] K and V views.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from workers.models.base import to_dtype

if TYPE_CHECKING:
    from workers.models.config import ModelConfig

DEFAULT_CPU_KV_BYTES = 256 * 2**20
DEFAULT_GPU_KV_FRACTION = 0.8  # of the memory free after loading the weights


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
    budget: int | None, per_token: int, block_size: int, device: torch.device
) -> int:
    """How many blocks `budget` bytes hold; by default 256 MiB on CPU, 80% of free GPU memory."""
    if budget is None:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget = int(free * DEFAULT_GPU_KV_FRACTION)
        else:
            budget = DEFAULT_CPU_KV_BYTES
    num_blocks = budget // (per_token * block_size)
    if num_blocks < 1:
        raise ValueError(f"KV budget of {budget} bytes holds no block")
    return num_blocks
