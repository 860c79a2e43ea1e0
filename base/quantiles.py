"""sluice's one quantile: numpy's `quantile` with the `linear` method (Hyndman & Fan type 7, numpy's default), the
method `vllm bench serve` uses for its percentiles (`np.percentile`). Load campaign summaries, `sluice load` gates,
the canary guard's abort criteria and every benchmark read their p50/p90/p99 here, so two of them given the same
samples give the same figure (nearest-rank and `int(n * q)` indexing, which some used before, differ from it at small
samples: of 20 TTFTs, nearest-rank p99 is the largest, linear lies between the two largest).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

QUANTILE_METHOD = "linear"


def quantile(values: Sequence[float], q: float) -> float:
    """The `q` quantile (0..1) of non-empty `values`."""
    if not values:
        raise ValueError("the quantile of no values")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile {q} outside 0..1")
    return float(np.quantile(np.asarray(values, dtype=float), q, method=QUANTILE_METHOD))


def median_interval(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float]:
    """A distribution-free interval that holds the median of what `values` sample with at least `confidence`: the
    order statistics that cut `c` values off each end, `c` the most with P(Binomial(n, 1/2) <= c) <= (1 - confidence)
    / 2. Too few values for that (n < 6 at 95 %): their min and max."""
    if not values:
        raise ValueError("the median interval of no values")
    ordered = sorted(values)
    n = len(ordered)
    tail = (1.0 - confidence) / 2
    cut, below = 0, math.comb(n, 0) / 2**n
    while cut < (n - 1) // 2 and below + math.comb(n, cut + 1) / 2**n <= tail:
        cut += 1
        below += math.comb(n, cut) / 2**n
    return ordered[cut], ordered[n - 1 - cut]
