"""How fast blocks move between the pool and the KV tiers, against this machine's memcpy.

    python -m prefixserve.bench.micro.tier_bandwidth                  # SmolLM2-135M's layout
    python -m prefixserve.bench.micro.tier_bandwidth --dtype bfloat16 --blocks 512

A pool and a host tier of ``--blocks`` blocks in the default model's layout (30 layers, 3 KV
heads of 64 dims, 16 tokens a block: one block is 30 x 2 strided pieces of the pool), then, each
timed over every block and repeated ``--repeats`` times (the best kept):

- memcpy: one contiguous copy of the same bytes (the ceiling for a copy on this machine);
- offload: pool -> host slots (``BlockIO.read_into``), what an eviction costs the engine thread;
- reload: host slots -> pool (``BlockIO.write``), what a host-tier hit costs before its prefill;
- disk write: the disk tier's writer thread, from queueing to the files being renamed in;
- disk read: the reader thread's checked reads (header, CRC-32) of files the page cache holds,
  and of files dropped from it first (``posix_fadvise`` DONTNEED: the device's own speed).

Also the prefill time the model spends on the same tokens on this machine, from the default
profile (``sim:cpu-smollm2``), so a reload's cost reads against recomputing.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from prefixserve.bench.load.machine import cpu_name
from prefixserve.workers.kv_tiers.block_io import BlockIO
from prefixserve.workers.kv_tiers.disk import DiskTier
from prefixserve.workers.kv_tiers.disk_format import file_name, layout_key
from prefixserve.workers.sim.profiles import CPU_SMOLLM2

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 30, 3, 64, 16


def best_seconds(fn: Callable[[], None], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def drop_page_cache(folder: Path) -> None:
    for path in folder.glob("*.kv"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def measure(blocks: int, dtype: torch.dtype, repeats: int) -> dict:
    pool = torch.randn(LAYERS, 2, blocks, BLOCK, KV_HEADS, HEAD_DIM).to(dtype)
    io = BlockIO(pool)
    host = torch.empty((blocks, *io.block_shape), dtype=dtype)
    total = blocks * io.block_bytes
    flat_src = torch.empty(total // pool.element_size(), dtype=dtype).normal_()
    flat_dst = torch.empty_like(flat_src)
    out: dict = {"cpu": cpu_name(), "dtype": str(dtype).removeprefix("torch."), "blocks": blocks,
                 "block_kib": io.block_bytes / 1024}

    def gbs(seconds: float) -> float:
        return round(total / seconds / 1e9, 2)

    out["memcpy_gbs"] = gbs(best_seconds(lambda: flat_dst.copy_(flat_src), repeats))
    out["offload_gbs"] = gbs(best_seconds(
        lambda: [io.read_into(b, host[b]) for b in range(blocks)], repeats))
    out["reload_gbs"] = gbs(best_seconds(
        lambda: [io.write(b, host[b]) for b in range(blocks)], repeats))
    with tempfile.TemporaryDirectory() as root:
        key, layout = layout_key("bench", BLOCK, out["dtype"], io.block_shape)
        disk = DiskTier(Path(root), key, layout, io.block_shape, dtype, 2 * total,
                        min_free_bytes=0)
        hashes = [i.to_bytes(16, "big") for i in range(blocks)]
        start = time.perf_counter()
        for i, h in enumerate(hashes):
            disk.store(h, host[i].clone())
        disk.flush()
        out["disk_write_gbs"] = gbs(time.perf_counter() - start)
        disk.reap()
        assert all(disk.readable(h) for h in hashes)
        out["disk_read_cached_gbs"] = gbs(best_seconds(
            lambda: disk.read_many(hashes).result(), repeats))
        drop_page_cache(disk.folder)
        start = time.perf_counter()
        got = disk.read_many(hashes).result()
        out["disk_read_cold_gbs"] = gbs(time.perf_counter() - start)
        assert all(isinstance(t, torch.Tensor) for t in got), got[-1]
        assert (disk.folder / file_name(hashes[0])).is_file()
        disk.close()
    prefill_s = CPU_SMOLLM2.step_seconds([(blocks * BLOCK, 0)], [])
    out["prefill_same_tokens_s"] = round(prefill_s, 3)
    out["reload_same_tokens_s"] = round(total / (out["reload_gbs"] * 1e9), 4)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=256)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the engine's)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    result = measure(args.blocks, getattr(torch, args.dtype), args.repeats)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
