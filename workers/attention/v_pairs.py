"""V laid out in pairs of positions within each block, for the CPU kernel's AMX tiles.

A layer's V cache keeps its shape, [num_blocks, block_size, kv_heads, head_dim], and its bytes
per block; only the order within a block changes, to [kv_heads, block_size / 2, head_dim, 2]:
the values of two adjacent positions at each of a head's dims side by side, the layout the tile
unit takes for the second operand of the weighted sum (positions being the sum's inner
dimension). It comes only with K in pairs (`attention.k_pairs`): the backend's `kv_pairs`
order (`attention.layouts`). What reads or writes single positions goes through here: a
step's new rows (`store`) and a prefill chunk's cached prefix (`gather`).
"""

from __future__ import annotations

import torch

PAIR_POSITIONS = 16  # positions per tile: the block size must be a multiple
MAX_GROUP = 16  # query heads a KV head: a tile's rows hold whole groups


def fits(block_size: int, head_dim: int, group: int) -> bool:
    """Whether the kernel's tiles take this shape with V in pairs (`group`: query heads a KV
    head). The kernel sums a window of whole groups, up to 16 query heads, 64 dims at a time."""
    return block_size % PAIR_POSITIONS == 0 and head_dim % 32 == 0 and group <= MAX_GROUP


def _paired(v_cache: torch.Tensor) -> torch.Tensor:
    """The cache's storage as [num_blocks, kv_heads, block_size / 2, head_dim, 2]."""
    nb, bs, kvh, dim = v_cache.shape
    return v_cache.view(nb, kvh, bs // 2, dim, 2)


def store(v: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write new rows v [T, kv_heads, head_dim] at their slots (block * block_size + offset)."""
    bs = v_cache.shape[1]
    offset = slot_mapping % bs
    _paired(v_cache)[slot_mapping // bs, :, offset // 2, :, offset % 2] = v


def gather(v_cache: torch.Tensor, blocks: torch.Tensor, length: int) -> torch.Tensor:
    """One sequence's first `length` cached V as [1, kv_heads, length, head_dim]."""
    kvh, dim = v_cache.shape[2:]
    paired = _paired(v_cache).index_select(0, blocks)  # [n, kvh, bs / 2, dim, 2]
    rows = paired.permute(1, 0, 2, 4, 3).reshape(kvh, -1, dim)  # [kvh, n * bs, dim]
    return rows[:, :length].unsqueeze(0)


def to_pairs(rows: torch.Tensor) -> torch.Tensor:
    """A V cache in position-major order, as a new one laid out in pairs (same shape)."""
    nb, bs, kvh, dim = rows.shape
    return rows.view(nb, bs // 2, 2, kvh, dim).permute(0, 3, 1, 4, 2).contiguous().view(rows.shape)


def to_rows(pairs: torch.Tensor) -> torch.Tensor:
    """The inverse of `to_pairs`."""
    return _paired(pairs).permute(0, 2, 4, 1, 3).contiguous().view(pairs.shape)
