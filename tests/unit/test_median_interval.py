"""The 95 % interval of a median (base/quantiles.py): the order statistics a binomial gives, checked against the
textbook values and against a simulation of its coverage."""

from __future__ import annotations

import random

import pytest

from base.quantiles import median_interval


@pytest.mark.parametrize(("n", "cut"), [(6, 0), (10, 1), (24, 6), (100, 39)])
def test_the_interval_cuts_the_binomials_order_statistics(n: int, cut: int) -> None:
    assert median_interval(list(range(n))) == (cut, n - 1 - cut)


def test_too_few_values_give_their_min_and_max() -> None:
    assert median_interval([3.0, 1.0, 2.0]) == (1.0, 3.0)
    with pytest.raises(ValueError):
        median_interval([])


def test_the_interval_holds_the_true_median_at_least_95_percent_of_the_time() -> None:
    rng = random.Random(7)
    trials = 2000
    held = 0
    for _ in range(trials):
        low, high = median_interval([rng.lognormvariate(0.0, 0.3) for _ in range(24)])
        held += low <= 1.0 <= high  # the lognormal's median is exp(0) = 1
    assert held / trials >= 0.95
