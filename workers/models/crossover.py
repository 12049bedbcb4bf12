"""Where one way of running a layer stops beating another, measured: the row count up to which
a packed or hand-written kernel is faster than the dense BLAS product depends on the CPU, its
BLAS and the dtype, so the engine times both at start rather than guessing
(`models.quantization`'s packed kernels, `models.small_linear`'s small-row kernel)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

Pass = Callable[[], object]
REPS = 3  # timed runs per path and count, after one to warm up; the fastest counts


def best_ms(run: Pass, reps: int) -> float:
    """The best of `reps` runs after one to warm up, in ms."""
    run()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best * 1000


def last_faster(passes: Callable[[int], tuple[Pass, Pass]], counts: Iterable[int], reps: int,
                ) -> tuple[int, dict[int, tuple[float, float]]]:
    """Trying `counts` in order, the last count at which the first of `passes(count)` ran
    faster than the second, stopping at the first where it did not (0: not even the first
    count); and each tried count's best (first, second) ms."""
    times: dict[int, tuple[float, float]] = {}
    last = 0
    for count in counts:
        first, second = passes(count)
        times[count] = (best_ms(first, reps), best_ms(second, reps))
        if times[count][0] >= times[count][1]:
            break
        last = count
    return last, times
