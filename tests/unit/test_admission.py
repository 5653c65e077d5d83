"""history_skip: skip probability from a prompt's streak of zero-variance groups, the
streak kept and persisted by the pass-rate estimator, strict parameters."""

from __future__ import annotations

import json

import pytest

from sampler_service.config import ConfigError, SamplerConfig, check_consistency
from strategies import PolicyError, admission
from strategies.estimator import Estimator


def test_skip_probability_grows_with_the_streak_up_to_the_cap() -> None:
    policy = admission.build("history_skip", explore=0.5, max_skip=0.9)
    assert [policy.probability(s) for s in range(5)] == [0.0, 0.5, 0.75, 0.875, 0.9]
    assert admission.build("history_skip", explore=1.0).probability(7) == 0.0  # never skips
    assert admission.build("history_skip", explore=0.0, max_skip=0.3).probability(1) == 0.3


def test_streak_counts_consecutive_zero_variance_groups_and_persists() -> None:
    est = Estimator()
    policy = admission.build("history_skip")
    assert est.streak("a") == 0 and policy.skip_probability(est, "a") == 0.0
    est.update("a", n=4, k=0)  # all wrong
    est.update("a", n=8, k=8)  # all right
    assert est.streak("a") == 2
    assert policy.skip_probability(est, "a") == 0.75
    est.update("b", n=4, k=0)
    est.update("b", n=4, k=1)  # a group with both ends the streak
    assert est.streak("b") == 0
    restored = Estimator()
    restored.load_state_dict(json.loads(json.dumps(est.state_dict())))
    assert restored.streak("a") == 2 and restored.streak("b") == 0
    restored.update("a", n=2, k=1)
    assert restored.streak("a") == 0


def test_a_state_saved_without_streaks_loads_with_none() -> None:
    est = Estimator()
    est.load_state_dict({"c": 1.0, "finalized": 3, "stats": {"a": [4.0, 0.0]}})
    assert est.seen("a") and est.streak("a") == 0


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"explore": 1.5}, "explore"),
        ({"explore": -0.1}, "explore"),
        ({"max_skip": 1.0}, "max_skip"),
        ({"max_skip": "high"}, "max_skip"),
        ({"explor": 0.5}, "explor"),
    ],
)
def test_bad_parameters_are_errors_naming_the_parameter(params: dict, field: str) -> None:
    with pytest.raises(PolicyError) as info:
        admission.build("history_skip", **params)
    assert info.value.field == field
    cfg = SamplerConfig(admission_policies=[{"name": "history_skip", "params": params}])
    with pytest.raises(ConfigError) as cinfo:
        check_consistency(cfg, ["d"])
    assert cinfo.value.field == f"admission_policies[0].params.{field}"


def test_an_unknown_admission_policy_names_the_policy_field() -> None:
    cfg = SamplerConfig(admission_policies=[{"name": "history_skp"}])
    with pytest.raises(ConfigError) as info:
        check_consistency(cfg, ["d"])
    assert info.value.field == "admission_policies[0].name"
    assert "history_skip" in str(info.value)
