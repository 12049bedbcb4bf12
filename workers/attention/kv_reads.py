"""How the CPU paged-decode kernel reads K/V, measured: how far ahead it asks for rows and with
which hint, how it computes scores (lane sums per position, vector tiles of positions, or,
over K laid out in pairs, AMX tiles or pair products), and how many V rows it adds into each
accumulator per pass.

Each depends on the CPU, not on the model:
- On an Intel Xeon the hardware's prefetcher alone kept rows arriving at about half the rate a
  plain sum reads memory, and asking for each row 32 rows before its use cut bf16 attention at
  32 streams by a fifth; on an AMD EPYC (Zen 3) asking ahead was slower than not.
- On an AMD EPYC (Zen 5) score tiles (with bf16 pair products) and 4 V rows per pass cut bf16
  attention by a fifth, where 4 V rows slowed fp32, whose rows are twice as long, by a tenth;
  asking ahead with the read-once hint (prefetchnta) rather than prefetcht0 cut both a little
  more.
- On an Intel Xeon with AMX, score tiles and bf16 pair products over position-major K measured
  slower than lane sums; over K in pairs, the pair products were faster, and AMX tiles, which
  take K in pairs (and V in pairs of positions) as their own layout, faster still.
- On an AMD EPYC (Zen 4), K laid out in pairs (`attention.k_pairs`; bf16 on a CPU with
  AVX512-BF16) cut bf16 attention at 32 streams by a fifth from memory against the best of the
  others (lane sums there: score tiles were slower).

So each process times every combination once per dtype and thread count, over caches larger
than the caches of most server CPUs, and keeps the fastest. ``PREFIXSERVE_KV_PREFETCH_ROWS``
pins the distance (0: none), ``PREFIXSERVE_KV_PREFETCH_HINT`` the hint (``t0``, ``t1`` or
``nta``), ``PREFIXSERVE_KV_SCORES`` the scores (``lanes``, ``tiles``, ``amx``: bf16 on a CPU
with AMX, or ``pairs``: bf16 on a CPU with AVX512-BF16) and ``PREFIXSERVE_KV_V_ROWS`` the V
rows (1 or 4); what is pinned is not timed. The choice is made once, at start, before any K is
stored: with ``amx`` or ``pairs`` the backend stores K in pairs for the process's life, and
with ``amx``, where the tiles take the shape, V in pairs of positions (`attention.layouts`).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import TypeVar

import torch

from prefixserve.workers.models.crossover import REPS, best_ms

log = logging.getLogger(__name__)
T = TypeVar("T")

AHEAD_ENV = "PREFIXSERVE_KV_PREFETCH_ROWS"
HINT_ENV = "PREFIXSERVE_KV_PREFETCH_HINT"
SCORES_ENV = "PREFIXSERVE_KV_SCORES"
V_ROWS_ENV = "PREFIXSERVE_KV_V_ROWS"
ENVS = (AHEAD_ENV, HINT_ENV, SCORES_ENV, V_ROWS_ENV)
AHEADS = (0, 32)  # rows: 32 is 12 KB of a small model's bf16 K/V
HINTS = {"t0": 3, "t1": 2, "nta": 0}  # the prefetch hint's name: its locality, the kernel's code
V_ROWS = (1, 4)  # what the kernel is compiled for
SCORES = {"lanes": 0, "tiles": 1, "amx": 2, "pairs": 3}  # the kernel's code for each
PAIRED = ("amx", "pairs")  # the scores that read K laid out in pairs (`attention.k_pairs`)
AMX_V_PAIRS = 4  # the kernel's code for `amx` with V in pairs too (`attention.v_pairs`)
MAX_PINNED = 1 << 20  # a pin past any context (and the kernel's int64) is a typo, refused at start
PROBE_BYTES = 256 << 20  # K/V read per timed pass
PROBE = (32, 576, 9, 3, 64, 16)  # sequences, tokens each, query and KV heads, head size, block


@dataclass(frozen=True)
class KVReads:
    ahead: int  # rows asked for ahead of their use (0: none)
    hint: str  # of HINTS: into every cache level, into L2, or as data read once
    scores: str  # of SCORES: lane sums, vector tiles of positions, K in pairs on AMX tiles or
    # with pair products
    v_rows: int  # V rows added into each accumulator per pass

    @property
    def hint_code(self) -> int:
        return HINTS[self.hint]

    @property
    def scores_code(self) -> int:
        return SCORES[self.scores]

    def __str__(self) -> str:
        ahead = f"{self.ahead} ahead ({self.hint})" if self.ahead else "none ahead"
        return f"{ahead}, scores: {self.scores}, {self.v_rows} V rows"


def kv_reads(kernel: ModuleType, dtype: torch.dtype) -> KVReads:
    """How the kernel reads `dtype` caches: the pins, and the fastest measured for the rest."""
    aheads = _pinned(AHEAD_ENV, AHEADS, f"a whole number of rows up to {MAX_PINNED}",
                     lambda p: int(p) if p.isdigit() and int(p) <= MAX_PINNED else None)
    hints = _pinned(HINT_ENV, tuple(HINTS), f"one of {', '.join(HINTS)}",
                    lambda p: p if p in HINTS else None)
    offered = scores_offered(kernel, dtype)
    scores = _pinned(SCORES_ENV, offered,
                     f"one of {', '.join(SCORES)} (amx: bf16 on a CPU with AMX; pairs: bf16 on "
                     "a CPU with AVX512-BF16)", lambda p: p if p in offered else None)
    v_rows = _pinned(V_ROWS_ENV, V_ROWS, f"one of {', '.join(map(str, V_ROWS))}",
                     {str(n): n for n in V_ROWS}.get)
    # With nothing asked ahead the hint means nothing: one choice, not one per hint.
    choices = list(dict.fromkeys(KVReads(a, h if a > 0 else "t0", c, v)
                                 for a in aheads for h in hints for c in scores for v in v_rows))
    if len(choices) == 1:
        return choices[0]
    return _measured(kernel, dtype, torch.get_num_threads(), tuple(choices))


def scores_offered(kernel: ModuleType, dtype: torch.dtype) -> tuple[str, ...]:
    """The ways to compute scores this kernel has for `dtype` caches."""
    bf16 = dtype == torch.bfloat16
    return ("lanes", "tiles", *(("amx",) if bf16 and kernel.amx_tiles else ()),
            *(("pairs",) if bf16 and kernel.k_pairs else ()))


def _pinned(env: str, choices: tuple[T, ...], what: str,
            parse: Callable[[str], T | None]) -> tuple[T, ...]:
    """`choices`, or the one value `env` pins (`parse` gives None for a value it refuses)."""
    pinned = os.environ.get(env, "").strip()
    if not pinned:
        return choices
    value = parse(pinned)
    if value is None:
        raise ValueError(f"{env} must be {what}, not {pinned!r}")
    return (value,)


@functools.cache
def _measured(kernel: ModuleType, dtype: torch.dtype, threads: int,
              choices: tuple[KVReads, ...]) -> KVReads:
    started = time.perf_counter()
    seqs, tokens, heads, kv_heads, dim, block = PROBE
    shape = (seqs * tokens // block, block, kv_heads, dim)
    layer_bytes = 2 * seqs * tokens * kv_heads * dim * torch.empty(0, dtype=dtype).element_size()
    caches = [(torch.full(shape, 0.01, dtype=dtype), torch.full(shape, 0.01, dtype=dtype))
              for _ in range(max(1, PROBE_BYTES // layer_bytes))]
    tables = torch.arange(shape[0]).reshape(seqs, -1)  # each sequence's blocks adjacent, rising
    lens = torch.full((seqs,), tokens)
    q = torch.full((seqs, heads, dim), 0.01, dtype=dtype)

    def code(reads: KVReads) -> int:  # `amx` as the probe's shape runs it: V in pairs too
        return AMX_V_PAIRS if reads.scores == "amx" else reads.scores_code

    def run(reads: KVReads) -> None:
        for k, v in caches:
            kernel.paged_decode(q, k, v, tables, lens, 0.125, None, None, reads.ahead,
                                reads.hint_code, code(reads), reads.v_rows)

    times = {reads: best_ms(functools.partial(run, reads), REPS) for reads in choices}
    chosen = min(times, key=times.get)
    log.info("%s paged decode reads K/V with %s: %s; over %d MiB (%d threads, measured in "
             "%.1f s)", str(dtype).removeprefix("torch."), chosen,
             ", ".join(f"{ms:.1f} ms with {r}" for r, ms in times.items()),
             len(caches) * layer_bytes >> 20, threads, time.perf_counter() - started)
    return chosen
