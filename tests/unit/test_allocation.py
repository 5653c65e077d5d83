"""Allocation policies against hand-computed cases (the formulas are in the module)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from strategies import PolicyError, allocation
from strategies.estimator import Estimator, EstKnobs

F, T = False, True


def test_informative_probability_under_a_uniform_and_a_skewed_posterior() -> None:
    # Beta(1, 1): E[p^n] = E[(1-p)^n] = 1/(n+1), so I(n) = (n-1)/(n+1).
    np.testing.assert_allclose(
        allocation.informative_probability(1.0, 1.0, 6),
        [0, 0, 1 / 3, 1 / 2, 3 / 5, 2 / 3, 5 / 7],
    )
    # Beta(2, 4): E[p^n] = 120/((n+2)(n+3)(n+4)(n+5)), E[(1-p)^n] = 20/((n+4)(n+5)).
    n = np.arange(2, 13)
    expected = 1 - 120 / ((n + 2) * (n + 3) * (n + 4) * (n + 5)) - 20 / ((n + 4) * (n + 5))
    np.testing.assert_allclose(allocation.informative_probability(2.0, 4.0, 12)[2:], expected)
    # A posterior concentrated at p = 1/2 gives the plug-in value 1 - 2 / 2^n.
    np.testing.assert_allclose(
        allocation.informative_probability(1e9, 1e9, 4)[2:], [0.5, 0.75, 0.875], rtol=1e-6
    )


def test_the_papers_value_weights_by_infogain() -> None:
    # Beta(1, 1): E[p(1-p)^2] = B(2, 3) = 1/12; n = 2: minus B(4, 3) = 1/60 and
    # B(2, 5) = 1/30, so 1/30; n = 3: 1/12 - B(5, 3) - B(2, 6) = 1/12 - 1/105 - 1/42 = 1/20.
    np.testing.assert_allclose(allocation.paper_value(1.0, 1.0, 3), [0, 0, 1 / 30, 1 / 20])
    # p(1-p)^2 favours the hard prompt over its mirror image.
    hard, easy = allocation.paper_value(1.0, 9.0, 8), allocation.paper_value(9.0, 1.0, 8)
    assert np.all(hard[2:] > easy[2:])


def test_posterior_pilots_an_unsolved_prompt_and_extends_once_it_succeeds() -> None:
    est, policy = Estimator(), allocation.build("posterior")  # pilot 4, confidence 0.9
    assert policy.budget(est, "new", [], 32) == 4
    assert policy.budget(est, "new", [F, F, F, F], 32) == 4
    # One right of four: Beta(2, 4); I(9) = 0.885 < 0.9 <= I(10) = 0.9011 (the formula above).
    assert policy.budget(est, "new", [F, T, F, F], 32) == 10
    est.update("never", n=8, k=0)
    assert policy.budget(est, "never", [], 32) == 4  # history holds no success
    est.update("half", n=8, k=4)  # Beta(5, 5): I(n) = 1 - 30240 / ((n+5)...(n+9))
    assert policy.budget(est, "half", [], 32) == 6  # I(5) = 0.874, I(6) = 0.916
    # Never reaching the confidence within n_max: n_max.
    strict = allocation.build("posterior", confidence=0.99)
    assert strict.budget(est, "half", [], 8) == 8  # I(8) = 0.959
    # The pilot is the floor once a prompt has succeeded.
    assert allocation.build("posterior", pilot=8).budget(est, "half", [], 32) == 8


def test_knapsack_greedy_matches_the_hand_computed_allocation() -> None:
    est = Estimator()
    est.set_prompts(["hard", "mid", "easy", "new"])
    for pid, k in (("hard", 0), ("mid", 4), ("easy", 8)):
        est.update(pid, n=8, k=k)
    policy = allocation.build("knapsack", mean_budget=4.0)  # n_min 2
    assert policy.describe() == {"threshold": None, "planned_mean_budget": None}
    budgets = [policy.budget(est, p, [], 16) for p in ("hard", "mid", "easy", "new")]
    # Spare answers: (4 - 2) x 4 = 8. Gains I(n+1) - I(n) from n = 2: mid 0.227, 0.122,
    # 0.070; new 0.167, 0.100, 0.067; hard and easy 0.082, 0.061. The 8 largest go
    # (mid 3, new 3, hard 1, easy 1); the 9th, 0.061, is the threshold.
    assert budgets == [3, 5, 3, 5]
    assert policy.describe()["threshold"] == pytest.approx(0.06083916, abs=1e-7)
    assert policy.describe()["planned_mean_budget"] == 4.0
    # A mean budget of n_max fits every increment: no threshold.
    roomy = allocation.build("knapsack", mean_budget=16.0)
    assert [roomy.budget(est, p, [], 16) for p in ("hard", "new")] == [16, 16]
    assert roomy.describe() == {"threshold": None, "planned_mean_budget": 16.0}


def _brute_force(values: list[np.ndarray], n_min: int, n_max: int, total: int) -> float:
    return max(
        sum(v[n] for v, n in zip(values, ns, strict=True))
        for ns in itertools.product(range(n_min, n_max + 1), repeat=len(values))
        if sum(ns) <= total
    )


@pytest.mark.parametrize("value", ["informative", "paper"])
@pytest.mark.parametrize("seed", range(5))
def test_knapsack_is_optimal_for_the_answers_it_spends(value: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    a, b = rng.uniform(0.5, 6, 4), rng.uniform(0.5, 6, 4)
    policy = allocation.build("knapsack", mean_budget=float(rng.uniform(2, 6)), value=value)
    n_max = 7
    budgets = policy.allocate(policy.gains(a, b, n_max), np.ones(4), n_max)
    assert budgets.sum() <= policy.params.mean_budget * 4
    fn = allocation.informative_probability if value == "informative" else allocation.paper_value
    values = [fn(x, y, n_max) for x, y in zip(a, b, strict=True)]
    spent = sum(v[n] for v, n in zip(values, budgets, strict=True))
    assert spent == pytest.approx(_brute_force(values, 2, n_max, int(budgets.sum())), abs=1e-12)


def test_knapsack_recalibrates_every_so_many_groups() -> None:
    est = Estimator()
    est.set_prompts(["a", "b"])
    policy = allocation.build("knapsack", mean_budget=3.0, recalibrate_every=2)
    policy.budget(est, "a", [], 8)
    before = policy.threshold
    est.update("a", n=8, k=4)
    policy.budget(est, "a", [], 8)
    assert policy.threshold == before  # one group: not yet
    est.update("b", n=8, k=0)
    policy.budget(est, "a", [], 8)
    assert policy.threshold != before


def test_pilot_commit_decides_once_from_the_pilot_and_the_history() -> None:
    est, policy = Estimator(), allocation.build("pilot_commit")  # pilot 4, threshold 0.75
    assert policy.budget(est, "new", [F, F], 16) == 4
    assert policy.budget(est, "new", [F, T, F, F], 16) == 16  # both kinds: informative
    # All wrong: Beta(1, 5), P(a right one among 12 more) = 1 - 5/17 = 12/17 = 0.706.
    assert policy.commit_probability(est, "new", [F] * 4, 12) == pytest.approx(12 / 17)
    assert policy.budget(est, "new", [F] * 4, 16) == 4
    # All right is the mirror image: 1 - E[p^12] under Beta(5, 1).
    assert policy.commit_probability(est, "new", [T] * 4, 12) == pytest.approx(12 / 17)
    lenient = allocation.build("pilot_commit", threshold=0.7)
    assert lenient.budget(est, "new", [F] * 4, 16) == 16
    assert lenient.budget(est, "new", [F] * 4 + [F] * 8, 16) == 16  # decided on the pilot
    # A history of failures makes the commit unlikely: Beta(1, 9 + 4), 12 / 25 = 0.48.
    est.update("hard", n=8, k=0)
    assert policy.commit_probability(est, "hard", [F] * 4, 12) == pytest.approx(12 / 25)
    assert lenient.budget(est, "hard", [F] * 4, 16) == 4
    assert allocation.build("pilot_commit", commit=8).budget(est, "new", [F, T, F, F], 16) == 8


@pytest.mark.parametrize(
    ("name", "params", "n_max", "field"),
    [
        ("posterior", {"pilot": 0}, 16, "pilot"),
        ("posterior", {"confidence": 1.0}, 16, "confidence"),
        ("posterior", {"pilot": 20}, 16, "pilot"),
        ("knapsack", {"mean_budget": 20.0}, 16, "mean_budget"),
        ("knapsack", {"value": "other"}, 16, "value"),
        ("pilot_commit", {"commit": 2}, 16, "commit"),
        ("pilot_commit", {"budget": 2}, 16, "budget"),
    ],
)
def test_bad_parameters_name_the_parameter(name: str, params: dict, n_max: int, field: str):
    with pytest.raises(PolicyError) as info:
        allocation.build(name, **params).validate(n_max)
    assert info.value.field == field


def test_knapsack_and_the_est_rule_bound_their_budgets_alike() -> None:
    knapsack, est = allocation.KnapsackParams.model_fields, EstKnobs.model_fields
    for name in ("n_min", "mean_budget"):
        assert knapsack[name].metadata == est[name].metadata, name
    messages = []
    for refuse in (
        lambda: allocation.build("knapsack", n_min=4, mean_budget=3.0).validate(16),
        lambda: Estimator(n_min=4, mean_budget=3.0, n_max=16),
    ):
        with pytest.raises(PolicyError) as info:
            refuse()
        assert info.value.field == "mean_budget"
        messages.append(str(info.value).split(" needs ", 1)[1])
    assert messages == ["n_min <= mean_budget <= n_max (got 4 <= 3.0 <= 16)"] * 2


def test_an_unknown_policy_names_the_family() -> None:
    with pytest.raises(PolicyError) as info:
        allocation.build("posterier")
    assert info.value.field == "allocation" and "posterior" in str(info.value)


def test_budgets_stay_within_one_and_n_max() -> None:
    est = Estimator()
    est.update("a", n=8, k=3)
    for name in allocation.ALLOCATIONS.names():
        policy = allocation.build(name)
        for n_max in (4, 9, 32):
            if name == "knapsack":
                policy = allocation.build(name, mean_budget=float(min(n_max, 8)))
            for outcomes in ([], [T, F, F, F], [F] * 4):
                assert 1 <= policy.budget(est, "a", outcomes, n_max) <= n_max
