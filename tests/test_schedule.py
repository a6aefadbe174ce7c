"""The learning-rate schedule (``training.schedule.learning_rate``): the warm-up, the
constant rate, the cosine and the step decay, each against numbers written out."""
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


def test_step_keeps_the_rate_for_four_fifths_then_a_tenth():
    rates = [learning_rate(i, 1280, 0, 0.0002, 0.0004, "step") for i in range(1280)]
    assert rates[:1024] == [0.0004] * 1024
    assert rates[1024:] == [pytest.approx(0.00004)] * 256
    warm = [learning_rate(i, 60, 10, 0.001, 0.004, "step") for i in range(60)]
    assert warm[5] == pytest.approx(0.0025) and warm[10:50] == [0.004] * 40   # 80 % of 50
    assert warm[50:] == [pytest.approx(0.0004)] * 10


def test_unknown_decay_is_an_error_not_a_constant():
    with pytest.raises(ValueError, match="unknown learning-rate decay 'linear'"):
        learning_rate(5, 10, 0, 0.1, 0.1, "linear")


@pytest.mark.mpi
def test_a_training_run_steps_down_its_rate_at_four_fifths(tmp_path):
    """``train --lr-decay step`` for 2 epochs x 5 steps of 1 rank: the rate in steps.jsonl
    is the full one for 8 steps and a tenth of it for the last 2."""
    import json

    from jobs import train

    out = tmp_path / "run"
    result = train(1, "resnet-tiny", "--image-size", "32", "--classes", "10", "--batch-size",
                   "4", "--samples", "20", "--epochs", "2", "--lr", "0.01", "--lr-decay",
                   "step", "--peak-gflops", "50", "--out", str(out))
    assert result.returncode == 0, result.stderr[-2000:]
    rates = [json.loads(line)["lr"] for line in (out / "steps.jsonl").read_text().splitlines()]
    assert rates[:8] == [0.01] * 8 and rates[8:] == [pytest.approx(0.001)] * 2
