"""The tiers an engine's config asks for, sized in blocks of its KV tensor."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from prefixserve.workers.engine_types import EngineConfig
from prefixserve.workers.kv_cache import KVCacheManager
from prefixserve.workers.kv_tiers.block_io import BlockIO
from prefixserve.workers.kv_tiers.disk import DiskTier
from prefixserve.workers.kv_tiers.disk_format import layout_key
from prefixserve.workers.kv_tiers.host import HostTier
from prefixserve.workers.kv_tiers.offload import TieredKV

log = logging.getLogger(__name__)

GIB = 2**30


def build_tiers(config: EngineConfig, kv: KVCacheManager, kv_cache: torch.Tensor,
                fingerprint: str, order: str = "rows") -> TieredKV | None:
    """Host and disk tiers under `kv` as `config` sizes them; None when it asks for neither.
    `order`: the pool's order of K and V within a block (the disk's files are position-major:
    `attention.layouts`)."""
    io = BlockIO(kv_cache)
    host = disk = None
    slots = int(config.kv_offloading_size * GIB) // io.block_bytes
    if config.kv_offloading_size and slots < 1:
        raise ValueError(f"kv_offloading_size {config.kv_offloading_size} GiB holds no KV "
                         f"block of {io.block_bytes} bytes")
    if slots:
        host = HostTier(slots, io.block_shape, io.dtype, pin=kv_cache.is_cuda)
        log.info("KV host tier: %d blocks (%.1f MiB)%s", slots, slots * io.block_bytes / 2**20,
                 ", pinned" if kv_cache.is_cuda else "")
    if config.kv_disk_dir:
        dtype = str(io.dtype).removeprefix("torch.")
        if config.quantization != "none":  # the quantized weights compute other KV
            fingerprint = f"{fingerprint}+{config.quantization}"
        key, layout = layout_key(fingerprint, config.block_size, dtype, io.block_shape)
        disk = DiskTier(Path(config.kv_disk_dir).expanduser(), key, layout, io.block_shape,
                        io.dtype, int(config.kv_disk_size * GIB), order=order)
        disk.scan()
    if host is None and disk is None:
        return None
    return TieredKV(kv, io, host, disk, io.block_bytes)
