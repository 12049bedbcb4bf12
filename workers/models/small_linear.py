"""How many rows a linear layer may have for the CPU's small-row kernel to run it, measured.

At a decode step's few rows a linear layer is one pass over its weights. prefixserve's kernel
(`workers/kernels/csrc/small_linear.cpp`) reads them in order at close to the memory's rate; a
BLAS library's small product reaches half of that or less on some CPUs, and beats the kernel on
others as rows grow (AMX tiles, for one). Which is faster at each row count depends on the CPU,
its BLAS and the dtype, so each process measures it once per dtype: the kernel and the product
the layers would otherwise run (torch's linear, or its packed weights where the process chose
those: `models.packed_linear`) over weights far larger than the caches, at 1, 2, ... rows, and
the kernel takes every count up to the first where it is not faster.
``PREFIXSERVE_SMALL_LINEAR_ROWS`` pins the count instead (0: never).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from types import ModuleType

import torch

from prefixserve.workers.models.crossover import REPS, Pass, last_faster
from prefixserve.workers.models.packed_linear import product

log = logging.getLogger(__name__)

ENV = "PREFIXSERVE_SMALL_LINEAR_ROWS"
PROBE_BYTES = 256 << 20  # weights read per timed pass: larger than a server CPU's last cache
PROBE_SHAPE = (3072, 576)  # one matrix: a small model's gate/up projection


Linear = Callable[[torch.Tensor, torch.Tensor], object]


def measure_rows(kernel: Linear, blas: Linear, max_rows: int, dtype: torch.dtype,
                 probe_bytes: int) -> int:
    """The largest row count up to which `kernel(x, w)` beat `blas(x, w)` at every count, over
    `probe_bytes` of weights."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    count = max(1, probe_bytes // (PROBE_SHAPE[0] * PROBE_SHAPE[1] * itemsize))
    weights = [torch.full(PROBE_SHAPE, 0.01, dtype=dtype) for _ in range(count)]

    def passes(rows: int) -> tuple[Pass, Pass]:
        x = torch.full((rows, PROBE_SHAPE[1]), 0.5, dtype=dtype)
        return (lambda: [kernel(x, w) for w in weights], lambda: [blas(x, w) for w in weights])

    return last_faster(passes, range(1, max_rows + 1), REPS)[0]


def small_linear_rows(kernels: ModuleType, dtype: torch.dtype,
                      packed: frozenset[int] = frozenset()) -> int:
    """The row counts (1 to this) that go through the kernel, for this process, dtype and torch
    thread count (a linear layer's columns are split between the threads), against the product
    the layers would otherwise run: over packed weights at the `packed` row counts."""
    pinned = os.environ.get(ENV, "").strip()
    if pinned:
        if not pinned.isdigit():
            raise ValueError(f"{ENV} must be a whole number of rows, not {pinned!r}")
        return min(int(pinned), kernels.small_linear_max_rows)
    return _measured(kernels, dtype, torch.get_num_threads(), packed)


@functools.cache
def _measured(kernels: ModuleType, dtype: torch.dtype, threads: int,
              packed: frozenset[int]) -> int:
    started = time.perf_counter()
    rows = measure_rows(kernels.small_linear, product(packed), kernels.small_linear_max_rows,
                        dtype, PROBE_BYTES)
    log.info("%s linear layers at 1 to %d rows run the small-row kernel (%d threads, measured "
             "in %.1f s)", str(dtype).removeprefix("torch."), rows, threads,
             time.perf_counter() - started)
    return rows
