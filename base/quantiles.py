"""sluice's one quantile: numpy's `quantile` with the `linear` method (Hyndman & Fan type 7, numpy's default), the
method `vllm bench serve` uses for its percentiles (`np.percentile`). Load campaign summaries, `sluice load` gates,
the canary guard's abort criteria and every benchmark read their p50/p90/p99 here, so two of them given the same
samples give the same figure (nearest-rank and `int(n * q)` indexing, which some used before, differ from it at small
samples: of 20 TTFTs, nearest-rank p99 is the largest, linear lies between the two largest).
"""

from __future__ import annotations

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
