"""Linear layers over oneDNN's prepacked weights, at the row counts where that measured faster.

torch's CPU linear layer hands its BLAS the checkpoint's row-major weight, and the library
reorders it into the blocked layout its kernels read (AMX tiles' pairs, for one) on every call:
at a decode batch's 8 to 64 rows that reorder costs more than the product. Reordering each weight
once (`torch.ops.mkldnn._reorder_linear_weight`, the packing torch's own inductor does for
frozen CPU models) and multiplying by the packed copy (`_linear_pointwise`) skips it. The copy
costs the weight's bytes again. Whether it pays depends on the CPU, its BLAS, the dtype and the
row count (MKL's fp32 product at one row can beat it), so each process times both once per dtype
at 1, 2, 4, ... 512 rows, and a call takes the choice timed at the largest of those counts not
above its rows. ``PREFIXSERVE_PACKED_WEIGHTS`` pins the choice for every count (1: packed, 0:
torch's linear).
"""

from __future__ import annotations

import bisect
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
COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)  # the row counts timed
ROWS_HINT = 32  # the row count the layout is packed for: a decode batch's
PROBE_BYTES = 256 << 20  # weights read per timed pass up to 32 rows: more than a server's cache
PROBE_SHAPE = (3072, 576)  # one matrix: a small model's gate/up projection

Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def available() -> bool:
    """Whether this torch build has oneDNN and its packed linear ops."""
    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def pack(weight: torch.Tensor) -> torch.Tensor:
    """A weight [out, in] in the layout oneDNN's kernels read."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), ROWS_HINT)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, in] @ the packed weight's transpose, plus bias: F.linear on the packed copy."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def timed_count(rows: int) -> int:
    """The largest timed count not above `rows` (>= 1), whose choice a call of `rows` takes
    (a bisection: every linear layer's call asks)."""
    return COUNTS[bisect.bisect_right(COUNTS, rows) - 1]


class PackedWeights:
    """Each layer's packed copy, made on its first use and made again if its weight has since
    been replaced or written in place (a load, an adapter merged); and the row counts it is
    used at. ``pack``: the layout (oneDNN's by default; `models.tile_linear`'s tiles)."""

    def __init__(self, counts: frozenset[int],
                 pack: Callable[[torch.Tensor], torch.Tensor] = pack) -> None:
        self.counts = counts  # those of COUNTS where packed measured faster
        self.pack = pack
        self._copies: dict[int, tuple[nn.Module, int, int, torch.Tensor]] = {}

    def covers(self, rows: int) -> bool:
        return timed_count(rows) in self.counts

    def of(self, layer: nn.Linear) -> torch.Tensor:
        w = layer.weight
        entry = self._copies.get(id(layer))
        if entry is None or entry[1:3] != (w.data_ptr(), w._version):
            entry = (layer, w.data_ptr(), w._version, self.pack(w))  # the layer held: id stays
            self._copies[id(layer)] = entry
        return entry[3]


def product(counts: frozenset[int]) -> Linear:
    """`x @ w.T` as a layer would compute it: over packed copies of the plain weights it is
    given (each packed on first sight) at `counts`' row counts, torch's linear at the rest."""
    copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def run(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if timed_count(x.shape[0]) not in counts:
            return F.linear(x, w)
        if id(w) not in copies:
            copies[id(w)] = (w, pack(w))
        return linear(x, copies[id(w)][1], None)

    return run


def packed_counts(dtype: torch.dtype) -> frozenset[int]:
    """The timed row counts at which this process's linear layers in `dtype` multiply by
    packed copies (empty: never)."""
    pinned = os.environ.get(ENV, "").strip()
    if pinned not in ("", "0", "1"):
        raise ValueError(f"{ENV} must be 1 (packed) or 0 (torch's linear), not {pinned!r}")
    if not available() or pinned == "0":
        return frozenset()
    return frozenset(COUNTS) if pinned == "1" else _measured(dtype, torch.get_num_threads())


@functools.cache
def _measured(dtype: torch.dtype, threads: int) -> frozenset[int]:
    started = time.perf_counter()
    itemsize = torch.empty(0, dtype=dtype).element_size()
    matrix = PROBE_SHAPE[0] * PROBE_SHAPE[1] * itemsize
    weights = [torch.full(PROBE_SHAPE, 0.01, dtype=dtype)
               for _ in range(max(1, PROBE_BYTES // matrix))]
    packed = product(frozenset(COUNTS))
    faster, times = set(), []
    for rows in COUNTS:
        # past 32 rows the product is arithmetic-bound: a few weights time it as well
        some = weights if rows <= ROWS_HINT else weights[:max(1, len(weights) * 8 // rows)]
        x = torch.full((rows, PROBE_SHAPE[1]), 0.5, dtype=dtype)
        packed_ms = best_ms(lambda: [packed(x, w) for w in some], REPS)  # noqa: B023
        torch_ms = best_ms(lambda: [F.linear(x, w) for w in some], REPS)  # noqa: B023
        if packed_ms < torch_ms:
            faster.add(rows)
        times.append(f"{rows}: {packed_ms:.1f}/{torch_ms:.1f}")
    log.info("%s linear layers use packed weights at %s rows (packed/torch's linear ms: %s; "
             "%d threads, measured in %.1f s)", str(dtype).removeprefix("torch."),
             ", ".join(map(str, sorted(faster))) or "no", ", ".join(times), threads,
             time.perf_counter() - started)
    return frozenset(faster)
