"""The policy registry: names, scopes and errors that name the parameter."""

from __future__ import annotations

import pytest

from strategies import PolicyError, mixing, reweighting, selection, stopping
from strategies.estimator import Estimator
from strategies.registry import NoParams, Params, Registry


class _Knobs(Params):
    size: int = 3


def test_build_validates_and_lists_names():
    registry: Registry[int] = Registry("thing")
    registry.add("double", _Knobs, lambda p: 2 * p.size, scope="group")
    registry.add("none", NoParams, lambda p: 0, scope="batch")
    assert registry.build("double") == 6
    assert registry.build("double", size=5) == 10
    assert registry.names() == ["double", "none"]
    assert registry.names("batch") == ["none"]
    with pytest.raises(ValueError, match="already registered"):
        registry.add("none", NoParams, lambda p: 1, scope="batch")


@pytest.mark.parametrize(
    ("params", "field", "fragment"),
    [
        ({"sise": 4}, "sise", "did you mean 'size'"),
        ({"size": "4"}, "size", "valid integer"),
        ({"size": True}, "size", "valid integer"),
        ({"size": 4.5}, "size", "valid integer"),
    ],
)
def test_misspelled_and_ill_typed_parameters(params, field, fragment):
    registry: Registry[int] = Registry("thing")
    registry.add("double", _Knobs, lambda p: 2 * p.size, scope="group")
    with pytest.raises(PolicyError) as info:
        registry.build("double", **params)
    assert info.value.field == field
    assert fragment in str(info.value)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("family", "name", "params", "field"),
    [
        (selection, "maxvar", {"keep_fraction": 1.5}, "keep_fraction"),
        (selection, "maxvar", {"keep_frac": 0.5}, "keep_frac"),
        (selection, "gfpo", {"metric": "long"}, "metric"),
        (selection, "gfpo", {"k": 2.5}, "k"),
        (selection, "difffilter", {"low": 0.8, "high": 0.2}, "high"),
        (selection, "topk", {"fraction": "half"}, "fraction"),
        (selection, "nonzero_std", {"eps": 0.1}, "eps"),
        (selection, "top_k", {}, "selection"),
        (stopping, "fixed", {"group_size": 0}, "group_size"),
        (stopping, "positive", {"k_pos": 33}, "k_pos"),
        (stopping, "balanced", {"k_pos": 20, "k_neg": 13}, "k_pos"),
        (stopping, "balanced", {"group_size": 33}, "group_size"),
        (stopping, "positive", {"wave_size": 33}, "wave_size"),
        (stopping, "est", {"group_size": 0}, "estimator"),
        (
            stopping,
            "est",
            {"group_size": 0, "n_max": 6, "wave_size": 4, "estimator": Estimator()},
            "mean_budget",
        ),
        (stopping, "balanced", {"kpos": 2}, "kpos"),
        (stopping, "balanced", {"k_pos": "2"}, "k_pos"),
        (stopping, "balanced", {"wave": "adaptve"}, "wave"),
        (stopping, "balanced", {"estimator": "est"}, "estimator"),
        (stopping, "balanced", {"n_max": 0}, "n_max"),
        (reweighting, "per", {"alpha": "half"}, "alpha"),
        (reweighting, "softmax", {"T": 1.0}, "T"),
        (reweighting, "softmax", {"temperature": 0}, "temperature"),
        (reweighting, "diffband", {"low_q": 0.8, "high_q": 0.2}, "high_q"),
        (reweighting, "diffband", {"focus": 2.0}, "focus"),
        (reweighting, "ar", {"alpha": 2}, "alpha"),
        (reweighting, "persist", {}, "reweighting"),
    ],
)
def test_bad_parameters_raise_a_policy_error_naming_the_knob(family, name, params, field):
    with pytest.raises(PolicyError) as info:
        family.build(name, **params)
    assert info.value.field == field
    assert field in str(info.value)


def test_every_policy_declares_its_scope():
    assert {stopping.RULES.entry(n).scope for n in stopping.RULES.names()} == {"prompt"}
    assert selection.build("maxvar").scope == "group"
    assert selection.build("topk").scope == "batch"
    assert [reweighting.build(n).scope for n in ("per", "softmax", "diffband", "ar")] == [
        "batch",
        "batch",
        "batch",
        "token",
    ]
    assert mixing.build("tscl", domains=["a"]).scope == "domain"


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_policy_parameters_are_refused(value):
    """A NaN temperature would make every softmax weight NaN; it is a 422, not a run."""
    with pytest.raises(PolicyError) as info:
        reweighting.REWEIGHTINGS.build("softmax", temperature=value)
    assert info.value.field == "temperature"
    assert "finite" in str(info.value)
