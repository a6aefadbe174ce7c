"""The benchmarks' adaptive trial count (bench/common.py run_until_resolved): rounds go on in
palindromic pairs until every row is resolved, and stop at the minimum when it is; a row that
never resolves runs to the maximum (the control); ``trials`` given runs exactly that many."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
from common import Row, resolved, run_until_resolved  # noqa: E402 - bench/ is not a package


def sides_with(ratio_values):
    """Side "a" returns the next ratio, side "b" always 1.0; also the order the calls ran."""
    calls: list[str] = []
    values = itertools.cycle(ratio_values)

    def a():
        calls.append("a")
        return next(values)

    def b():
        calls.append("b")
        return 1.0
    return {"a": a, "b": b}, calls


def row(t, target):
    return Row.measured("a-b", "a ÷ b", ">=", target, t["a"], t["b"])


def done(target):
    return lambda t: resolved([row(t, target)])


def test_a_clear_ratio_stops_at_the_minimum_in_palindromic_rounds():
    sides, calls = sides_with([1.20, 1.25, 1.22])
    t = run_until_resolved(sides, done(1.0), None, min_trials=8, max_trials=30)
    assert len(t["a"]) == len(t["b"]) == 8
    assert calls[:4] == ["a", "b", "b", "a"]


def test_a_ratio_straddling_the_target_runs_to_the_maximum():
    sides, _ = sides_with([0.9, 1.1])      # control: the interval always holds 1.0
    t = run_until_resolved(sides, done(1.0), None, min_trials=8, max_trials=14)
    assert len(t["a"]) == 14
    assert not resolved([row(t, 1.0)])


def test_exact_trials_ignore_the_verdict():
    sides, _ = sides_with([0.9, 1.1])
    assert len(run_until_resolved(sides, done(1.0), 3, 8, 14)["a"]) == 3
