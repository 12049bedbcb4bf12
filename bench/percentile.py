"""The one percentile every benchmark reports: numpy's (linear between the closest ranks, as
vLLM's benchmarks compute theirs), NaN when there is nothing to rank."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values``."""
    return float(np.percentile(values, q)) if len(values) else float("nan")
