"""K laid out in pairs within each block, for the CPU kernel's pair products.

A layer's K cache keeps its shape, [num_blocks, block_size, kv_heads, head_dim], and its bytes
per block; only the order within a block changes, to [kv_heads, head_dim / 2, block_size, 2]:
16 positions' values of one pair of a head's dims are then one 64-byte vector, the shape
AVX512-BF16's pair product takes, so the decode kernel has 16 positions' scores per vector with
no sum across lanes. Whole blocks move as before (copy-on-write, the KV tiers; a copy on disk is
position-major whatever the pool's order: `attention.layouts`); what reads or writes single
positions goes through here: the step's new rows (`store`) and a prefill chunk's cached prefix
(`gather`). V keeps the position-major order, or is laid out in pairs of positions for AMX tiles
(`attention.v_pairs`).
"""

from __future__ import annotations

import torch

PAIR_POSITIONS = 16  # positions per vector: the block size must be a multiple


def fits(block_size: int, head_dim: int) -> bool:
    """Whether the kernel takes this shape in pairs (two pairs a step, 16 positions a vector)."""
    return head_dim % 4 == 0 and block_size % PAIR_POSITIONS == 0


def _paired(k_cache: torch.Tensor) -> torch.Tensor:
    """The cache's storage as [num_blocks, kv_heads, head_dim / 2, block_size, 2]."""
    nb, bs, kvh, dim = k_cache.shape
    return k_cache.view(nb, kvh, dim // 2, bs, 2)


def store(k: torch.Tensor, k_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write new rows k [T, kv_heads, head_dim] at their slots (block * block_size + offset)."""
    t, kvh, dim = k.shape
    bs = k_cache.shape[1]
    _paired(k_cache)[slot_mapping // bs, :, :, slot_mapping % bs] = k.view(t, kvh, dim // 2, 2)


def gather(k_cache: torch.Tensor, blocks: torch.Tensor, length: int) -> torch.Tensor:
    """One sequence's first `length` cached K as [1, kv_heads, length, head_dim]."""
    kvh, dim = k_cache.shape[2:]
    paired = _paired(k_cache).index_select(0, blocks)  # [n, kvh, dim / 2, bs, 2]
    rows = paired.permute(1, 0, 3, 2, 4).reshape(kvh, -1, dim)  # [kvh, n * bs, dim]
    return rows[:, :length].unsqueeze(0)


def to_pairs(rows: torch.Tensor) -> torch.Tensor:
    """A K cache in position-major order, as a new one laid out in pairs (same shape)."""
    nb, bs, kvh, dim = rows.shape
    return rows.view(nb, bs, kvh, dim // 2, 2).permute(0, 2, 3, 1, 4).contiguous().view(rows.shape)


def to_rows(pairs: torch.Tensor) -> torch.Tensor:
    """The inverse of `to_pairs`."""
    return _paired(pairs).permute(0, 3, 1, 2, 4).contiguous().view(pairs.shape)
