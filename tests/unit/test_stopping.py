"""Stopping rules: Reinforce-Ada's cases, wave sizing, stop reasons and 422 checks."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strategies import PolicyError, stopping
from strategies.estimator import Estimator


def run(rule: stopping.StoppingRule, outcomes: list[int], prompt_id: str | None = None):
    """Drive a rule wave by wave over a fixed answer sequence (1 = correct).

    Returns the wave sizes requested and the final (n_pos, n_neg)."""
    waves: list[int] = []
    n_pos = n_neg = 0
    while (size := rule.next_wave(n_pos, n_neg, prompt_id=prompt_id)) > 0:
        waves.append(size)
        batch = outcomes[n_pos + n_neg : n_pos + n_neg + size]
        assert len(batch) == size, "test outcome sequence too short"
        n_pos += sum(batch)
        n_neg += size - sum(batch)
    return waves, n_pos, n_neg


def test_balanced_two_plus_two_in_one_wave():
    rule = stopping.build("balanced", k_pos=2, k_neg=2, n_max=32, wave_size=8)
    waves, n_pos, n_neg = run(rule, [1, 0, 1, 0, 0, 0, 0, 0])
    assert waves == [8]
    assert (n_pos, n_neg) == (2, 6)
    assert rule.done(n_pos, n_neg)
    assert rule.stop_reason(n_pos, n_neg) == "rule"


def test_balanced_one_positive_in_32_reaches_n_max():
    rule = stopping.build("balanced")
    outcomes = [0] * 32
    outcomes[5] = 1
    waves, n_pos, n_neg = run(rule, outcomes)
    assert waves == [8, 8, 8, 8]
    assert (n_pos, n_neg) == (1, 31)
    assert not rule.done(n_pos, n_neg)
    assert rule.next_wave(n_pos, n_neg) == 0
    assert rule.stop_reason(n_pos, n_neg) == "n_max"


def test_positive_rule_stops_at_first_correct_answer():
    rule = stopping.build("positive", k_pos=1, wave_size=1)
    waves, n_pos, n_neg = run(rule, [0, 0, 0, 1, 1, 1])
    assert waves == [1, 1, 1, 1]
    assert (n_pos, n_neg) == (1, 3)
    assert rule.stop_reason(n_pos, n_neg) == "rule"


def test_rule_wins_stop_reason_when_rule_and_n_max_both_hold():
    rule = stopping.build("balanced", n_max=4, wave_size=4, group_size=4)
    assert rule.next_wave(2, 2) == 0
    assert rule.stop_reason(2, 2) == "rule"


def test_last_wave_is_cut_to_n_max():
    rule = stopping.build("balanced", n_max=10, wave_size=8, group_size=4)
    assert rule.next_wave(0, 8) == 2
    assert rule.next_wave(0, 10) == 0


def test_fixed_generates_exactly_group_size():
    rule = stopping.build("fixed", group_size=4, wave_size=8)
    waves, n_pos, n_neg = run(rule, [1, 1, 1, 1, 1, 1, 1, 1])
    assert waves == [4]
    assert rule.stop_reason(n_pos, n_neg) == "fixed"
    # Fixed ignores adaptive waves: it already knows how many answers it needs.
    adaptive = stopping.build("fixed", group_size=6, wave_size=4, wave="adaptive")
    assert run(adaptive, [0] * 6)[0] == [4, 2]


@pytest.mark.parametrize(
    ("counts", "balanced_wave", "positive_wave"),
    [
        # p = (n_pos+1)/(n+2); wave = ceil(max(m_pos/p, m_neg/(1-p))), clipped to [1, 8]
        ((0, 0), 4, 4),  # p=1/2: 2/(1/2)=4 and 2/(1/2)=4
        ((1, 0), 6, 2),  # p=2/3: m_pos 1/(2/3)=1.5->2, m_neg 2/(1/3)=6
        ((0, 8), 8, 8),  # p=1/10: 2/0.1=20 -> capped at wave_size 8
        ((2, 1), 3, 0),  # p=3/5: m_neg 1/(2/5)=2.5->3; positive is done
        ((1, 7), 5, 5),  # p=2/10: m_pos 1/0.2=5
    ],
)
def test_adaptive_wave_sizes(counts, balanced_wave, positive_wave):
    balanced = stopping.build("balanced", wave="adaptive")
    positive = stopping.build("positive", wave="adaptive")
    assert balanced.next_wave(*counts) == balanced_wave
    assert positive.next_wave(*counts) == positive_wave


def test_adaptive_wave_uses_estimate_of_prompt_seen_in_earlier_epoch():
    est = Estimator()
    est.update("seen", n=6, k=0)  # p = (0 + 1) / (6 + 2) = 1/8
    rule = stopping.build("positive", wave="adaptive", wave_size=32, estimator=est)
    assert rule.next_wave(0, 0, prompt_id="seen") == 16  # 2 / (1/8)
    assert rule.next_wave(0, 0, prompt_id="unseen") == 4  # count prior 1/2
    assert rule.next_wave(0, 1, prompt_id="seen") == 6  # counts take over: p = 1/3


def test_waves_are_cut_where_an_answer_becomes_unlikely_to_be_needed():
    # Hand-checked under a uniform belief: Seq-Pos 1 needs answer t + 1 iff the first t
    # are all wrong, chance 1 / (t + 1); Seq-Balance 1/1 iff they all agree, 2 / (t + 1).
    pos = stopping.build("positive", k_pos=1, n_max=32, wave_size=8)
    assert pos.likely_needed(0, 0, 8, keep=1, min_need=0.45) == 2  # 1/2 kept, 1/3 cut
    assert pos.likely_needed(0, 0, 8, keep=1, min_need=0.3) == 3  # 1/3 kept, 1/4 cut
    assert pos.likely_needed(0, 0, 8, keep=5, min_need=0.45) == 5  # never below keep
    assert pos.likely_needed(0, 0, 3, keep=1, min_need=0.0) == 3  # never above want
    bal = stopping.build("balanced", k_pos=1, k_neg=1, n_max=32, wave_size=8)
    assert bal.likely_needed(0, 0, 8, keep=1, min_need=0.45) == 4  # 2/3, 2/4 kept; 2/5 cut
    # The prompt's answers so far move the belief: after 2 wrong it is Beta(1, 3), and
    # t more wrong in a row has chance 3 / (t + 3): 3/4, 3/5, 3/6 kept, 3/7 cut.
    assert pos.likely_needed(0, 2, 8, keep=1, min_need=0.45) == 4
    # A prompt seen before starts from the estimator's posterior, Beta(1, 7) after 0 of 6:
    # 7 / (t + 7) stays above 0.6 up to t = 4.
    est = Estimator()
    est.update("seen", n=6, k=0)
    known = stopping.build("positive", k_pos=1, wave_size=8, estimator=est)
    assert known.likely_needed(0, 0, 8, keep=1, min_need=0.6, prompt_id="seen") == 5
    assert known.likely_needed(0, 0, 8, keep=1, min_need=0.6, prompt_id="unseen") == 1
    # A rule that stops on its count alone needs every answer it wants.
    fixed = stopping.build("fixed", group_size=4, wave_size=4)
    assert fixed.likely_needed(0, 0, 4, keep=1, min_need=0.99) == 4


def test_est_rule_generates_its_budget_in_waves():
    est = Estimator(mean_budget=12)
    est.set_prompts(["easy", "mid", "hard", "new"])
    for pid, k in (("easy", 8), ("mid", 4), ("hard", 0)):
        est.update(pid, n=8, k=k)
    est.recalibrate()
    rule = stopping.build("est", estimator=est, group_size=0, wave="adaptive")
    assert [rule.budget(p) for p in ("easy", "mid", "hard", "new")] == [7, 10, 21, 10]
    waves, n_pos, n_neg = run(rule, [0] * 32, prompt_id="hard")
    assert waves == [8, 8, 5]  # adaptive is ignored by est
    assert rule.stop_reason(n_pos, n_neg, prompt_id="hard") == "budget"
    # The rule's n_max caps the estimator's budget.
    capped = stopping.build("est", estimator=est, group_size=0, n_max=16)
    assert capped.budget("hard") == 16
    with pytest.raises(ValueError, match="prompt_id"):
        rule.done(0, 0)


def test_valid_edge_configs_build():
    assert stopping.build("balanced", k_pos=16, k_neg=16, n_max=32).done(16, 16)
    assert stopping.build("positive", k_pos=32, n_max=32, group_size=0).next_wave(31, 0) == 1


def test_unknown_rule_name():
    with pytest.raises(PolicyError) as info:
        stopping.build("balance")
    assert info.value.field == "rule"
    assert "balanced" in str(info.value)


@st.composite
def rule_and_counts(draw):
    n_max = draw(st.integers(2, 40))
    k_pos = draw(st.integers(1, n_max // 2))
    k_neg = draw(st.integers(1, n_max - k_pos))
    params = {
        "k_pos": k_pos,
        "k_neg": k_neg,
        "n_max": n_max,
        "wave_size": draw(st.integers(1, n_max)),
        "group_size": draw(st.integers(1, n_max)),
        "wave": draw(st.sampled_from(["fixed", "adaptive"])),
    }
    rule = stopping.build(draw(st.sampled_from(["fixed", "positive", "balanced"])), **params)
    n = draw(st.integers(0, n_max))
    n_pos = draw(st.integers(0, n))
    return rule, n_pos, n - n_pos


@settings(deadline=None, max_examples=300)
@given(rule_and_counts())
def test_next_wave_respects_budget_and_is_zero_once_done(case):
    rule, n_pos, n_neg = case
    wave = rule.next_wave(n_pos, n_neg)
    remaining = rule.params.n_max - (n_pos + n_neg)
    assert 0 <= wave <= min(remaining, rule.params.wave_size)
    if rule.done(n_pos, n_neg) or remaining == 0:
        assert wave == 0
    else:
        assert wave >= 1


@settings(deadline=None, max_examples=200)
@given(rule_and_counts(), st.lists(st.booleans(), min_size=40, max_size=40))
def test_rule_never_asks_for_more_once_done(case, outcomes):
    rule, _, _ = case
    n_pos = n_neg = 0
    while (size := rule.next_wave(n_pos, n_neg)) > 0:
        assert not rule.done(n_pos, n_neg)
        batch = outcomes[n_pos + n_neg : n_pos + n_neg + size]
        n_pos, n_neg = n_pos + sum(batch), n_neg + size - sum(batch)
    assert n_pos + n_neg <= rule.params.n_max
    assert rule.done(n_pos, n_neg) or n_pos + n_neg == rule.params.n_max
    # Done is final: more answers never make the rule ask again.
    if rule.done(n_pos, n_neg):
        for extra_pos, extra_neg in ((1, 0), (0, 1), (3, 3)):
            assert rule.next_wave(n_pos + extra_pos, n_neg + extra_neg) == 0
