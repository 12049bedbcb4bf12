"""bf16 linear layers over tiles of weights, at the row counts where that measured faster.

prefixserve's tile kernel (`workers/kernels/csrc/tile_linear.cpp`) multiplies a decode batch's
rows by a copy of each weight packed into AMX's tile layout, read as one ordered stream: on the
tile unit where the CPU has AMX (Intel Xeon), else with AVX512-BF16's pair product (AMD EPYC
Zen 4/5), which asks for each group of outputs' weights while it multiplies the group before.
On an Intel Xeon with AMX that read the weights faster than the small-row kernel and oneDNN's
packed product at 1 to 32 rows; on an AMD EPYC (Zen 5) the pairs beat oneDNN's packed product
at 8 to 64 rows, whose memory time adds to its arithmetic (docs/results.md). At more rows
oneDNN's blocking can win. So each process times the kernel against what the layers would
otherwise run (the small-row kernel up to its rows, then torch's linear or its packed weights:
`models.small_linear`, `models.packed_linear`) once, over weights far larger than the caches, at
1, 2, 4, ... 128 rows; a call takes the choice timed at the largest of those counts not above its
rows (none past 128). The copy costs the weight's bytes again. ``PREFIXSERVE_TILE_WEIGHTS``
pins the choice (1: tiles at every count up to 128, 0: never).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from types import ModuleType

import torch

from prefixserve.workers.models.crossover import REPS, best_ms
from prefixserve.workers.models.packed_linear import product

log = logging.getLogger(__name__)

ENV = "PREFIXSERVE_TILE_WEIGHTS"
COUNTS = (1, 2, 4, 8, 16, 32, 64, 128)  # the row counts timed: a decode batch's
PROBE_BYTES = 256 << 20  # weights read per timed pass: more than a server's cache
PROBE_SHAPE = (3072, 576)  # one matrix: a small model's gate/up projection


def tile_counts(kernels: ModuleType, dtype: torch.dtype, small_rows: int,
                packed: frozenset[int]) -> frozenset[int]:
    """The row counts (of `COUNTS`) at which this process's linear layers in `dtype` run on
    tiles, against the small-row kernel up to `small_rows` and the product over packed weights
    at the `packed` counts (empty: never; always where the build or CPU has neither AMX nor
    AVX512-BF16, or the dtype is not bfloat16)."""
    pinned = os.environ.get(ENV, "").strip()
    if pinned not in ("", "0", "1"):
        raise ValueError(f"{ENV} must be 1 (tiles) or 0 (never), not {pinned!r}")
    if dtype != torch.bfloat16 or not kernels.tile_linear_engine or pinned == "0":
        return frozenset()
    if pinned == "1":
        return frozenset(COUNTS)
    return _measured(kernels, torch.get_num_threads(), small_rows, packed)


@functools.cache
def _measured(kernels: ModuleType, threads: int, small_rows: int,
              packed: frozenset[int]) -> frozenset[int]:
    started = time.perf_counter()
    matrix = PROBE_SHAPE[0] * PROBE_SHAPE[1] * 2
    weights = [torch.full(PROBE_SHAPE, 0.01, dtype=torch.bfloat16)
               for _ in range(max(1, PROBE_BYTES // matrix))]
    tiles = [kernels.tile_pack(w) for w in weights]
    blas = product(packed)

    def other(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return kernels.small_linear(x, w) if x.shape[0] <= small_rows else blas(x, w)

    n, k = PROBE_SHAPE
    faster, times = set(), []
    for rows in COUNTS:
        x = torch.full((rows, k), 0.5, dtype=torch.bfloat16)
        tile_ms = best_ms(lambda: [kernels.tile_linear(x, t, n) for t in tiles], REPS)  # noqa: B023
        other_ms = best_ms(lambda: [other(x, w) for w in weights], REPS)  # noqa: B023
        if tile_ms < other_ms:
            faster.add(rows)
        times.append(f"{rows}: {tile_ms:.1f}/{other_ms:.1f}")
    log.info("bfloat16 linear layers run on tiles (%s) at %s rows (tiles/otherwise ms: %s; %d "
             "threads, measured in %.1f s)", kernels.tile_linear_engine,
             ", ".join(map(str, sorted(faster))) or "no", ", ".join(times), threads,
             time.perf_counter() - started)
    return frozenset(faster)
