"""The one running mean routers and replicas keep, and an engine's request time built on it."""

from __future__ import annotations

import pytest

from base.running_mean import RunningMean
from services.replica.request_seconds import RequestSeconds


def test_each_value_moves_the_mean_by_its_weight_of_the_gap() -> None:
    mean = RunningMean(0.25, 4.0)
    mean.add(8.0)
    assert mean.value == 5.0
    mean.add(1.0)
    assert mean.value == 4.0
    with pytest.raises(ValueError, match="weight"):
        RunningMean(0.0, 1.0)


def test_an_engines_request_time_is_none_until_one_finished_then_starts_from_it() -> None:
    seconds = RequestSeconds()
    assert seconds.value is None
    seconds.finished(2.0)
    assert seconds.value == 2.0
    seconds.finished(3.0)
    assert seconds.value == pytest.approx(2.1)
