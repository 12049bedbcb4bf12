"""How far ahead the CPU paged-decode kernel asks for K/V rows, measured.

The kernel reads each sequence's K rows, then its V rows, in order. On an Intel Xeon the
hardware's prefetcher alone kept them arriving at about half the rate a plain sum reads memory,
and asking for each row 32 rows before its use cut bf16 attention at 32 streams by a fifth; on
an AMD EPYC (Zen 3) asking ahead was slower than not. So each process times both once per dtype
and thread count, over caches larger than the caches of most server CPUs, and keeps the faster.
``PREFIXSERVE_KV_PREFETCH_ROWS`` pins the distance instead (0: none).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from types import ModuleType

import torch

from prefixserve.workers.models.crossover import REPS, best_ms

log = logging.getLogger(__name__)

ENV = "PREFIXSERVE_KV_PREFETCH_ROWS"
AHEAD = 32  # rows: 12 KB of a small model's bf16 K/V
MAX_PINNED = 1 << 20  # a pin past any context (and the kernel's int64) is a typo, refused at start
PROBE_BYTES = 256 << 20  # K/V read per timed pass
PROBE = (32, 576, 9, 3, 64, 16)  # sequences, tokens each, query and KV heads, head size, block


def prefetch_rows(kernel: ModuleType, dtype: torch.dtype) -> int:
    """The rows the kernel asks for ahead of their use in `dtype` caches (0: none)."""
    pinned = os.environ.get(ENV, "").strip()
    if pinned:
        if not pinned.isdigit() or int(pinned) > MAX_PINNED:
            raise ValueError(f"{ENV} must be a whole number of rows up to {MAX_PINNED}, not "
                             f"{pinned!r}")
        return int(pinned)
    return _measured(kernel, dtype, torch.get_num_threads())


@functools.cache
def _measured(kernel: ModuleType, dtype: torch.dtype, threads: int) -> int:
    started = time.perf_counter()
    seqs, tokens, heads, kv_heads, dim, block = PROBE
    shape = (seqs * tokens // block, block, kv_heads, dim)
    layer_bytes = 2 * seqs * tokens * kv_heads * dim * torch.empty(0, dtype=dtype).element_size()
    caches = [(torch.full(shape, 0.01, dtype=dtype), torch.full(shape, 0.01, dtype=dtype))
              for _ in range(max(1, PROBE_BYTES // layer_bytes))]
    tables = torch.arange(shape[0]).reshape(seqs, -1)  # each sequence's blocks adjacent, rising
    lens = torch.full((seqs,), tokens)
    q = torch.full((seqs, heads, dim), 0.01, dtype=dtype)

    def run(ahead: int) -> None:
        for k, v in caches:
            kernel.paged_decode(q, k, v, tables, lens, 0.125, None, None, ahead)

    ahead_ms = best_ms(lambda: run(AHEAD), REPS)
    plain_ms = best_ms(lambda: run(0), REPS)
    chosen = AHEAD if ahead_ms < plain_ms else 0
    log.info("%s paged decode asks for K/V rows %d ahead: %.1f ms asking %d ahead, %.1f not, "
             "over %d MiB (%d threads, measured in %.1f s)", str(dtype).removeprefix("torch."),
             chosen, ahead_ms, AHEAD, plain_ms, len(caches) * layer_bytes >> 20, threads,
             time.perf_counter() - started)
    return chosen
