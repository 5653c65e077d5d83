"""Advantage estimators: grpo, global (Reinforce-Ada), est and maxrl."""

from __future__ import annotations

import math

import numpy as np
import pytest

from strategies import PolicyError, advantage


def test_grpo_normalizes_by_unbiased_std_of_kept():
    adv = advantage.compute([1, 0, 1, 0], [1, 0, 1, 0, 0, 0, 0, 0], "grpo")
    std = math.sqrt(1 / 3)  # ddof 1 of [1, 0, 1, 0]
    np.testing.assert_allclose(adv, np.array([0.5, -0.5, 0.5, -0.5]) / (std + 1e-6))
    raw = advantage.compute([1, 0, 1, 0], [1, 0], "grpo", norm_by_std=False)
    np.testing.assert_allclose(raw, [0.5, -0.5, 0.5, -0.5])


def test_grpo_singleton_and_constant_groups_are_zero():
    np.testing.assert_array_equal(advantage.compute([1.0], [1.0, 0.0], "grpo"), [0.0])
    np.testing.assert_array_equal(advantage.compute([1, 1, 1], [1, 1, 1], "grpo"), [0, 0, 0])
    assert advantage.compute([], [1.0], "grpo").shape == (0,)


def test_global_uses_all_generated_rewards():
    kept, all_ = [1, 0], [1, 0, 0, 0]
    np.testing.assert_allclose(advantage.compute(kept, all_, "global"), [0.75, -0.25])
    # std over all four: ddof 1 of [1, 0, 0, 0] = 0.5
    np.testing.assert_allclose(
        advantage.compute(kept, all_, "global", norm_by_std=True),
        np.array([0.75, -0.25]) / (0.5 + 1e-6),
    )


def test_global_keeps_non_binary_rewards():
    adv = advantage.compute([0.9, 0.1], [0.9, 0.1, 0.5, 0.3], "global")
    np.testing.assert_allclose(adv, [0.45, -0.35])


def test_est_scales_by_inverse_sqrt_of_mean_reward():
    adv = advantage.compute([1, 0], [1, 0, 0, 0], "est")
    np.testing.assert_allclose(adv, np.array([0.75, -0.25]) / math.sqrt(0.25 + 1e-6))
    # norm_by_std does not apply to est.
    np.testing.assert_array_equal(
        advantage.compute([1, 0], [1, 0, 0, 0], "est", norm_by_std=True), adv
    )
    # A negative mean reward is clamped at 0 under the square root.
    np.testing.assert_allclose(
        advantage.compute([-1.0], [-1.0, -3.0], "est"), [1.0 / math.sqrt(1e-6)]
    )


def test_maxrl_divides_by_the_mean_reward():
    # rbar = 1/4: A = (r - 1/4) / (1/4), so [3, -1, -1, -1]; kept or not, rbar is over all.
    np.testing.assert_allclose(
        advantage.compute([1, 0, 0, 0], [1, 0, 0, 0], "maxrl"), [3, -1, -1, -1], rtol=1e-5
    )
    np.testing.assert_allclose(advantage.compute([1, 0], [1, 0, 0, 0], "maxrl"), [3, -1], rtol=1e-5)
    # A / N = r / K - 1 / N: the average score of the correct answers minus the mean score.
    rewards = np.array([1, 0, 1, 0, 0, 1, 0, 0], dtype=float)
    adv = advantage.compute(rewards, rewards, "maxrl", eps=0.0)
    np.testing.assert_allclose(adv / 8, rewards / 3 - 1 / 8)
    np.testing.assert_array_equal(advantage.compute([0, 0], [0, 0, 0], "maxrl"), [0, 0])
    np.testing.assert_array_equal(
        advantage.compute([1, 0], [1, 0], "maxrl", norm_by_std=True),
        advantage.compute([1, 0], [1, 0], "maxrl"),
    )


def test_unknown_estimator():
    with pytest.raises(PolicyError) as info:
        advantage.compute([1, 0], [1, 0], "gobal")
    assert info.value.field == "advantage"
    assert "global" in str(info.value)


def test_kept_without_generated_is_an_error():
    with pytest.raises(ValueError, match="all_rewards"):
        advantage.compute([1.0], [], "global")


def test_mean_and_std_are_numpys_to_the_bit():
    """The fast helpers make numpy's own reductions: equal, not merely close."""
    rng = np.random.default_rng(0)
    for _ in range(2000):
        values = rng.random(int(rng.integers(1, 300))) * rng.choice([1e-3, 1.0, 10.0])
        assert advantage.mean(values) == float(values.mean())
        expected = float(np.std(values, ddof=1)) if len(values) > 1 else 0.0
        assert advantage.std(values) == expected
