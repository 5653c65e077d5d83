"""Down-sampling: Reinforce-Ada balanced and PODS max-variance."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strategies import PolicyError, downsample


@pytest.mark.parametrize(
    ("rewards", "n", "expected"),
    [
        ([1, 0, 1, 0, 0, 0, 0, 0], 4, [0, 1, 2, 3]),  # 2 + 2
        ([0, 0, 0, 0, 0, 1, 0, 0], 4, [0, 1, 2, 5]),  # 1 positive + 3 negatives
        ([1, 1, 1, 0, 1], 4, [0, 1, 2, 3]),  # 2 pos + the only neg, filled from positives
        ([0, 0, 0, 0, 1, 1, 1, 1], 3, [0, 1, 4]),  # tp = floor(3/2) = 1, tn = 2
        ([0.5, 0.5, 1.0, 1.0], 2, [0, 2]),  # 0.5 is not > 0.5: negative
        ([1, 0, 1], 0, [0, 1, 2]),  # n = 0 keeps all
        ([1, 0, 1], 5, [0, 1, 2]),  # fewer answers than n
    ],
)
def test_balanced(rewards, n, expected):
    assert downsample.balanced(rewards, n, 0.5) == expected


def test_balanced_fills_negatives_last():
    # 1 positive, n = 4: the positive, then 3 negatives in generation order.
    assert downsample.balanced([0.1, 0.2, 0.9, 0.3, 0.0], 4, 0.5) == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("rewards", "n", "expected"),
    [
        ([0.0, 0.2, 0.9, 1.0, 0.5], 2, [0, 3]),
        ([0.0, 0.2, 0.9, 1.0, 0.5], 3, [0, 2, 3]),  # var {0,.9,1} > var {0,.2,1}
        ([1, 1, 0, 0], 2, [0, 2]),  # earliest of the tied highs and lows
        ([1, 0, 1, 1, 0, 0.5], 3, [0, 1, 2]),  # {1,0,1} ties {1,0,0}: generation order
        ([3, 1, 2], 0, [0, 1, 2]),
    ],
)
def test_max_variance(rewards, n, expected):
    assert downsample.max_variance(rewards, n) == expected


@settings(deadline=None, max_examples=200)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=8), st.data())
def test_max_variance_matches_brute_force(ints, data):
    rewards = [x / 4 for x in ints]
    n = data.draw(st.integers(1, len(rewards)))
    chosen = downsample.max_variance(rewards, n)
    assert chosen == sorted(set(chosen)) and len(chosen) == n
    best = max(
        np.var([rewards[i] for i in c]) for c in itertools.combinations(range(len(rewards)), n)
    )
    assert np.var([rewards[i] for i in chosen]) == pytest.approx(best, abs=1e-12)


def test_apply_dispatches_by_name():
    rewards = [0.0, 0.2, 0.9, 1.0, 0.5]
    assert downsample.apply("balanced", rewards, 2, 0.5) == [0, 2]
    assert downsample.apply("max_variance", rewards, 2, 0.5) == [0, 3]
    assert downsample.apply("none", rewards, 2, 0.5) == [0, 1, 2, 3, 4]
    with pytest.raises(PolicyError) as info:
        downsample.apply("max_var", rewards, 2, 0.5)
    assert info.value.field == "downsample"
    assert "max_variance" in str(info.value)
