"""Whole blocks in and out of the engine's KV tensor [layers, 2, num_blocks, bs, kvh, hd].

A block's copy below the pool is one contiguous [layers, 2, bs, kvh, hd] tensor, so a host slot
is one row of a preallocated array and a disk file one write.
"""

from __future__ import annotations

import torch


class BlockIO:
    def __init__(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache
        layers, two, _, bs, kvh, hd = kv_cache.shape
        self.block_shape = (layers, two, bs, kvh, hd)
        self.dtype = kv_cache.dtype
        self.block_bytes = kv_cache[:, :, 0].numel() * kv_cache.element_size()

    def read_into(self, block_id: int, out: torch.Tensor) -> None:
        """Copy a pool block into `out` (a host slot: asynchronous from a GPU into pinned
        memory, ordered on the current stream)."""
        out.copy_(self.kv_cache[:, :, block_id], non_blocking=out.is_pinned())

    def settle(self) -> None:
        """Wait for the copies queued so far (on a GPU the host-slot copies are asynchronous:
        a slot read on the CPU must wait for them first)."""
        if self.kv_cache.is_cuda:
            torch.cuda.current_stream(self.kv_cache.device).synchronize()

    def read(self, block_id: int) -> torch.Tensor:
        """A CPU copy of a pool block, the caller's to keep."""
        return self.kv_cache[:, :, block_id].to("cpu", copy=True)

    def write(self, block_id: int, src: torch.Tensor) -> None:
        """Fill a pool block from a lower tier's copy."""
        self.kv_cache[:, :, block_id].copy_(src, non_blocking=src.is_pinned())
