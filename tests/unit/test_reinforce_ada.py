"""Reinforce-Ada end to end on one prompt: rule -> down-sample -> advantages."""

from __future__ import annotations

import math

import numpy as np

from strategies import advantage, downsample, stopping

THRESHOLD = 0.5


def sample_prompt(rule, rewards):
    """Generate answers from a fixed reward sequence until the rule stops."""
    n_pos = n_neg = 0
    generated: list[float] = []
    while (size := rule.next_wave(n_pos, n_neg)) > 0:
        wave = rewards[len(generated) : len(generated) + size]
        generated += wave
        n_pos += sum(r > THRESHOLD for r in wave)
        n_neg += sum(r <= THRESHOLD for r in wave)
    return generated, rule.stop_reason(n_pos, n_neg)


def test_balanced_group_two_plus_two():
    rule = stopping.build("balanced")
    generated, reason = sample_prompt(rule, [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    assert reason == "rule" and len(generated) == 8
    kept = downsample.balanced(generated, 4, THRESHOLD)
    assert kept == [0, 1, 2, 3]
    adv = advantage.compute(np.take(generated, kept), generated, "global")
    np.testing.assert_allclose(adv, [0.75, -0.25, -0.25, 0.75])  # baseline 2/8


def test_one_positive_in_32_is_still_emitted_with_global_baseline():
    rewards = [0.0] * 32
    rewards[20] = 1.0
    generated, reason = sample_prompt(stopping.build("balanced"), rewards)
    assert reason == "n_max" and len(generated) == 32
    kept = downsample.balanced(generated, 4, THRESHOLD)
    assert kept == [0, 1, 2, 20]  # the single positive plus 3 negatives
    kept_rewards = np.take(generated, kept)
    adv = advantage.compute(kept_rewards, generated, "global")
    np.testing.assert_allclose(adv, [-1 / 32, -1 / 32, -1 / 32, 31 / 32])
    normed = advantage.compute(kept_rewards, generated, "global", norm_by_std=True)
    std_all = math.sqrt(1 / 32)  # ddof 1 over all 32: (1 - 1/32) / 31 = 1/32
    np.testing.assert_allclose(normed, adv / (std_all + 1e-6))
    # The kept-only GRPO baseline would be 1/4 instead.
    np.testing.assert_allclose(
        advantage.compute(kept_rewards, generated, "grpo", norm_by_std=False),
        [-0.25, -0.25, -0.25, 0.75],
    )


def test_positive_rule_stops_at_first_correct_answer():
    rule = stopping.build("positive", k_pos=1, wave_size=1)
    generated, reason = sample_prompt(rule, [0.0, 0.2, 0.9, 1.0, 1.0])
    assert generated == [0.0, 0.2, 0.9]
    assert reason == "rule"
