"""The orders of K and V within a block that a backend keeps (`AttentionBackend.kv_layout`).

- `rows`: both position-major, as the cache tensor's shape reads.
- `k_pairs`: K in pairs of dims (`attention.k_pairs`), V position-major.
- `kv_pairs`: K in pairs of dims and V in pairs of positions (`attention.v_pairs`).

Whole blocks move the same in any order (copy-on-write, the host tier). A KV file on disk
holds both position-major whatever the pool's order, converted here by the disk tier, so that
workers that chose differently share files and a warm restart finds them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from prefixserve.workers.attention import k_pairs, v_pairs

LAYOUTS = ("rows", "k_pairs", "kv_pairs")


def block_to_rows(block: torch.Tensor, layout: str) -> torch.Tensor:
    """A whole block's copy [layers, 2, block_size, kv_heads, head_dim] in `layout`, as one
    with K and V position-major (itself where it already is)."""
    return _convert(block, layout, k_pairs.to_rows, v_pairs.to_rows)


def block_from_rows(block: torch.Tensor, layout: str) -> torch.Tensor:
    """The inverse of `block_to_rows`."""
    return _convert(block, layout, k_pairs.to_pairs, v_pairs.to_pairs)


def _convert(block: torch.Tensor, layout: str, k: Callable[[torch.Tensor], torch.Tensor],
             v: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`block` with `k` applied to its K where `layout` has K in pairs, `v` to its V where it
    has V in pairs."""
    if layout == "rows":
        return block
    out = block.clone()
    out[:, 0] = k(block[:, 0])
    if layout == "kv_pairs":
        out[:, 1] = v(block[:, 1])
    return out
