"""Tier 1: the load policy over plain numbers."""

from __future__ import annotations

import itertools
import math

import pytest

from runtime.serving.load_policy import LoadPolicy


def test_lowers_linearly_with_the_queue_and_restores_as_it_drains():
    policy = LoadPolicy(tau_min=0.6, tau_max=1.0, queue_low=2, queue_high=10)
    taus = [policy.default_tau(1.0, q) for q in range(14)]
    assert taus[:3] == [1.0, 1.0, 1.0]
    assert taus[6] == 0.8 and taus[10:] == [0.6] * 4
    assert all(a >= b for a, b in itertools.pairwise(taus))
    assert [policy.default_tau(1.0, q) for q in reversed(range(14))] == taus[::-1]


def test_never_raises_tau_above_the_base_nor_below_tau_min():
    policy = LoadPolicy(tau_min=0.755, tau_max=1.0, queue_low=0, queue_high=3)
    assert policy.default_tau(0.5, 100) == 0.5  # a base below tau_min is kept as is
    assert all(0.755 <= policy.default_tau(0.9, q) <= 0.9 for q in range(10))


def test_policy_off_when_tau_min_equals_the_base():
    policy = LoadPolicy(tau_min=1.0, tau_max=1.0)
    assert {policy.default_tau(1.0, q) for q in range(100)} == {1.0}


@pytest.mark.parametrize("tau", [0.1, 1.5, math.nan, math.inf, "0.9"])
def test_base_tau_outside_the_bounds_is_refused(tau):
    with pytest.raises(ValueError, match=r"tau must be a number in \[0.5, 1.0\]"):
        LoadPolicy(tau_min=0.5, tau_max=1.0).check_base(tau)


@pytest.mark.parametrize("kwargs", [{"tau_min": 0.9, "tau_max": 0.8}, {"tau_min": -0.1},
                                    {"queue_low": 5, "queue_high": 5}, {"tau_max": math.nan}])
def test_bad_bounds_are_refused(kwargs):
    with pytest.raises(ValueError):
        LoadPolicy(**kwargs)
