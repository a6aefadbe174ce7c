"""The learning-rate schedule (``training.schedule.learning_rate``): the warm-up, the
constant rate and the cosine decay, each against numbers written out."""
from __future__ import annotations

import math

import pytest

from hpcai.training.schedule import learning_rate


def test_constant_rate_after_the_warm_up_is_the_control():
    rates = [learning_rate(i, 100, 0, 0.001, 0.002) for i in range(100)]
    assert rates == [0.002] * 100


def test_cosine_runs_from_the_rate_to_near_zero_over_the_whole_run():
    rates = [learning_rate(i, 100, 0, 0.001, 0.002, "cosine") for i in range(100)]
    assert rates[0] == 0.002
    assert rates[50] == pytest.approx(0.001)
    assert rates[99] == pytest.approx(0.002 * 0.5 * (1 + math.cos(math.pi * 0.99)))
    assert 0 < rates[99] < 1e-5, "the last step must still move, barely"
    assert all(a > b for a, b in zip(rates, rates[1:])), "not strictly decreasing"


def test_warm_up_then_cosine_from_the_warm_up_end():
    rates = [learning_rate(i, 40, 10, 0.001, 0.004, "cosine") for i in range(40)]
    assert rates[0] == 0.001 and rates[5] == pytest.approx(0.0025)   # linear ramp
    assert rates[10] == 0.004                                         # the peak
    assert rates[25] == pytest.approx(0.002)                          # halfway through 30
    assert max(rates) == 0.004


def test_unknown_decay_is_an_error_not_a_constant():
    with pytest.raises(ValueError, match="unknown learning-rate decay 'step'"):
        learning_rate(5, 10, 0, 0.1, 0.1, "step")
