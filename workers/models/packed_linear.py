"""Linear layers over oneDNN's prepacked weights, where that measured faster.

torch's CPU linear layer hands its BLAS the checkpoint's row-major weight, and the library
reorders it into the blocked layout its kernels read (AMX tiles' pairs, for one) on every call:
at a decode batch's 8 to 64 rows that reorder costs more than the product. Reordering each weight
once (`torch.ops.mkldnn._reorder_linear_weight`, the packing torch's own inductor does for
frozen CPU models) and multiplying by the packed copy (`_linear_pointwise`) skips it. The copy
costs the weight's bytes again. Whether it pays depends on the CPU, its BLAS and the dtype, so
each process times both at 32 rows once per dtype; ``PREFIXSERVE_PACKED_WEIGHTS`` pins the
choice (1: packed, 0: torch's linear).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from prefixserve.workers.models.crossover import REPS, best_ms

log = logging.getLogger(__name__)

ENV = "PREFIXSERVE_PACKED_WEIGHTS"
ROWS = 32  # the rows the choice is timed at, and the layout's row hint: a decode batch's
PROBE_BYTES = 256 << 20  # weights read per timed pass: larger than a server CPU's last cache
PROBE_SHAPE = (3072, 576)  # one matrix: a small model's gate/up projection


def available() -> bool:
    """Whether this torch build has oneDNN and its packed linear ops."""
    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def pack(weight: torch.Tensor) -> torch.Tensor:
    """A weight [out, in] in the layout oneDNN's kernels read."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), ROWS)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, in] @ the packed weight's transpose, plus bias: F.linear on the packed copy."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedWeights:
    """Each layer's packed copy, made on its first use and made again if its weight has since
    been replaced or written in place (a load, an adapter merged)."""

    def __init__(self) -> None:
        self._copies: dict[int, tuple[nn.Module, int, int, torch.Tensor]] = {}

    def of(self, layer: nn.Linear) -> torch.Tensor:
        w = layer.weight
        entry = self._copies.get(id(layer))
        if entry is None or entry[0] is not layer or entry[1:3] != (w.data_ptr(), w._version):
            entry = (layer, w.data_ptr(), w._version, pack(w))
            self._copies[id(layer)] = entry
        return entry[3]


def packed_product() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """`x @ w.T` through packed copies of the plain weights it is given, each packed on first
    sight: the packed path timed as a stand-in for F.linear."""
    copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def run(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if id(w) not in copies:
            copies[id(w)] = (w, pack(w))
        return linear(x, copies[id(w)][1], None)

    return run


def packed_weights(dtype: torch.dtype) -> bool:
    """Whether this process's linear layers in `dtype` multiply by packed copies."""
    pinned = os.environ.get(ENV, "").strip()
    if pinned not in ("", "0", "1"):
        raise ValueError(f"{ENV} must be 1 (packed) or 0 (torch's linear), not {pinned!r}")
    if not available():
        return False
    return pinned == "1" if pinned else _measured(dtype, torch.get_num_threads())


@functools.cache
def _measured(dtype: torch.dtype, threads: int) -> bool:
    started = time.perf_counter()
    itemsize = torch.empty(0, dtype=dtype).element_size()
    count = max(1, PROBE_BYTES // (PROBE_SHAPE[0] * PROBE_SHAPE[1] * itemsize))
    weights = [torch.full(PROBE_SHAPE, 0.01, dtype=dtype) for _ in range(count)]
    x = torch.full((ROWS, PROBE_SHAPE[1]), 0.5, dtype=dtype)
    product = packed_product()
    packed_ms = best_ms(lambda: [product(x, w) for w in weights], REPS)
    torch_ms = best_ms(lambda: [F.linear(x, w) for w in weights], REPS)
    log.info("%s linear layers %s packed weights: %.1f ms against torch's %.1f at %d rows "
             "(%d threads, measured in %.1f s)", str(dtype).removeprefix("torch."),
             "use" if packed_ms < torch_ms else "do not use", packed_ms, torch_ms, ROWS, threads,
             time.perf_counter() - started)
    return packed_ms < torch_ms
